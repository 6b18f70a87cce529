"""The machinery of apex.contrib.optimizers' DistributedFusedAdam and DistributedFusedLAMB:
apex-cpp's C++ sharded optimizers (ZeRO-2 on c10d) behind torch.optim.Optimizer, with apex's
GradScaler contract (``step(grad_scaler=...)``, ``unscale_grads``)."""
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState

from apex._ops import STABLE, _REINSTALL

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _dtype_name(who, name, dtype):
    if dtype is None:
        return ""
    if dtype not in _DTYPES:
        raise RuntimeError(f"{who}: {name} must be torch.float32, torch.float16 or "
                           f"torch.bfloat16, got {dtype}")
    return _DTYPES[dtype]


class ShardedOptimizer(torch.optim.Optimizer):
    """Base of the sharded optimizers: param_groups live here (for schedulers and apex's code);
    the state, the gradients and the collectives live in the C++ optimizer."""

    _step_supports_amp_scaling = True
    _KIND = None
    _HYPER = ()

    def __init__(self, who, params, defaults, *, dtype, grad_sync_dtype, param_sync_dtype,
                 device, process_group, distributed_process_group, redundant_process_group,
                 average_grad_sync, overlap_grad_sync, bucket_cap_mb, pipeline_size,
                 contiguous_grad_buffer, reduce_scatter, timeout, unsupported,
                 store_params=True, store_param_remainders=False, message_cap_mb=0.0):
        if STABLE:
            raise RuntimeError(f"{who} is in the regular op library, not in the stable-ABI one "
                               f"that serves torch {torch.__version__}; {_REINSTALL}")
        for name, value, ok in unsupported:
            if value != ok:
                raise RuntimeError(f"{who}: {name}={value!r} is not supported by apex-cpp "
                                   f"(expected {ok!r}); see docs/distributed.md")
        if store_params and store_param_remainders:
            raise RuntimeError(f"{who}: store_params=True and store_param_remainders=True: the "
                               "remainders replace the stored parameters (pass "
                               "store_params=False with store_param_remainders=True, as apex)")
        if redundant_process_group is not None:
            raise RuntimeError(f"{who}: redundant_process_group is not supported by apex-cpp "
                               "(the state is sharded over one group)")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{who}: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group first")
        if dtype != torch.float32:
            raise RuntimeError(f"{who}: dtype (of the sharded state) must be torch.float32, got "
                               f"{dtype}")
        if bucket_cap_mb <= 0 or pipeline_size < 1:
            raise RuntimeError(f"{who}: bucket_cap_mb must be > 0 and pipeline_size >= 1, got "
                               f"{bucket_cap_mb} and {pipeline_size}")
        super().__init__(params, defaults)
        group = distributed_process_group or process_group or dist.group.WORLD
        first = self.param_groups[0]["params"][0]
        if device is not None and torch.device(device).type != first.device.type:
            raise RuntimeError(f"{who}: device={device!r} but the parameters are on "
                               f"{first.device}")
        numbers = dict(bucket_cap_mb=float(bucket_cap_mb), pipeline_size=float(pipeline_size),
                       overlap_grad_sync=float(bool(overlap_grad_sync)),
                       average_grad_sync=float(bool(average_grad_sync)),
                       contiguous_grad_buffer=float(bool(contiguous_grad_buffer)),
                       store_params=float(bool(store_params)),
                       store_param_remainders=float(bool(store_param_remainders)),
                       message_cap_mb=float(message_cap_mb))
        names = dict(dtype="float32",
                     grad_sync_dtype=_dtype_name(who, "grad_sync_dtype", grad_sync_dtype),
                     param_sync_dtype=_dtype_name(who, "param_sync_dtype", param_sync_dtype),
                     reduce_scatter=reduce_scatter)
        if timeout is None:
            timeout = timedelta(minutes=30)
        self._who = who
        self._found_inf = None
        self._impl = torch.classes.apex_cpp.ShardedOptimizer(
            self._KIND, [list(g["params"]) for g in self.param_groups], self._hyperparameters(),
            numbers, names, group.boxed(), timeout.total_seconds())

    # -- hyperparameters ------------------------------------------------------------------------

    def _hyperparameters(self):
        out = []
        for g in self.param_groups:
            h = {}
            for k in self._HYPER:
                if k == "betas":
                    h["beta1"], h["beta2"] = (float(b) for b in g["betas"])
                else:
                    h[k] = float(g[k])
            out.append(h)
        return out

    # -- the training loop ----------------------------------------------------------------------

    def zero_grad(self, set_to_none=True):
        """Drops the gradients accumulated so far (they live in the optimizer's buckets)."""
        self._impl.zero_grad()
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None

    def no_sync(self):
        """Context: backward passes inside accumulate without synchronizing (micro-batches)."""
        impl = self._impl

        class _NoSync:
            def __enter__(self):
                impl.set_no_sync(True)

            def __exit__(self, *exc):
                impl.set_no_sync(False)
                return False

        return _NoSync()

    def _inv_scale(self, grad_scaler):
        scale = grad_scaler._scale
        if scale is None:
            raise RuntimeError(f"{self._who}: the GradScaler has no scale yet (call "
                               "scaler.scale(loss) first)")
        return scale.double().reciprocal().float().reshape(1)

    def unscale_grads(self, inv_scale=None, grad_scaler=None):
        """apex's unscale_grads: multiplies the synchronized gradients by inv_scale (or the
        GradScaler's 1/scale, marking it unscaled for this optimizer) and returns the found-inf
        flag agreed by every rank. Call it instead of scaler.unscale_(optimizer), whose loop over
        p.grad cannot reach the buckets."""
        if grad_scaler is not None:
            inv_scale = self._inv_scale(grad_scaler)
        if inv_scale is None:
            raise RuntimeError(f"{self._who}.unscale_grads: give inv_scale or grad_scaler")
        self._impl.set_hyperparameters(self._hyperparameters())
        found = self._impl.unscale_grads(inv_scale.float().reshape(1))
        if grad_scaler is not None:
            state = grad_scaler._per_optimizer_states[id(self)]
            state["stage"] = OptState.UNSCALED
            state["found_inf_per_device"] = {found.device: found}
            self._found_inf = found
        return found

    @torch.no_grad()
    def step(self, closure=None, *, grad_scaler=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._impl.set_hyperparameters(self._hyperparameters())
        if grad_scaler is None:
            self._impl.step(None)
            return loss
        state = grad_scaler._per_optimizer_states[id(self)]
        if state["stage"] is OptState.UNSCALED:
            if self._found_inf is None:
                raise RuntimeError(
                    f"{self._who}: scaler.unscale_(optimizer) cannot reach this optimizer's "
                    "gradients (they live in its buckets, not in p.grad); call "
                    "optimizer.unscale_grads(grad_scaler=scaler) instead")
            found = self._found_inf
            if found.item() == 0:
                self._impl.step(None)
        else:
            found = self._impl.step(self._inv_scale(grad_scaler))
        state["found_inf_per_device"] = {found.device: found}
        self._found_inf = None
        return loss

    def clip_grad_norm(self, max_norm, norm_type=2.0):
        """Clips the gradients' global L2 norm to max_norm; returns the norm before clipping."""
        if norm_type != 2.0:
            raise RuntimeError(f"{self._who}.clip_grad_norm: only norm_type=2.0 is supported, "
                               f"got {norm_type}")
        self._impl.set_hyperparameters(self._hyperparameters())
        return torch.tensor(self._impl.clip_grad_norm(float(max_norm)))

    def grad_norm(self):
        """The gradients' global L2 norm (one scalar all-reduce)."""
        return torch.tensor(self._impl.grad_norm())

    # -- layout -------------------------------------------------------------------------------

    def _per_call_dtypes(self, what, dtypes):
        for name, value in dtypes.items():
            if value is not None:
                raise RuntimeError(f"{self._who}.{what}: {name}={value!r} per call is not "
                                   "supported by apex-cpp (give it to the constructor)")

    def init_params(self, params=None, grad_sync_dtype=None, param_sync_dtype=None):
        """apex's init_params: the state of every parameter exists from the constructor on, so
        this only checks that ``params`` (a tensor, an iterable, or None: all) are this
        optimizer's."""
        self._per_call_dtypes("init_params", dict(grad_sync_dtype=grad_sync_dtype,
                                                  param_sync_dtype=param_sync_dtype))
        if params is None:
            return
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        mine = {id(p) for g in self.param_groups for p in g["params"]}
        for k, p in enumerate(params):
            if id(p) not in mine:
                raise RuntimeError(f"{self._who}.init_params: tensor {k} "
                                   f"({tuple(p.shape)}) is not one of this optimizer's "
                                   "parameters")

    def init_params_bucket(self, params, grad_sync_dtype=None, param_sync_dtype=None):
        """apex's init_params_bucket: ``params`` get buckets of their own (their gradients
        travel together, apart from the others'), ahead of the rest of the layout; parameters
        already in such a group are ignored. The state moves with the layout. Every rank must
        call it with the same parameters, with no gradients pending."""
        self._per_call_dtypes("init_params_bucket", dict(grad_sync_dtype=grad_sync_dtype,
                                                         param_sync_dtype=param_sync_dtype))
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        self._impl.init_params_bucket(params)

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self, gather_on_root=None):
        """apex's format 2: per parameter its fp32 param, exp_avg and exp_avg_sq, gathered on
        every rank, and each group's step. Every rank must call it."""
        self._impl.set_hyperparameters(self._hyperparameters())
        return self._impl.state_dict()

    def load_state_dict(self, state_dict):
        """Loads format 2 (from any world size; also torch.optim.AdamW's layout); a refused
        state changes nothing. Every rank must call it."""
        who = f"{self._who}.load_state_dict"
        if not isinstance(state_dict, dict) or "state" not in state_dict \
                or "param_groups" not in state_dict:
            raise RuntimeError(f"{who}: expected a dict with keys 'state' and 'param_groups' "
                               "(apex's format 2)")
        if state_dict.get("format", 2) != 2:
            raise RuntimeError(f"{who}: format {state_dict.get('format')!r} is not supported "
                               "(expected apex's format 2)")
        groups = state_dict["param_groups"]
        per_param, numbers, indices = {}, [], []
        for g in groups:
            steps = {int(s["step"]) for i in g["params"]
                     for s in [state_dict["state"].get(i, {})] if "step" in s}
            n = {"lr": float(g["lr"])}
            if "step" in g:
                n["step"] = float(g["step"])
            elif len(steps) == 1:  # torch's layout: a step per parameter
                n["step"] = float(steps.pop())
            numbers.append(n)
            indices.append([int(i) for i in g["params"]])
        for k, v in state_dict["state"].items():
            per_param[int(k)] = {name: t for name, t in v.items() if isinstance(t, torch.Tensor)
                                 and name != "step"}
        self._impl.load_state_dict(per_param, numbers, indices)
        for g, saved in zip(self.param_groups, groups):
            for k in self._HYPER:
                if k in saved:
                    g[k] = tuple(saved[k]) if k == "betas" else saved[k]

    def save_sharded(self, path):
        """Each rank writes its shard under path (checksummed, with a manifest)."""
        self._impl.save_sharded(str(path))

    def load_sharded(self, path):
        """Loads shards saved at any world size."""
        self._impl.load_sharded(str(path))

    def memory(self):
        """What this rank holds for the optimizer (elements and bytes)."""
        return dict(self._impl.memory())

    def step_count(self, group=0):
        return self._impl.step_count(group)
