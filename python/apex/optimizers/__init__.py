"""apex's fused optimizers on apex-cpp's multi-tensor kernels (CPU and CUDA)."""
from .fused_adagrad import FusedAdagrad
from .fused_adam import FusedAdam
from .fused_lamb import FusedLAMB
from .fused_mixed_precision_lamb import FusedMixedPrecisionLamb
from .fused_novograd import FusedNovoGrad
from .fused_sgd import FusedSGD

__all__ = ["FusedAdam", "FusedSGD", "FusedLAMB", "FusedNovoGrad", "FusedAdagrad",
           "FusedMixedPrecisionLamb"]
