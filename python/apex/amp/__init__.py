"""apex.amp on torch.autocast and apex-cpp's kernels: ``initialize``, ``scale_loss``,
``state_dict`` / ``load_state_dict``, ``master_params``, opt levels O0-O3, on CPU and CUDA; and
``cpu_half_fallback``, half matmuls through fp32 on CPUs without fast ones."""
from ._amp_state import _amp_state
from .cpu_half import (cpu_half_fallback, cpu_half_fallback_active, cpu_half_fallback_available,
                       prepare_cpu_half_fallback)
from .frontend import initialize, load_state_dict, master_params, state_dict
from .handle import scale_loss
from .scaler import LossScaler


def init(*args, **kwargs):
    """apex's legacy handle API (``amp.init()``, deprecated in apex since 2019) is not provided:
    its O1 cast lists are torch.autocast's here. Raises, naming what to call instead."""
    raise RuntimeError("apex.amp.init() (the legacy handle API) is not provided by this apex; "
                       "use model, optimizer = amp.initialize(model, optimizer, opt_level='O1') "
                       "and `with amp.scale_loss(loss, optimizer) as scaled_loss: "
                       "scaled_loss.backward()`")


__all__ = ["init", "initialize", "scale_loss", "state_dict", "load_state_dict", "master_params",
           "LossScaler", "_amp_state", "cpu_half_fallback", "cpu_half_fallback_available",
           "cpu_half_fallback_active", "prepare_cpu_half_fallback"]
