"""apex.contrib.optimizers: ZeRO-2 sharded optimizers on apex-cpp's C++ machinery."""
from .distributed_fused_adam import DistributedFusedAdam
from .distributed_fused_lamb import DistributedFusedLAMB

__all__ = ["DistributedFusedAdam", "DistributedFusedLAMB"]
