"""apex.normalization on apex-cpp's fused LayerNorm/RMSNorm kernels."""
from .fused_layer_norm import (FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm,
                               MixedFusedRMSNorm)

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm"]
