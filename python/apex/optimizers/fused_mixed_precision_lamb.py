import torch

from .fused_lamb import FusedLAMB


class FusedMixedPrecisionLamb(FusedLAMB):
    """LAMB for reduced-precision parameters (apex's FusedMixedPrecisionLamb): parameters of
    ``reduced_precision_dtype`` are stepped through fp32 masters, created from them at the first
    step (after DDP has broadcast them) and kept in ``param_groups_full_precision``, and rounded
    once into the parameters. ``lr`` and ``step`` are tensors in each group, as apex keeps them;
    the moments are fp32 whatever the parameters' dtype (apex keeps them in the parameters' dtype
    when they have no master). The step count advances only on steps that are not skipped.

    Loading a state dict keeps the moments fp32 and rebuilds the masters from the parameters at
    the next step (so a model loaded after the optimizer is not overwritten by stale masters)."""

    def __init__(self, params, lr=1e-3, step=0, bias_correction=True, betas=(0.9, 0.999),
                 eps=1e-6, weight_decay=0.01, amsgrad=False, adam_w_mode=True,
                 grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False,
                 reduced_precision_dtype=None):
        if reduced_precision_dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError("FusedMixedPrecisionLamb: reduced_precision_dtype must be None, "
                             f"torch.float16 or torch.bfloat16, got {reduced_precision_dtype}")
        if int(step) < 0:
            raise ValueError(f"FusedMixedPrecisionLamb: step must be >= 0, got {step}")
        super().__init__(params, lr=float(lr), bias_correction=bias_correction, betas=betas,
                         eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         adam_w_mode=adam_w_mode, grad_averaging=grad_averaging,
                         set_grad_none=True, max_grad_norm=max_grad_norm, use_nvlamb=use_nvlamb)
        self.reduced_precision_dtype = reduced_precision_dtype
        self.param_groups_full_precision = []
        self.defaults["lr"] = torch.tensor(float(lr), dtype=torch.float32)
        self.defaults["step"] = torch.tensor([int(step)], dtype=torch.int)
        for group in self.param_groups:
            self._tensor_items(group)

    def _tensor_items(self, group):
        """lr and step as tensors on the group's device (each group its own)."""
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32).to(device).clone()
        step = group.get("step", self.defaults.get("step", 0))
        group["step"] = torch.as_tensor(step, dtype=torch.int).reshape(1).to(device).clone()

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        if hasattr(self, "param_groups_full_precision"):  # not during __init__
            self._tensor_items(self.param_groups[-1])
            self.param_groups_full_precision = []

    @staticmethod
    def _advance(group):
        group["step"] += 1

    def _masters(self, group, params):
        if self.reduced_precision_dtype is None or params[0].dtype != self.reduced_precision_dtype:
            return []
        if not self.param_groups_full_precision:
            self.param_groups_full_precision = [
                {"params": [p.detach().clone().to(torch.float32)
                            if p.dtype == self.reduced_precision_dtype else None
                            for p in g["params"]]}
                for g in self.param_groups]
        index = next(i for i, g in enumerate(self.param_groups) if g is group)
        full = self.param_groups_full_precision[index]["params"]
        where = {id(p): i for i, p in enumerate(group["params"])}
        return [full[where[id(p)]] for p in params]

    def load_state_dict(self, state_dict):
        """The state back in fp32 (_FusedOptimizer), lr and step as tensors again."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            self._tensor_items(group)
        self.param_groups_full_precision = []
