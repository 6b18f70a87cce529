import torch

from apex._ops import ops

from ._base import _FusedOptimizer, grads_of


class FusedAdagrad(_FusedOptimizer):
    """Adagrad (torch.optim.Adagrad's update; apex's ``adagrad_w_mode`` decays the weights
    directly). State: ``sum`` (fp32) and ``step`` per parameter, as torch.optim.Adagrad keeps."""

    _elementwise_state = ("sum",)
    _other_state = ("step",)

    def __init__(self, params, lr=1e-2, eps=1e-10, weight_decay=0.0, set_grad_none=True,
                 adagrad_w_mode=False, lr_decay=0.0, initial_accumulator_value=0.0):
        if not (lr >= 0 and eps >= 0 and weight_decay >= 0 and lr_decay >= 0
                and initial_accumulator_value >= 0):  # NaN refused too
            raise ValueError("FusedAdagrad: lr, eps, weight_decay, lr_decay and "
                             "initial_accumulator_value must be >= 0")
        defaults = dict(lr=lr, eps=eps, weight_decay=weight_decay, lr_decay=lr_decay,
                        initial_accumulator_value=initial_accumulator_value)
        super().__init__(params, defaults, set_grad_none)
        self.adagrad_w_mode = 1 if adagrad_w_mode else 0
        import amp_C
        self.multi_tensor_adagrad = amp_C.multi_tensor_adagrad

    def _step_group(self, group, scaling):
        buckets = self._buckets(group, "FusedAdagrad")
        if not buckets:
            return
        inv, found_inf = self._on(scaling, group["params"][0].device)
        if self._skip(found_inf, group["params"], inv):
            return
        for bucket in buckets:
            # The decayed lr depends on each parameter's step: one call per step value.
            by_step = {}
            for p in bucket:
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.full_like(p, group["initial_accumulator_value"],
                                                   dtype=torch.float32,
                                                   memory_format=torch.preserve_format)
                    state["step"] = torch.tensor(0.0)
                state["step"] += 1
                by_step.setdefault(int(state["step"].item()), []).append(p)
            for step, params in by_step.items():
                lr = group["lr"] / (1 + (step - 1) * group["lr_decay"])
                ops.multi_tensor_adagrad(self._noop(params[0].device), grads_of(params), params,
                                         [self.state[p]["sum"] for p in params], [], lr,
                                         group["eps"], self.adagrad_w_mode == 1,
                                         group["weight_decay"],
                                         inv.to(params[0].device) if inv is not None else None,
                                         None, inv is not None)
