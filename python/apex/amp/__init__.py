"""apex.amp on torch.autocast and apex-cpp's kernels: ``initialize``, ``scale_loss``,
``state_dict`` / ``load_state_dict``, ``master_params``, opt levels O0-O3, on CPU and CUDA; and
``cpu_half_fallback``, half matmuls through fp32 on CPUs without fast ones."""
from ._amp_state import _amp_state
from .cpu_half import (cpu_half_fallback, cpu_half_fallback_active, cpu_half_fallback_available,
                       prepare_cpu_half_fallback)
from .frontend import initialize, load_state_dict, master_params, state_dict
from .handle import scale_loss
from .scaler import LossScaler

__all__ = ["initialize", "scale_loss", "state_dict", "load_state_dict", "master_params",
           "LossScaler", "_amp_state", "cpu_half_fallback", "cpu_half_fallback_available",
           "cpu_half_fallback_active", "prepare_cpu_half_fallback"]
