import torch

from apex._ops import ops

from ._base import _FusedOptimizer, grads_of


class FusedNovoGrad(_FusedOptimizer):
    """NovoGrad (apex's FusedNovoGrad): a per-tensor second moment of the gradient norm,
    ``v = sqrt(b2 v^2 + (1 - b2) |g|^2)`` (``norm_type`` 2; 0 blends the max norm linearly), seeded
    with the first norm (or zero, ``init_zero``). State: ``exp_avg`` per parameter and the
    per-tensor ``exp_avg_sq`` norms; step count in the group."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, amsgrad=False, reg_inside_moment=False, grad_averaging=True,
                 norm_type=2, init_zero=False, set_grad_none=True):
        if amsgrad:
            raise RuntimeError("FusedNovoGrad does not support the AMSGrad variant.")
        if norm_type not in (0, 2):
            raise RuntimeError(f"FusedNovoGrad only supports norm_type 0 (max) and 2 (l2), "
                               f"got {norm_type}")
        if not (lr >= 0 and eps >= 0 and weight_decay >= 0):  # NaN refused too
            raise ValueError("FusedNovoGrad: lr, eps and weight_decay must be >= 0")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        norm_type=norm_type, init_zero=init_zero)
        super().__init__(params, defaults, set_grad_none)
        self.moment_mode = 0 if reg_inside_moment else 1

    def _step_group(self, group, scaling):
        buckets = self._buckets(group, "FusedNovoGrad")
        if not buckets:
            return
        inv, found_inf = self._on(scaling, group["params"][0].device)
        if self._skip(found_inf, group["params"], inv):
            return
        group["step"] = group.get("step", 0) + 1
        beta1, beta2 = group["betas"]
        l2 = group["norm_type"] == 2
        for params in buckets:
            device = params[0].device
            grads = grads_of(params)
            noop = self._noop(device)
            if l2:
                norms = ops.multi_tensor_l2norm(noop, grads, True)[1]
            else:
                norms = torch.stack([g.detach().abs().max().float() for g in grads])
            if inv is not None:
                norms = norms * inv.to(device)
            old = []
            for i, p in enumerate(params):
                state = self.state[p]
                if "exp_avg_sq" not in state:
                    # Fresh: zero (init_zero), or this step's norm so the first blend keeps it.
                    state["exp_avg_sq"] = (torch.zeros((), dtype=torch.float32, device=device)
                                           if group["init_zero"] else norms[i].clone())
                old.append(state["exp_avg_sq"].reshape(()))
            v_old = torch.stack(old)
            v = ((v_old.square() * beta2 + norms.square() * (1.0 - beta2)).sqrt() if l2
                 else v_old * beta2 + norms * (1.0 - beta2))
            m = [self._state_zeros(p, "exp_avg") for p in params]
            ops.multi_tensor_novograd(noop, grads, params, m, [], v, float(group["lr"]), beta1,
                                      beta2, group["eps"], int(group["step"]),
                                      bool(group["bias_correction"]), group["weight_decay"],
                                      bool(group["grad_averaging"]), self.moment_mode == 0,
                                      inv.to(device) if inv is not None else None, None,
                                      inv is not None)
            for i, p in enumerate(params):
                self.state[p]["exp_avg_sq"] = v[i].clone()
