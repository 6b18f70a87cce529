#pragma once

/// apex::normalization: fused LayerNorm and RMSNorm.
#include <apex/normalization/functional.h>
#include <apex/normalization/fused_layer_norm.h>
