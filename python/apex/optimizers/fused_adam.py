import copy

import torch

from apex._ops import ops

from ._base import _FusedOptimizer, grads_of


class FusedAdam(_FusedOptimizer):
    """Adam (``adam_w_mode=False``) and AdamW (the default, as in apex), all parameters of a group
    updated in one pass per (device, dtype) through apex-cpp's kernels, on CPU and CUDA tensors.

    apex's signature and state: the step count lives in the param group (``group["step"]``, an
    int, or a device tensor when ``capturable``); ``exp_avg`` / ``exp_avg_sq`` are fp32 whatever
    the parameters' dtype. ``master_weights`` keeps fp32 masters of half parameters
    (``state["master_param"]``), updated in the same pass. Under ``torch.amp.GradScaler`` the
    gradients are unscaled inside the kernel and an overflow skips the step.
    """

    _elementwise_state = ("exp_avg", "exp_avg_sq", "master_param")

    def _convert_state_dict(self, state_dict):
        """torch.optim.Adam/AdamW keep `step` per parameter; apex's FusedAdam per group. A state
        in torch's layout (amsgrad off) is converted: each group's step is its parameters'."""
        if not isinstance(state_dict, dict) or "state" not in state_dict or \
                "param_groups" not in state_dict:
            return state_dict
        states = state_dict["state"]
        if not any(isinstance(v, dict) and "step" in v for v in states.values()):
            return state_dict
        if any(isinstance(v, dict) and "max_exp_avg_sq" in v for v in states.values()):
            raise ValueError("FusedAdam.load_state_dict: the state is torch's Adam with amsgrad, "
                             "which FusedAdam does not support")
        if any(isinstance(g, dict) and g.get("maximize") for g in state_dict["param_groups"]):
            raise ValueError("FusedAdam.load_state_dict: the state is torch's Adam with "
                             "maximize=True, which FusedAdam does not support")
        state_dict = copy.copy(state_dict)
        # torch's groups lack FusedAdam's own options (bias_correction, ...): this optimizer's
        # current values fill them, torch's hyperparameters (lr, betas, eps, ...) win, and
        # torch's switches FusedAdam has no use for (foreach, fused, capturable, ...) go.
        groups = [dict({k: v for k, v in own.items() if k != "params"},
                       **{k: v for k, v in g.items() if k in own or k == "params"})
                  for own, g in zip(self.param_groups, state_dict["param_groups"])]
        new_states = {}
        for g in groups:
            steps = {int(torch.as_tensor(states[i]["step"]).item()) for i in g["params"]
                     if i in states and "step" in states[i]}
            if len(steps) > 1:
                raise ValueError(f"FusedAdam.load_state_dict: torch's state has parameters at "
                                 f"different steps {sorted(steps)} in one group; FusedAdam keeps "
                                 "one step per group")
            if steps:
                g["step"] = steps.pop()
            for i in g["params"]:
                if i in states:
                    new_states[i] = {k: v for k, v in states[i].items() if k != "step"}
        state_dict["param_groups"] = groups
        state_dict["state"] = new_states
        return state_dict

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True,
                 capturable=False, master_weights=False):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if master_weights and not capturable:
            raise RuntimeError("Master weights is currently only supported with the capturable "
                               "version.")
        if not (lr >= 0 and eps >= 0 and weight_decay >= 0):  # NaN refused too
            raise ValueError(f"FusedAdam: lr, eps and weight_decay must be >= 0, got lr={lr}, "
                             f"eps={eps}, weight_decay={weight_decay}")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"FusedAdam: betas[{i}] must be in [0, 1), got {b}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults, set_grad_none)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.capturable = capturable
        self.master_weights = master_weights
        # fairseq's FusedAdamV2 calls these attributes.
        import amp_C
        self.multi_tensor_adam = amp_C.multi_tensor_adam
        self.multi_tensor_adam_capturable = amp_C.multi_tensor_adam_capturable
        self.multi_tensor_adam_capturable_master = amp_C.multi_tensor_adam_capturable_master
        if capturable:
            for group in self.param_groups:
                self._capturable_items(group)

    def _capturable_items(self, group):
        """Capturable mode: lr and the step counter as tensors on the group's device."""
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        if not torch.is_tensor(group["lr"]):
            group["lr"] = torch.tensor(group["lr"], dtype=torch.float32, device=device)
        if not torch.is_tensor(group.get("step")):
            group["step"] = torch.zeros(1, dtype=torch.int32, device=device)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        if getattr(self, "capturable", False):  # not during __init__ (set after)
            self._capturable_items(self.param_groups[-1])

    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None,
             **kwargs):
        """One step. ``grad_scaler=`` (apex's keyword) is taken from ``kwargs``, so that torch's
        GradScaler sees no such parameter and hands over ``grad_scale``/``found_inf`` instead
        (``grad_scale`` None once ``unscale_`` ran: the gradients are then not unscaled twice)."""
        grad_scaler = kwargs.pop("grad_scaler", None)
        if kwargs:
            raise TypeError(f"FusedAdam.step got unexpected keyword arguments {sorted(kwargs)}")
        self._check_legacy("FusedAdam", grads=grads, output_params=output_params, scale=scale,
                           grad_norms=grad_norms)
        return self._run(closure, grad_scaler)

    def _step_group(self, group, scaling):
        buckets = self._buckets(group, "FusedAdam")
        beta1, beta2 = group["betas"]
        device = group["params"][0].device
        inv_scale, found_inf = self._on(scaling, device)
        if self.capturable:
            # The counter advances on the device, and only when the step is not skipped.
            if found_inf is None:
                group["step"] += 1
            else:
                group["step"] += (found_inf == 0).to(group["step"].dtype)
            step_t = group["step"].to(torch.float32)
            lr_t = group["lr"] if torch.is_tensor(group["lr"]) else torch.tensor(
                [group["lr"]], dtype=torch.float32, device=device)
        else:
            if self._skip(found_inf, group["params"], inv_scale):
                return
            found_inf = None
            group["step"] = group.get("step", 0) + 1
        for params in buckets:
            masters = [self._master(p) for p in params] if (
                self.master_weights and params[0].dtype != torch.float32) else []
            m = [self._state_zeros(p, "exp_avg") for p in params]
            v = [self._state_zeros(p, "exp_avg_sq") for p in params]
            noop = self._noop(params[0].device)
            if self.capturable:
                ops.multi_tensor_adam(noop, grads_of(params), params, m, v, masters, 0.0, beta1,
                                      beta2, group["eps"], 1, self.adam_w_mode == 1,
                                      bool(group["bias_correction"]), group["weight_decay"],
                                      inv_scale, found_inf, lr_t.reshape(1).to(torch.float32),
                                      step_t.reshape(1), inv_scale is not None)
            else:
                ops.multi_tensor_adam(noop, grads_of(params), params, m, v, masters,
                                      float(group["lr"]), beta1, beta2, group["eps"],
                                      int(group["step"]), self.adam_w_mode == 1,
                                      bool(group["bias_correction"]), group["weight_decay"],
                                      inv_scale, None, None, None, inv_scale is not None)
