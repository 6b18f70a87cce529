"""apex.fp16_utils: the helpers of apex's manual fp16 recipe that older training code imports
(``from apex.fp16_utils import to_python_float``, ``FP16_Optimizer``). apex deprecated them in
favour of amp; they work here, and FP16_Optimizer says once that amp.initialize(opt_level="O2")
does the same with less code."""
import warnings

import torch

from apex.amp.frontend import _cast_model, _is_batchnorm

__all__ = ["to_python_float", "network_to_half", "convert_network", "BN_convert_float",
           "prep_param_lists", "model_grads_to_master_grads", "master_params_to_model_params",
           "FP16_Optimizer"]


def to_python_float(t):
    """A one-element tensor (or a number) as a Python float."""
    if hasattr(t, "item"):
        return t.item()
    return float(t)


def BN_convert_float(module):
    """Affine BatchNorm layers back to fp32 (their statistics need the range)."""
    if _is_batchnorm(module) and module.affine:
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def convert_network(network, dtype):
    """Floating parameters and buffers to `dtype`, affine BatchNorm layers kept in fp32 (amp's
    own model cast at O2)."""
    return _cast_model(network, dtype, keep_batchnorm_fp32=True)


class _ToHalf(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)


def network_to_half(network, dtype=torch.float16):
    """`network` in half (BatchNorm in fp32) behind a layer that casts its input to half."""
    return torch.nn.Sequential(_ToHalf(dtype), convert_network(network, dtype))


def prep_param_lists(model, flat_master=False):
    """(model_params, master_params): the model's trainable parameters and fp32 copies of them
    that require grad (one flat fp32 tensor when flat_master)."""
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        flat = torch.cat([p.detach().float().reshape(-1) for p in model_params])
        master = torch.nn.Parameter(flat)
        master.grad = torch.zeros_like(master)
        return model_params, [master]
    master_params = [p.detach().clone().float().requires_grad_(True) for p in model_params]
    return model_params, master_params


def model_grads_to_master_grads(model_params, master_params, flat_master=False):
    """The model's gradients copied into the masters' (fp32); a model parameter without a
    gradient leaves its master's gradient None."""
    if flat_master:
        grads = [p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1)
                 for p in model_params]
        master_params[0].grad = torch.cat(grads).float()
        return
    for model, master in zip(model_params, master_params):
        master.grad = None if model.grad is None else model.grad.detach().float().clone()


def master_params_to_model_params(model_params, master_params, flat_master=False):
    """The masters' values written into the model's parameters (rounded to their dtype)."""
    with torch.no_grad():
        if flat_master:
            offset = 0
            for p in model_params:
                n = p.numel()
                p.copy_(master_params[0][offset:offset + n].view_as(p))
                offset += n
            return
        for model, master in zip(model_params, master_params):
            model.copy_(master)


class FP16_Optimizer:
    """apex's FP16_Optimizer: wraps an optimizer over a half model, keeps fp32 masters in its
    groups, scales the loss (static, or dynamic: halved on overflow, doubled after
    `scale_window` clean steps), skips overflowing steps, copies masters back to the model.

        optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   dynamic_loss_scale=True)
        optimizer.zero_grad(); optimizer.backward(loss); optimizer.step()
    """

    _warned = False

    def __init__(self, init_optimizer, static_loss_scale=1.0, dynamic_loss_scale=False,
                 dynamic_loss_args=None, verbose=True):
        if not FP16_Optimizer._warned:
            warnings.warn("apex.fp16_utils.FP16_Optimizer is deprecated (as in apex): "
                          "amp.initialize(model, optimizer, opt_level='O2') does the same",
                          DeprecationWarning, stacklevel=2)
            FP16_Optimizer._warned = True
        if not isinstance(init_optimizer, torch.optim.Optimizer):
            raise TypeError(f"FP16_Optimizer: expected a torch.optim.Optimizer, got "
                            f"{type(init_optimizer).__name__}")
        if not static_loss_scale > 0:
            raise ValueError(f"FP16_Optimizer: static_loss_scale must be > 0, got "
                             f"{static_loss_scale}")
        self.optimizer = init_optimizer
        self.verbose = verbose
        self.fp16_groups, self.fp32_from_fp16_groups = [], []
        for group in self.optimizer.param_groups:
            halves, masters, params = [], [], []
            for p in group["params"]:
                if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16):
                    m = p.detach().clone().float().requires_grad_(True)
                    if p in self.optimizer.state:
                        self.optimizer.state[m] = self.optimizer.state.pop(p)
                    halves.append(p)
                    masters.append(m)
                    params.append(m)
                else:
                    params.append(p)
            group["params"] = params
            self.fp16_groups.append(halves)
            self.fp32_from_fp16_groups.append(masters)
        self.dynamic_loss_scale = dynamic_loss_scale
        args = dict(init_scale=2.0 ** 32, scale_factor=2.0, scale_window=1000)
        args.update(dynamic_loss_args or {})
        self.cur_scale = float(args["init_scale"] if dynamic_loss_scale else static_loss_scale)
        self.scale_factor = float(args["scale_factor"])
        self.scale_window = int(args["scale_window"])
        self._clean_steps = 0
        self.overflow = False

    @property
    def loss_scale(self):
        return self.cur_scale

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_grads_to_None=False):
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        for halves in self.fp16_groups:
            for p in halves:
                if set_grads_to_None or p.grad is None:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def backward(self, loss, update_master_grads=True, retain_graph=False):
        (loss.float() * self.cur_scale).backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self):
        """Model gradients, unscaled, into the masters'; sets `overflow` when any is not finite."""
        self.overflow = False
        inv = 1.0 / self.cur_scale
        for halves, masters in zip(self.fp16_groups, self.fp32_from_fp16_groups):
            for p, m in zip(halves, masters):
                if p.grad is None:
                    m.grad = None
                    continue
                g = p.grad.detach().float() * inv
                if not torch.isfinite(g).all():
                    self.overflow = True
                m.grad = g
        masters = {id(m) for ms in self.fp32_from_fp16_groups for m in ms}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and id(p) not in masters:  # fp32 model parameters
                    p.grad.mul_(inv)
                    if not torch.isfinite(p.grad).all():
                        self.overflow = True

    def clip_master_grads(self, max_norm, norm_type=2):
        """Clips the masters' gradients by their total norm (returns it; -1 on overflow)."""
        if self.overflow:
            return -1
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def step(self, closure=None):
        if closure is not None:
            raise RuntimeError("FP16_Optimizer.step: closures are not supported here; call "
                               "backward(loss) then step()")
        if self.overflow:
            if self.verbose:
                print(f"FP16_Optimizer: gradient overflow, skipping step, loss scale "
                      f"{self.cur_scale} -> {self.cur_scale / self.scale_factor}")
            if self.dynamic_loss_scale:
                self.cur_scale = max(self.cur_scale / self.scale_factor, 1.0)
                self._clean_steps = 0
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None
            return None
        out = self.optimizer.step()
        with torch.no_grad():
            for halves, masters in zip(self.fp16_groups, self.fp32_from_fp16_groups):
                for p, m in zip(halves, masters):
                    p.copy_(m)
        if self.dynamic_loss_scale:
            self._clean_steps += 1
            if self._clean_steps % self.scale_window == 0:
                self.cur_scale *= self.scale_factor
        return out

    def state_dict(self):
        return {"dynamic_loss_scale": self.dynamic_loss_scale, "cur_scale": self.cur_scale,
                "cur_iter": self._clean_steps, "optimizer_state_dict": self.optimizer.state_dict(),
                "fp32_from_fp16": [[m.detach().clone() for m in ms]
                                   for ms in self.fp32_from_fp16_groups]}

    def load_state_dict(self, state_dict):
        masters = state_dict["fp32_from_fp16"]
        if len(masters) != len(self.fp32_from_fp16_groups) or any(
                len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b))
                for a, b in zip(masters, self.fp32_from_fp16_groups)):
            raise ValueError("FP16_Optimizer.load_state_dict: the saved masters do not match this "
                             "optimizer's parameters")
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self.cur_scale = float(state_dict["cur_scale"])
        self._clean_steps = int(state_dict["cur_iter"])
        with torch.no_grad():
            for saved, ms, halves in zip(masters, self.fp32_from_fp16_groups, self.fp16_groups):
                for s, m, p in zip(saved, ms, halves):
                    m.copy_(s)
                    p.copy_(s)
