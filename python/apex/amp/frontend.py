"""apex.amp's front end: ``initialize`` with the opt levels O0-O3 and apex's overrides, built on
``torch.autocast`` (O1), model casting (O2/O3), fp32 master weights (O2) and apex-cpp's
multi-tensor kernels for the unscale and the master copies."""
import functools
import warnings

import torch

from apex._ops import ops

from ._amp_state import _amp_state, maybe_print
from .cpu_half import cpu_half_fallback, prepare_cpu_half_fallback
from .scaler import LossScaler


class Properties:
    """The resolved options of an opt level (apex's names)."""

    def __init__(self):
        self.enabled = False
        self.opt_level = None
        self.cast_model_type = None
        self.patch_torch_functions = False
        self.keep_batchnorm_fp32 = None
        self.master_weights = None
        self.loss_scale = 1.0
        self.cast_model_outputs = None
        self.half_dtype = torch.float16

    def __repr__(self):
        return "\n".join(f"{k:22}: {v}" for k, v in self.__dict__.items())

    def computes_in_half(self):
        """Whether the model computes in half: autocast (O1) or a half model (O2, O3)."""
        return self.patch_torch_functions or self.cast_model_type not in (None, torch.float32)


# apex's opt-level table: what each level sets before any override.
_LEVELS = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
               master_weights=None, loss_scale="dynamic"),
    "O2": dict(cast_model_type="half", patch_torch_functions=False, keep_batchnorm_fp32=True,
               master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type="half", patch_torch_functions=False, keep_batchnorm_fp32=False,
               master_weights=False, loss_scale=1.0),
}


def _resolve(opt_level, enabled, half_dtype, overrides):
    if opt_level not in _LEVELS:
        raise RuntimeError(f"Unexpected optimization level {opt_level!r}. Options are 'O0', 'O1', "
                           "'O2', 'O3'. Note that in `O0`, `O1`, etc., the prefix O is the letter "
                           "O, not the number zero.")
    p = Properties()
    p.enabled = enabled
    p.opt_level = opt_level
    p.half_dtype = half_dtype
    for k, v in _LEVELS[opt_level].items():
        setattr(p, k, half_dtype if v == "half" else v)
    # bf16 has fp32's exponent range: no dynamic scaling by default (apex-cpp's rule).
    if half_dtype == torch.bfloat16 and p.loss_scale == "dynamic":
        p.loss_scale = 1.0
    for k, v in overrides.items():
        if v is None:
            continue
        if k == "cast_model_type" and v is False:
            # apex: False means "do not cast the model" (real code passes it so).
            p.cast_model_type = None
            continue
        if k == "cast_model_type":
            if v not in (torch.float32, torch.float16, torch.bfloat16):
                raise RuntimeError(f"amp: cast_model_type must be torch.float32, torch.float16 or "
                                   f"torch.bfloat16, got {v}")
            if opt_level == "O1" and v != torch.float32:
                raise RuntimeError("O1 inserts casts around Torch functions rather than model "
                                   "weights, so with O1, the model weights themselves should remain "
                                   f"FP32. If you wish to cast the model to a different type, use "
                                   f"opt_level='O2' or 'O3'. cast_model_type was {v}")
        elif k == "patch_torch_functions":
            if v and opt_level != "O1":
                raise RuntimeError(f"amp: patch_torch_functions=True is only valid with O1, got "
                                   f"opt_level {opt_level}")
        elif k == "keep_batchnorm_fp32":
            if isinstance(v, str):
                if v not in ("True", "False"):
                    raise RuntimeError(f"amp: keep_batchnorm_fp32 must be a bool, 'True' or "
                                       f"'False', got {v!r}")
                v = v == "True"
            if opt_level == "O1":
                raise RuntimeError("With opt_level O1, batchnorm functions are automatically "
                                   "patched to run in FP32, so keep_batchnorm_fp32 should be None. "
                                   f"keep_batchnorm_fp32 was {v}")
        elif k == "master_weights":
            if opt_level == "O1":
                raise RuntimeError("It doesn't make sense to use master_weights with O1. With O1, "
                                   "your model weights themselves should be FP32.")
        elif k == "loss_scale":
            if v != "dynamic":
                v = float(v)
                if not v > 0 or v == float("inf"):
                    raise RuntimeError(f"amp: loss_scale must be 'dynamic' or a finite number > "
                                       f"0, got {v}")
        setattr(p, k, v)
    if not enabled:
        p.cast_model_type = None
        p.patch_torch_functions = False
        p.master_weights = False
        p.loss_scale = 1.0
    return p


def _fp32_state_dict_hook(module, state_dict, prefix, local_metadata):
    for key, value in state_dict.items():
        if torch.is_tensor(value) and value.dtype in (torch.float16, torch.bfloat16):
            state_dict[key] = value.float()


# apex's O1 patched these torch.nn.functional functions to run in fp32 wherever they are called,
# the model's outputs being half: so a loss computed outside the model is fp32 (code reads and
# reduces it as such). torch.autocast runs them in fp32 only inside its region (the model's
# forward here), so O1 patches the same functions: half floating inputs are widened first.
_FP32_FUNCTIONS = ("softmax", "log_softmax", "cross_entropy", "nll_loss", "kl_div", "l1_loss",
                   "mse_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
                   "binary_cross_entropy_with_logits", "poisson_nll_loss", "cosine_embedding_loss",
                   "hinge_embedding_loss", "margin_ranking_loss", "multilabel_margin_loss",
                   "multilabel_soft_margin_loss", "multi_margin_loss", "soft_margin_loss",
                   "triplet_margin_loss", "gaussian_nll_loss")


def _widen(value):
    if torch.is_tensor(value) and value.dtype in (torch.float16, torch.bfloat16):
        return value.float()
    return value


def _patch_fp32_functions():
    F = torch.nn.functional
    for name in _FP32_FUNCTIONS:
        fn = getattr(F, name, None)
        if fn is None or getattr(fn, "_apex_fp32", False):
            continue

        def wrapped(*args, _fn=fn, **kwargs):
            if _amp_state.opt_properties is None or not _amp_state.opt_properties.enabled or \
                    not _amp_state.opt_properties.patch_torch_functions or \
                    torch.is_autocast_enabled(_amp_state.device_type):
                return _fn(*args, **kwargs)
            return _fn(*[_widen(a) for a in args], **{k: _widen(v) for k, v in kwargs.items()})

        wrapped = functools.wraps(fn)(wrapped)
        wrapped._apex_fp32 = True
        setattr(F, name, wrapped)


def _is_batchnorm(module):
    return isinstance(module, torch.nn.modules.batchnorm._BatchNorm)


def _cast_model(model, dtype, keep_batchnorm_fp32):
    """apex's convert_network: float parameters and buffers to `dtype`, except affine batchnorm
    layers when keep_batchnorm_fp32."""
    for module in model.modules():
        if keep_batchnorm_fp32 and _is_batchnorm(module) and module.affine:
            continue
        for name, param in module.named_parameters(recurse=False):
            if param is not None and param.is_floating_point():
                param.data = param.data.to(dtype)
                if param.grad is not None:
                    param.grad.data = param.grad.data.to(dtype)
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point():
                setattr(module, name, buf.to(dtype))
    return model


def _apply(value, fn):
    if torch.is_tensor(value):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_apply(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _apply(v, fn) for k, v in value.items()}
    return value


def _float_caster(dtype):
    def cast(t):
        return t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t
    return cast


def _patch_forward(model, props, device_type):
    old_forward = model.forward
    out_dtype = props.cast_model_outputs
    # The model computes in half: on a CPU without fast half matmuls, through fp32 (cpu_half.py).
    on_cpu = device_type == "cpu"
    if props.patch_torch_functions:
        @functools.wraps(old_forward)
        def forward(*args, **kwargs):
            with torch.autocast(device_type=device_type, dtype=props.half_dtype), \
                    cpu_half_fallback(on_cpu):
                out = old_forward(*args, **kwargs)
            return _apply(out, _float_caster(out_dtype)) if out_dtype is not None else out
    else:
        in_cast = _float_caster(props.cast_model_type)
        out_cast = _float_caster(out_dtype if out_dtype is not None else torch.float32)

        @functools.wraps(old_forward)
        def forward(*args, **kwargs):
            with cpu_half_fallback(on_cpu):
                out = old_forward(*_apply(args, in_cast), **_apply(kwargs, in_cast))
            return _apply(out, out_cast)
    model.forward = forward


class _AmpStash:
    pass


def _setup_masters(optimizer):
    """O2: the optimizer steps fp32 masters of the model's half parameters, and its existing
    state follows them. Their values are taken from the model again at the first ``scale_loss``
    or ``step`` (``_amp_lazy_init``, as apex did), so weights loaded after ``amp.initialize`` are
    the ones trained."""
    stash = optimizer._amp_stash
    stash.fp16_groups = []
    stash.fp32_from_fp16_groups = []
    stash.fp32_from_fp32_groups = []
    stash.all_fp16_params = []
    stash.all_fp32_from_fp16_params = []
    stash.all_fp32_from_fp32_params = []
    for group in optimizer.param_groups:
        _split_group(optimizer, group)


def _split_group(optimizer, group):
    """One group's half parameters replaced by fp32 masters (O2), recorded in the stash."""
    stash = optimizer._amp_stash
    fp16, fp32_from_fp16, fp32 = [], [], []
    new_params = []
    for p in group["params"]:
        if p.dtype in (torch.float16, torch.bfloat16):
            master = p.detach().clone().float()
            master.requires_grad_(True)
            fp16.append(p)
            fp32_from_fp16.append(master)
            new_params.append(master)
            if p in optimizer.state:
                optimizer.state[master] = optimizer.state.pop(p)
        else:
            fp32.append(p)
            new_params.append(p)
    group["params"] = new_params
    stash.fp16_groups.append(fp16)
    stash.fp32_from_fp16_groups.append(fp32_from_fp16)
    stash.fp32_from_fp32_groups.append(fp32)
    stash.all_fp16_params.extend(fp16)
    stash.all_fp32_from_fp16_params.extend(fp32_from_fp16)
    stash.all_fp32_from_fp32_params.extend(fp32)


def _lazy_init(optimizer):
    """O2, once, before the first backward or step: the masters take the model's current half
    weights (what was loaded into the model after amp.initialize)."""
    stash = optimizer._amp_stash
    if stash.lazy_init_called:
        return
    stash.lazy_init_called = True
    with torch.no_grad():
        for m, p in zip(stash.all_fp32_from_fp16_params, stash.all_fp16_params):
            m.copy_(p.detach().float())


def _copy_masters_to_model(stash):
    pairs = [(m, p) for m, p in zip(stash.all_fp32_from_fp16_params, stash.all_fp16_params)]
    if not pairs:
        return
    by_key = {}
    for m, p in pairs:
        by_key.setdefault((p.device, p.dtype), []).append((m, p))
    for (device, _), items in by_key.items():
        flag = torch.zeros(1, dtype=torch.int, device=device)
        ops.multi_tensor_scale(flag, [m.detach() for m, _ in items], [p.data for _, p in items],
                               1.0)


def _patch_optimizer(optimizer, props):
    optimizer._amp_stash = _AmpStash()
    stash = optimizer._amp_stash
    stash.params_have_scaled_gradients = False
    stash.already_patched = False
    stash.master_weights = bool(props.master_weights)
    stash.lazy_init_called = not stash.master_weights
    if stash.master_weights:
        _setup_masters(optimizer)
    optimizer._amp_lazy_init = functools.partial(_lazy_init, optimizer)
    old_step = optimizer.step
    old_zero_grad = optimizer.zero_grad
    old_add_param_group = optimizer.add_param_group

    def drop_master_grads():
        # apex's step clears them: code that zeroes the model's gradients (model.zero_grad())
        # never reaches the masters, whose gradients would otherwise be stashed and added again.
        for m in stash.all_fp32_from_fp16_params:
            m.grad = None

    @functools.wraps(old_step)
    def step(*args, **kwargs):
        _lazy_init(optimizer)
        if stash.skip_next_step:
            stash.skip_next_step = False
            if stash.master_weights:
                drop_master_grads()
            return None
        out = old_step(*args, **kwargs)
        if stash.master_weights:
            _copy_masters_to_model(stash)
            drop_master_grads()
        return out

    @functools.wraps(old_add_param_group)
    def add_param_group(param_group):
        old_add_param_group(param_group)
        if stash.master_weights:  # O2: the new group's half parameters get masters too
            _split_group(optimizer, optimizer.param_groups[-1])

    @functools.wraps(old_zero_grad)
    def zero_grad(*args, **kwargs):
        out = old_zero_grad(*args, **kwargs)
        if stash.master_weights:
            for p in stash.all_fp16_params:
                p.grad = None
        return out

    stash.skip_next_step = False
    optimizer.step = step
    optimizer.zero_grad = zero_grad
    optimizer.add_param_group = add_param_group


def initialize(models, optimizers=None, enabled=True, opt_level="O1", cast_model_type=None,
               patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None,
               loss_scale=None, cast_model_outputs=None, num_losses=1, verbosity=1,
               min_loss_scale=None, max_loss_scale=2.0 ** 24, half_dtype=None):
    """apex.amp.initialize: returns ``models`` and ``optimizers`` in the structure they were given
    (a model or a list; an optimizer or a list; only the models when ``optimizers`` is None).

    ``half_dtype`` (apex-cpp's addition) is the half type of O1's autocast and O2/O3's model:
    float16 on CUDA and bfloat16 on the CPU by default (bf16 then needs no loss scaling).
    """
    models_list = list(models) if isinstance(models, (list, tuple)) else [models]
    if optimizers is None:
        optimizers_list = []
    elif isinstance(optimizers, (list, tuple)):
        optimizers_list = list(optimizers)
    else:
        optimizers_list = [optimizers]
    for m in models_list:
        if not isinstance(m, torch.nn.Module):
            raise RuntimeError(f"amp.initialize: models must be torch.nn.Modules, got {type(m)}")
    for o in optimizers_list:
        if not isinstance(o, torch.optim.Optimizer):
            raise RuntimeError(f"amp.initialize: optimizers must be torch.optim.Optimizers, got "
                               f"{type(o)}")
        if hasattr(o, "_amp_stash"):
            raise RuntimeError("amp.initialize: an optimizer was passed that amp.initialize has "
                               "already processed")
    params = [p for m in models_list for p in m.parameters()]
    device = params[0].device if params else torch.device("cpu")
    device_type = device.type
    if half_dtype is None:
        half_dtype = torch.float16 if device_type == "cuda" else torch.bfloat16
    if half_dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"amp.initialize: half_dtype must be torch.float16 or torch.bfloat16, "
                           f"got {half_dtype}")
    for p in params:
        # apex's escape hatch for a model that is already half (real code sets it).
        if enabled and p.dtype != torch.float32 and not _amp_state.allow_incoming_model_not_fp32:
            raise RuntimeError(f"amp.initialize: incoming model parameters must be float32, found "
                               f"{p.dtype} (amp casts the model itself)")
    if not isinstance(num_losses, int) or num_losses < 1:
        raise RuntimeError(f"amp.initialize: num_losses must be an int >= 1, got {num_losses}")
    # Every argument checked before anything changes (the model cast, the optimizer patched).
    for name, v in (("min_loss_scale", min_loss_scale), ("max_loss_scale", max_loss_scale)):
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and
                                  0 < v < float("inf")):
            raise RuntimeError(f"amp.initialize: {name} must be a finite number > 0, got {v!r}")
    if max_loss_scale is None:
        raise RuntimeError("amp.initialize: max_loss_scale must be a finite number > 0, got None")
    if min_loss_scale is not None and min_loss_scale > max_loss_scale:
        raise RuntimeError(f"amp.initialize: min_loss_scale ({min_loss_scale}) must be <= "
                           f"max_loss_scale ({max_loss_scale})")
    if cast_model_outputs is not None and cast_model_outputs not in (
            torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise RuntimeError(f"amp.initialize: cast_model_outputs must be a floating dtype "
                           f"(torch.float32, float16, bfloat16 or float64), got "
                           f"{cast_model_outputs!r}")
    props = _resolve(opt_level, enabled, half_dtype, dict(
        cast_model_type=cast_model_type, patch_torch_functions=patch_torch_functions,
        keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
        loss_scale=loss_scale, cast_model_outputs=cast_model_outputs))
    _amp_state.opt_properties = props
    _amp_state.verbosity = verbosity
    _amp_state.device_type = device_type
    maybe_print(f"Selected optimization level {opt_level}", verbosity)
    maybe_print(f"Defaults for this optimization level are:\n{props!r}", verbosity)

    if enabled and props.patch_torch_functions:
        _patch_fp32_functions()
    if enabled:
        for m in models_list:
            if props.cast_model_type is not None and props.cast_model_type != torch.float32:
                _cast_model(m, props.cast_model_type, props.keep_batchnorm_fp32)
                # apex: an O2/O3 model's state_dict() holds fp32 tensors, so that a checkpoint
                # loads into an fp32 model (evaluation, export); load_state_dict casts back.
                m._register_state_dict_hook(_fp32_state_dict_hook)
            if props.computes_in_half():
                _patch_forward(m, props, device_type)
                if device_type == "cpu":
                    prepare_cpu_half_fallback()  # at setup, not on the first forward
        for o in optimizers_list:
            _patch_optimizer(o, props)
    _amp_state.loss_scalers = [
        LossScaler(props.loss_scale if enabled else 1.0, min_loss_scale=min_loss_scale,
                   max_loss_scale=max_loss_scale) for _ in range(num_losses)]
    _amp_state.optimizers = optimizers_list
    _amp_state.models = models_list

    out_models = models_list if isinstance(models, (list, tuple)) else models_list[0]
    if optimizers is None:
        return out_models
    out_opts = optimizers_list if isinstance(optimizers, (list, tuple)) else optimizers_list[0]
    return out_models, out_opts


def state_dict(destination=None):
    """``{"loss_scaler<i>": {"loss_scale", "unskipped"}}`` as apex writes it, plus the fp32
    masters of every O2 optimizer (``master_params``), which apex lost on resume."""
    if destination is None:
        destination = {}
    for i, scaler in enumerate(_amp_state.loss_scalers):
        destination[f"loss_scaler{i}"] = {"loss_scale": scaler.loss_scale(),
                                          "unskipped": scaler._unskipped}
    for o in getattr(_amp_state, "optimizers", []):
        o._amp_lazy_init()  # saved before the first step: the model's weights as they are now
    masters = [[m.detach().clone() for m in o._amp_stash.all_fp32_from_fp16_params]
               for o in getattr(_amp_state, "optimizers", [])
               if getattr(o._amp_stash, "master_weights", False)]
    if masters:
        destination["master_params"] = masters
    return destination


def load_state_dict(state_dict):
    """Loads what ``state_dict`` wrote (or apex's own). Checked first; nothing changes on error."""
    scalers = _amp_state.loss_scalers
    if len(state_dict) != len(scalers) + (1 if "master_params" in state_dict else 0):
        warnings.warn(f"amp.load_state_dict: the state has {len(state_dict)} entries, this amp has "
                      f"{len(scalers)} loss scaler(s)")
    new = []
    for key, value in state_dict.items():
        if key == "master_params":
            continue
        if not key.startswith("loss_scaler") or not key[len("loss_scaler"):].isdigit():
            raise RuntimeError(f"amp.load_state_dict: unexpected key {key!r}")
        idx = int(key[len("loss_scaler"):])
        if idx >= len(scalers):
            raise RuntimeError(f"amp.load_state_dict: {key!r} but amp has {len(scalers)} loss "
                               "scaler(s) (num_losses)")
        scale = float(value["loss_scale"])
        unskipped = int(value["unskipped"])
        s = scalers[idx]
        if not scale > 0 or scale == float("inf"):
            raise RuntimeError(f"amp.load_state_dict: loss_scale must be finite and > 0, got {scale}")
        if s.dynamic and (scale > s._max_loss_scale or
                          (s._min_loss_scale is not None and scale < s._min_loss_scale)):
            raise RuntimeError(f"amp.load_state_dict: loss_scale {scale} is outside [min, max="
                               f"{s._max_loss_scale}] of this dynamic scaler")
        if unskipped < 0:
            raise RuntimeError(f"amp.load_state_dict: unskipped must be >= 0, got {unskipped}")
        new.append((s, scale, unskipped))
    masters = state_dict.get("master_params")
    opts = [o for o in getattr(_amp_state, "optimizers", [])
            if getattr(o._amp_stash, "master_weights", False)]
    if masters is not None:
        if len(masters) != len(opts):
            raise RuntimeError(f"amp.load_state_dict: master_params has {len(masters)} optimizer "
                               f"list(s), amp has {len(opts)} with master weights")
        for i, (o, ms) in enumerate(zip(opts, masters)):
            own = o._amp_stash.all_fp32_from_fp16_params
            if len(ms) != len(own):
                raise RuntimeError(f"amp.load_state_dict: master_params[{i}] has {len(ms)} "
                                   f"tensors, optimizer {i} has {len(own)} master weights")
            for k, (a, b) in enumerate(zip(ms, own)):
                if not torch.is_tensor(a) or not a.is_floating_point() or a.shape != b.shape:
                    what = (f"a {type(a).__name__}" if not torch.is_tensor(a)
                            else f"a {a.dtype} tensor of shape {tuple(a.shape)}")
                    raise RuntimeError(f"amp.load_state_dict: master_params[{i}][{k}] is {what}, "
                                       f"expected a floating tensor of shape {tuple(b.shape)}")
    for s, scale, unskipped in new:
        s._loss_scale = scale
        s._unskipped = unskipped
    if masters is not None:
        with torch.no_grad():
            for o, ms in zip(opts, masters):
                for m, src in zip(o._amp_stash.all_fp32_from_fp16_params, ms):
                    m.copy_(src)
                _copy_masters_to_model(o._amp_stash)
                o._amp_stash.lazy_init_called = True  # the restored masters are the ones


def master_params(optimizer):
    """The parameters ``optimizer`` steps: the fp32 masters under O2, the model's otherwise."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield p
