#pragma once

/// apex::optim: fused multi-tensor optimizers and primitives.
#include <apex/optim/fused_adagrad.h>
#include <apex/optim/fused_adam.h>
#include <apex/optim/fused_lamb.h>
#include <apex/optim/fused_novograd.h>
#include <apex/optim/fused_optimizer.h>
#include <apex/optim/fused_sgd.h>
#include <apex/optim/larc.h>
#include <apex/optim/multi_tensor.h>
