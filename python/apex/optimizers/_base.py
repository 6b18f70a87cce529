"""What apex's fused optimizers share here: parameter buckets, the noop flag, and torch's GradScaler
protocol (``grad_scale`` / ``found_inf`` set on the optimizer before ``step``, so gradients are
unscaled inside the kernel and an overflow skips the step without unscaling anything)."""
from collections import defaultdict
import ctypes
import math
import zlib
from itertools import chain

import torch

from apex._ops import ops


_CRC_KEY = "apex_crc32"


def _state_crc32(sd):
    """CRC-32 of an optimizer state dict's structure and state: each group's parameter ids,
    step and switches (bias_correction, nesterov, ...), then each state entry's key, and each
    value's dtype, shape and bytes. The numeric hyperparameters stay out: setting a new lr in a
    saved state before loading it is common (load_state_dict checks their range instead)."""
    structure = [[(k, v) for k, v in g.items() if k in ("params", "step") or isinstance(v, bool)
                  or not isinstance(v, (int, float, tuple, list, torch.Tensor))]
                 for g in sd["param_groups"]]
    crc = zlib.crc32(repr(structure).encode())
    for pid in sorted(sd["state"], key=repr):
        entry = sd["state"][pid]
        crc = zlib.crc32(repr(pid).encode(), crc)
        for key in sorted(entry, key=repr):
            value = entry[key]
            if torch.is_tensor(value):
                t = value.detach().cpu().contiguous()
                crc = zlib.crc32(f"{key!r}:{t.dtype}:{tuple(t.shape)}".encode(), crc)
                if t.numel() > 0:
                    raw = (ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(
                        t.data_ptr())
                    crc = zlib.crc32(raw, crc)
            else:
                crc = zlib.crc32(f"{key!r}={value!r}".encode(), crc)
    return crc


def _finite_nonnegative(value):
    """A number (or a one-element tensor) that is finite and >= 0; bools are not numbers here."""
    v = value.item() if torch.is_tensor(value) and value.numel() == 1 else value
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and v >= 0)


class _FusedOptimizer(torch.optim.Optimizer):
    # GradScaler hands us its scale and found_inf instead of unscaling the gradients itself.
    _step_supports_amp_scaling = True

    def __init__(self, params, defaults, set_grad_none):
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int)

    def zero_grad(self, set_to_none=None):
        """Clears the gradients: to None when ``set_grad_none`` (the default of most of apex's
        optimizers), else to zero, unless ``set_to_none`` says otherwise."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def step(self, closure=None):
        """One step of every group; `closure`, when given, is called first with grad enabled and
        its loss returned."""
        return self._run(closure, None)

    def _run(self, closure, grad_scaler):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        first = next((p for g in self.param_groups for p in g["params"]), None)
        if first is None:  # no parameters at all (empty groups are skipped, as apex does)
            return loss
        self._validate()
        with torch.no_grad():
            self._step(self._scaling(grad_scaler, first.device))
        return loss

    def _validate(self):
        """Every group's parameters and gradients checked before anything changes (step counters,
        new moments, earlier groups' updates): a refused step leaves the optimizer as it was."""
        name = type(self).__name__
        floats = (torch.float32, torch.float16, torch.bfloat16)
        self._check_no_overlap(name)  # also the same tensor twice
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                where = f"parameter {i} of group {gi}"
                g = p.grad
                if g is None:
                    continue
                if g.is_sparse:
                    raise RuntimeError(f"{name} does not support sparse gradients, please "
                                       "consider SparseAdam instead")
                if p.dtype not in floats or g.dtype not in floats:
                    raise RuntimeError(f"{name}: {where} is {p.dtype} with a {g.dtype} gradient; "
                                       "expected float32, float16 or bfloat16")
                if g.shape != p.shape:
                    raise RuntimeError(f"{name}: the gradient of {where} has shape "
                                       f"{tuple(g.shape)}, expected the parameter's "
                                       f"{tuple(p.shape)}")
                if g.device != p.device:
                    raise RuntimeError(f"{name}: the gradient of {where} is on {g.device}, the "
                                       f"parameter on {p.device}")
                if not _dense(p) or not _dense(g):
                    raise RuntimeError(f"{name}: {where} and its gradient must be dense "
                                       "(non-overlapping, no gaps)")
                if any(n > 1 and a != b for n, a, b in zip(p.shape, p.stride(), g.stride())):
                    raise RuntimeError(f"{name}: the gradient of {where} has strides "
                                       f"{g.stride()} but the parameter has {p.stride()} (make "
                                       "the gradient contiguous like its parameter)")

    def _check_no_overlap(self, name):
        """Parameters that share memory (views of one tensor, or the same storage twice) would
        be updated twice in one step, each update reading the other's half-written values:
        refused, naming both (torch.optim updates them twice, one after the other)."""
        spans = []
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.numel() == 0 or p.device.type == "meta":
                    continue
                start = p.data_ptr()
                spans.append((start, start + p.numel() * p.element_size(), p.device, gi, i))
        spans.sort(key=lambda t: (str(t[2]), t[0]))
        for a, b in zip(spans, spans[1:]):
            if a[2] == b[2] and b[0] < a[1]:
                raise RuntimeError(f"{name}: parameter {b[4]} of group {b[3]} shares memory with "
                                   f"parameter {a[4]} of group {a[3]}; each parameter must own "
                                   "its memory (one update per element per step)")

    def _step(self, scaling):
        for group in self.param_groups:
            if group["params"]:
                self._step_group(group, scaling)

    # Per-parameter state keys of each optimizer: tensors shaped like the parameter, and others.
    _elementwise_state = ()
    _other_state = ()

    def _check_state_dict(self, state_dict):
        """Kind, keys, shapes and dtypes of a state dict, checked before anything is replaced
        (torch's loader replaces first and a bad entry fails later, in a step)."""
        name = type(self).__name__
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
            keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"{name}.load_state_dict: expected an optimizer state dict with "
                             f"'state' and 'param_groups', got {keys}")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(g.get("params", ())) != len(o["params"]) for g, o in zip(groups, self.param_groups)):
            raise ValueError(f"{name}.load_state_dict: the state has "
                             f"{[len(g.get('params', ())) for g in groups]} parameters per group, "
                             f"this optimizer {[len(g['params']) for g in self.param_groups]}")
        for gi, g in enumerate(groups):
            self._check_hyperparameters(name, gi, g)
        # torch's loader keeps a state entry whose key no group names under that raw key, and
        # the parameter it belonged to starts over: every key must be a parameter's, once.
        named = [i for g in groups for i in g["params"]]
        if len(set(named)) != len(named):
            raise ValueError(f"{name}.load_state_dict: param_groups name a parameter twice "
                             f"({named})")
        named_set = set(named)
        stray = [k for k in state_dict["state"] if k not in named_set]
        if stray:
            raise ValueError(f"{name}.load_state_dict: the state holds entries {stray} that no "
                             f"parameter group names (the groups name {named})")
        allowed = set(self._elementwise_state) | set(self._other_state)
        ids = chain.from_iterable(g["params"] for g in groups)
        for index, (pid, p) in enumerate(zip(ids, chain.from_iterable(
                g["params"] for g in self.param_groups))):
            entry = state_dict["state"].get(pid)
            if entry is None:
                continue
            if not isinstance(entry, dict):
                raise ValueError(f"{name}.load_state_dict: the state of parameter {index} is a "
                                 f"{type(entry).__name__}, expected a dict")
            for key, value in entry.items():
                if allowed and key not in allowed:
                    raise ValueError(f"{name}.load_state_dict: the state of parameter {index} "
                                     f"holds {key!r}, which {name} does not keep (expected "
                                     f"{sorted(allowed)}): another optimizer's state?")
                if key == "step" and not _finite_nonnegative(value):
                    raise ValueError(f"{name}.load_state_dict: 'step' of parameter {index} "
                                     f"must be a finite number >= 0, got {value!r}")
                if key in self._elementwise_state:
                    if not torch.is_tensor(value) or not value.is_floating_point() or \
                            value.shape != p.shape:
                        got = (f"{value.dtype} {tuple(value.shape)}" if torch.is_tensor(value)
                               else type(value).__name__)
                        raise ValueError(f"{name}.load_state_dict: {key!r} of parameter {index} "
                                         f"is {got}, expected a floating tensor of shape "
                                         f"{tuple(p.shape)}")
        for gi, (g, own) in enumerate(zip(groups, self.param_groups)):
            # torch's loader takes the saved group whole: a key of another optimizer would ride
            # along, a missing one fail in a later step. (`step` comes with the first step.)
            loose = {"params", "param_names", "step"}
            extra = sorted(set(g) - set(own) - loose)
            missing = sorted(set(own) - set(g) - loose)
            if extra or missing:
                raise ValueError(f"{name}.load_state_dict: group {gi} holds "
                                 f"{sorted(set(g) - loose)}, {name} keeps "
                                 f"{sorted(set(own) - loose)}: another optimizer's state?")

    @staticmethod
    def _check_hyperparameters(name, gi, group):
        """A loaded group's hyperparameters, as the constructor checks its arguments: every
        number finite and >= 0 (lr, eps, weight_decay, momentum, ...), betas in [0, 1). A damaged
        or hand-edited state would otherwise step with lr=nan or a negative decay."""
        for key, value in group.items():
            if key == "params" or isinstance(value, bool):
                continue
            if key == "betas":
                ok = isinstance(value, (tuple, list)) and all(
                    isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0
                    for b in value)
                if not ok:
                    raise ValueError(f"{name}.load_state_dict: betas of group {gi} must be "
                                     f"numbers in [0, 1), got {value!r}")
            elif (isinstance(value, (int, float)) or (torch.is_tensor(value) and value.numel() == 1
                                                       and value.is_floating_point())) \
                    and not _finite_nonnegative(value):
                shown = value.item() if torch.is_tensor(value) else value
                raise ValueError(f"{name}.load_state_dict: {key} of group {gi} must be a finite "
                                 f"number >= 0, got {shown!r}")

    def state_dict(self):
        """torch's state dict plus ``apex_crc32``: a CRC-32 of the state's keys and tensors'
        bytes (and the groups' parameter ids and step), which load_state_dict checks: torch's
        file format checks no tensor payload, so a damaged file would load as other numbers.
        torch's optimizers ignore the extra key; drop it to load a state edited on purpose."""
        sd = super().state_dict()
        sd[_CRC_KEY] = _state_crc32(sd)
        return sd

    def load_state_dict(self, state_dict):
        """torch's loader casts every floating state tensor to its parameter's dtype, but the
        kernels keep optimizer state and masters in fp32 (a bf16 moment would be written as fp32
        past its end): state saved for half parameters is put back in fp32. Everything is checked
        before anything changes: the checksum state_dict wrote (when there is one), the kind,
        keys, shapes, dtypes and hyperparameters."""
        name = type(self).__name__
        if isinstance(state_dict, dict) and _CRC_KEY in state_dict:
            stored = state_dict[_CRC_KEY]
            state_dict = {k: v for k, v in state_dict.items() if k != _CRC_KEY}
            try:
                actual = _state_crc32(state_dict)
            except Exception as e:  # a damaged layout the checksum cannot even walk
                raise ValueError(f"{name}.load_state_dict: the state is damaged ({e})") from None
            if stored != actual:
                raise ValueError(f"{name}.load_state_dict: the state does not match its checksum "
                                 f"({_CRC_KEY} {stored!r}, its contents {actual:#010x}): the file "
                                 "is damaged, or its tensors were edited after state_dict() (to "
                                 f"load an edited state deliberately, remove {_CRC_KEY!r})")
        state_dict = self._convert_state_dict(state_dict)
        self._check_state_dict(state_dict)
        saved = state_dict["state"]
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        keep = {}
        for pid, p in zip(ids, chain.from_iterable(g["params"] for g in self.param_groups)):
            if p.dtype == torch.float32:
                continue
            for key, value in saved.get(pid, {}).items():
                if torch.is_tensor(value) and value.is_floating_point():
                    keep[(p, key)] = value.to(device=p.device, dtype=torch.float32).clone()
        super().load_state_dict(state_dict)
        for (p, key), value in keep.items():
            self.state[p][key] = value

    def _convert_state_dict(self, state_dict):
        """Hook for layouts another optimizer writes (FusedAdam reads torch's Adam/AdamW)."""
        return state_dict

    @staticmethod
    def _check_legacy(name, **legacy):
        if any(v is not None for v in legacy.values()):
            raise RuntimeError(
                f"{name} has been updated. Simply initialize it identically to torch.optim, and "
                "call step() with no arguments (grads, output_params, scale and grad_norms are "
                "gone).")

    def _scaling(self, grad_scaler, device):
        """(inv_scale, found_inf) one-element fp32 tensors on `device`, or (None, None)."""
        scale = None
        found_inf = None
        if grad_scaler is not None:
            # A GradScaler passed explicitly (apex's step(grad_scaler=...)): its scale, unless
            # unscale_ already ran for this optimizer, and its inf check.
            from torch.amp.grad_scaler import OptState
            state = grad_scaler._per_optimizer_states[id(self)]
            if state["stage"] is not OptState.UNSCALED:
                scale = grad_scaler._get_scale_async()
            found = state["found_inf_per_device"] or grad_scaler._check_inf_per_device(self)
            found_inf = sum(t.to(device) for t in found.values()) if found else None
        elif getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            scale = getattr(self, "grad_scale", None)
            found_inf = getattr(self, "found_inf", None)
        inv = None
        if scale is not None:
            inv = (1.0 / scale.to(device=device, dtype=torch.float64)).to(torch.float32).reshape(1)
        if found_inf is not None:
            found_inf = found_inf.to(device=device, dtype=torch.float32).reshape(1)
        return inv, found_inf

    @staticmethod
    def _on(scaling, device):
        """(inv_scale, found_inf) moved to `device` (no copy where they already are)."""
        return tuple(t.to(device) if t is not None else None for t in scaling)

    @staticmethod
    def _skip(found_inf, params=(), inv=None):
        """Whether an overflow skips this step (one host read, only with a loss scaler). On a
        skipped step under GradScaler (`inv` given) the gradients of `params` are unscaled all
        the same: torch's contract is unscaled gradients after ``scaler.step``, stepped or not."""
        if found_inf is None or not bool(found_inf.item() != 0):
            return False
        if inv is not None:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(inv.to(p.grad.device))
        return True

    def _noop(self, device):
        if self._dummy_overflow_buf.device != device:
            self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int, device=device)
        return self._dummy_overflow_buf

    @staticmethod
    def _buckets(group, name):
        """The group's parameters that have gradients, by (device, param dtype, grad dtype): one
        kernel call each."""
        buckets = defaultdict(list)
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{name} does not support sparse gradients, please consider "
                                   "SparseAdam instead")
            if p.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise RuntimeError(f"{name}: expected float32, float16 or bfloat16 parameters, "
                                   f"got {p.dtype}")
            buckets[(p.device, p.dtype, p.grad.dtype)].append(p)
        return list(buckets.values())

    def _state_zeros(self, p, key):
        state = self.state[p]
        if key not in state:
            state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
        return state[key]

    def _master(self, p):
        """The fp32 master of a half parameter (created from it on first use)."""
        state = self.state[p]
        if "master_param" not in state:
            state["master_param"] = p.detach().clone().to(torch.float32)
        return state["master_param"]


def _dense(t):
    """Whether `t` covers exactly numel() consecutive elements of its storage (any dimension
    order), as the kernels read it."""
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1)
    expected = 1
    for st, n in dims:
        if st != expected:
            return False
        expected *= n
    return True


def grads_of(params):
    return [p.grad for p in params]
