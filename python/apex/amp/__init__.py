"""apex.amp on torch.autocast and apex-cpp's kernels: ``initialize``, ``scale_loss``,
``state_dict`` / ``load_state_dict``, ``master_params``, opt levels O0-O3, on CPU and CUDA."""
from ._amp_state import _amp_state
from .frontend import initialize, load_state_dict, master_params, state_dict
from .handle import scale_loss
from .scaler import LossScaler

__all__ = ["initialize", "scale_loss", "state_dict", "load_state_dict", "master_params",
           "LossScaler", "_amp_state"]
