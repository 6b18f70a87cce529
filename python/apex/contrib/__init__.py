"""apex.contrib: the parts of apex's contrib that apex-cpp provides (optimizers: the ZeRO-2
DistributedFusedAdam and DistributedFusedLAMB)."""
