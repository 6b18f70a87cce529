"""apex.parallel on torch.distributed: DistributedDataParallel with apex's options (over torch's
DDP and its Reducer, as apex-cpp's C++ DDP is), and SyncBatchNorm, which on the CPU runs apex-cpp's
own batch-norm kernels (torch refuses SyncBatchNorm on the CPU) and on CUDA torch's."""
from .distributed import DistributedDataParallel, Reducer
from .LARC import LARC
from .sync_batchnorm import SyncBatchNorm, convert_syncbn_model

__all__ = ["DistributedDataParallel", "Reducer", "SyncBatchNorm", "convert_syncbn_model", "LARC"]
