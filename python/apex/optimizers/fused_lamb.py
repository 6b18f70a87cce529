import torch

from apex._ops import ops

from ._base import _FusedOptimizer, grads_of


class FusedLAMB(_FusedOptimizer):
    """LAMB (apex's FusedLAMB): gradients clipped by their global norm over every group
    (``max_grad_norm``, 0 turns it off), an Adam-style update, and the layer-wise trust ratio
    ``lr * |p| / |u|`` (when weight decay or ``use_nvlamb``). Unlike apex, the gradients are never
    overwritten by the update. State: ``exp_avg``, ``exp_avg_sq``; step count in the group."""

    _elementwise_state = ("exp_avg", "exp_avg_sq", "master_param")

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True,
                 set_grad_none=True, max_grad_norm=1.0, use_nvlamb=False):
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        if not (lr >= 0 and eps >= 0 and weight_decay >= 0 and max_grad_norm >= 0):
            raise ValueError("FusedLAMB: lr, eps, weight_decay and max_grad_norm must be >= 0")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"FusedLAMB: betas[{i}] must be in [0, 1), got {b}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, set_grad_none)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.use_nvlamb = use_nvlamb
        import amp_C
        self.multi_tensor_l2norm = amp_C.multi_tensor_l2norm
        self.multi_tensor_lamb = amp_C.multi_tensor_lamb

    def _step(self, scaling):
        buckets = [(group, self._buckets(group, "FusedLAMB")) for group in self.param_groups]
        all_params = [p for _, bs in buckets for b in bs for p in b]
        if not all_params:
            return
        device0 = all_params[0].device
        inv0, found0 = self._on(scaling, device0)
        if self._skip(found0, all_params, inv0):
            return
        # The global norm of the unscaled gradients, over every group and dtype.
        squares = []
        by_device = {}
        for p in all_params:
            by_device.setdefault((p.device, p.grad.dtype), []).append(p.grad)
        for (device, _), grads in by_device.items():
            noop = self._noop(device)
            inv, _ = self._on(scaling, device)
            norm = (ops.multi_tensor_unscale_l2norm(noop, grads, inv, False)[0] if inv is not None
                    else ops.multi_tensor_l2norm(noop, grads, False)[0])
            squares.append(norm.to(device0).square())
        global_norm = torch.stack(squares).sum().sqrt().reshape(1)
        for group, group_buckets in buckets:
            if not group_buckets:
                continue
            self._advance(group)
            beta1, beta2 = group["betas"]
            for params in group_buckets:
                device = params[0].device
                inv, _ = self._on(scaling, device)
                m = [self._state_zeros(p, "exp_avg") for p in params]
                v = [self._state_zeros(p, "exp_avg_sq") for p in params]
                ops.multi_tensor_lamb(self._noop(device), grads_of(params), params, m, v,
                                      self._masters(group, params),
                                      float(group["lr"]), beta1, beta2, group["eps"],
                                      int(group["step"]), bool(group["bias_correction"]),
                                      group["weight_decay"], bool(group["grad_averaging"]),
                                      self.adam_w_mode == 1, global_norm.to(device),
                                      group["max_grad_norm"], self.use_nvlamb, inv, None,
                                      inv is not None)

    @staticmethod
    def _advance(group):
        group["step"] = group.get("step", 0) + 1

    def _masters(self, group, params):
        """The fp32 masters the kernel updates (and rounds into `params`); none here."""
        return []
