"""apex.parallel.LARC: layer-wise adaptive rate control around any optimizer (SimCLR/MoCo-style
training code imports it as ``from apex.parallel.LARC import LARC``).

Per parameter with a gradient, before the wrapped optimizer steps:

    local_lr = trust_coefficient * |p| / (|g| + weight_decay * |p| + eps)
    clip=True:  g <- (g + weight_decay * p) * min(local_lr / lr, 1)   (LARC: the rate never exceeds lr)
    clip=False: g <- (g + weight_decay * p) * local_lr                 (LARS: the rate scales lr)

where a zero |p| or |g| leaves the factor at 1. The group's weight decay is folded into the
gradient there, so the wrapped optimizer runs with weight_decay 0 for that step (restored after).
apex-cpp's C++ library has the same wrapper (apex::optim::LARC)."""
import torch

__all__ = ["LARC"]


class LARC:
    def __init__(self, optimizer, trust_coefficient=0.02, clip=True, eps=1e-8):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"LARC: optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        for name, v in (("trust_coefficient", trust_coefficient), ("eps", eps)):
            if not (isinstance(v, (int, float)) and v >= 0):
                raise ValueError(f"LARC: {name} must be a number >= 0, got {v!r}")
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.clip = clip

    # The wrapped optimizer's interface, as apex's LARC forwards it.
    def __getstate__(self):
        return self.optim.__getstate__()

    def __setstate__(self, state):
        self.optim.__setstate__(state)

    @property
    def state(self):
        return self.optim.state

    def __repr__(self):
        return f"LARC({self.optim!r}, trust_coefficient={self.trust_coefficient}, " \
               f"clip={self.clip}, eps={self.eps})"

    @property
    def param_groups(self):
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optim.param_groups = value

    @property
    def defaults(self):
        return self.optim.defaults

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict):
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, *args, **kwargs):
        self.optim.zero_grad(*args, **kwargs)

    def add_param_group(self, param_group):
        self.optim.add_param_group(param_group)

    def step(self, closure=None):
        decays = []
        with torch.no_grad():
            for group in self.optim.param_groups:
                weight_decay = group.get("weight_decay", 0.0)
                decays.append(weight_decay)
                group["weight_decay"] = 0.0
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    param_norm = torch.linalg.vector_norm(p.detach().float())
                    grad_norm = torch.linalg.vector_norm(p.grad.detach().float())
                    # One factor per tensor; 1 where either norm is zero (as apex).
                    local_lr = self.trust_coefficient * param_norm / (
                        grad_norm + param_norm * weight_decay + self.eps)
                    if self.clip:
                        local_lr = torch.clamp(local_lr / group["lr"], max=1.0)
                    factor = torch.where((param_norm != 0) & (grad_norm != 0), local_lr,
                                         torch.ones_like(local_lr))
                    if weight_decay != 0:
                        p.grad.add_(p.detach(), alpha=weight_decay)
                    p.grad.mul_(factor.to(p.grad.dtype))
        try:
            return self.optim.step(closure) if closure is not None else self.optim.step()
        finally:
            for group, weight_decay in zip(self.optim.param_groups, decays):
                group["weight_decay"] = weight_decay
