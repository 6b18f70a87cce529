"""apex for Python on apex-cpp's C++ kernels: the names code written for NVIDIA apex imports
(``apex.optimizers``, ``apex.normalization``, ``apex.amp``, ``apex.parallel``,
``apex.multi_tensor_apply``, the top-level ``amp_C``), on CPU and CUDA tensors.

The distribution is ``apex-cpp``; uninstall NVIDIA apex first (both own the import name ``apex``).
"""
from . import _ops  # noqa: F401  (loads the op library; fails loudly if it is missing)
from . import amp, multi_tensor_apply, normalization, optimizers, parallel  # noqa: F401
from ._ops import cpu_isa

__version__ = "0.1.0"
__all__ = ["amp", "optimizers", "normalization", "parallel", "multi_tensor_apply", "cpu_isa"]
