#pragma once

/// apex::parallel: process groups, DistributedDataParallel and SyncBatchNorm on LibTorch's c10d.
#include <apex/parallel/distributed.h>
#include <apex/parallel/distributed_fused_adam.h>
#include <apex/parallel/distributed_fused_lamb.h>
#include <apex/parallel/distributed_sampler.h>
#include <apex/parallel/process_group.h>
#include <apex/parallel/sync_batch_norm.h>
