// The schemas of the multi-tensor ops, shared by the two op libraries (ops.cpp: namespace
// apex_cpp, regular ABI; stable_ops.cpp: apex_cpp_stable, stable ABI) so that they cannot drift.
// X(name, schema). The optimizers' grads are written when unscale_grads (GradScaler's contract:
// gradients unscaled after the step), so the schemas say they may be.
#pragma once

#define APEX_PY_MULTI_TENSOR_OPS(X)                                                                \
  X(multi_tensor_scale,                                                                            \
    "multi_tensor_scale(Tensor(a!) noop_flag, Tensor[] src, Tensor(b!)[] dst, float scale) -> ()") \
  X(multi_tensor_axpby,                                                                            \
    "multi_tensor_axpby(Tensor(a!) noop_flag, Tensor[] x, Tensor[] y, Tensor(b!)[] out, float a, " \
    "float b, int arg_to_check) -> ()")                                                            \
  X(multi_tensor_l2norm,                                                                           \
    "multi_tensor_l2norm(Tensor(a!) noop_flag, Tensor[] tensors, bool per_tensor) -> (Tensor, "    \
    "Tensor)")                                                                                     \
  X(multi_tensor_unscale_l2norm,                                                                   \
    "multi_tensor_unscale_l2norm(Tensor(a!) noop_flag, Tensor[] tensors, Tensor inv_scale, bool "  \
    "per_tensor) -> (Tensor, Tensor)")                                                             \
  X(multi_tensor_adam,                                                                             \
    "multi_tensor_adam(Tensor(a!) noop_flag, Tensor(g!)[] grads, Tensor(b!)[] params, "            \
    "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] master_params, float lr, "      \
    "float beta1, float beta2, float eps, int step, bool adam_w_mode, bool bias_correction, "      \
    "float weight_decay, Tensor? inv_scale=None, Tensor? found_inf=None, Tensor? "                 \
    "lr_tensor=None, Tensor? step_tensor=None, bool unscale_grads=False) -> ()")                   \
  X(multi_tensor_sgd,                                                                              \
    "multi_tensor_sgd(Tensor(a!) noop_flag, Tensor(g!)[] grads, Tensor(b!)[] params, "             \
    "Tensor(c!)[] momentum_buffers, Tensor(d!)[] master_params, float lr, float momentum, float "  \
    "dampening, float weight_decay, bool nesterov, bool first_run, bool wd_after_momentum, "       \
    "float scale, bool unscale_grads=False) -> ()")                                                \
  X(multi_tensor_adagrad,                                                                          \
    "multi_tensor_adagrad(Tensor(a!) noop_flag, Tensor(g!)[] grads, Tensor(b!)[] params, "         \
    "Tensor(c!)[] state_sums, Tensor(d!)[] master_params, float lr, float eps, bool "              \
    "adagrad_w_mode, float weight_decay, Tensor? inv_scale=None, Tensor? found_inf=None, bool "    \
    "unscale_grads=False) -> ()")                                                                  \
  X(multi_tensor_lamb,                                                                             \
    "multi_tensor_lamb(Tensor(a!) noop_flag, Tensor(g!)[] grads, Tensor(b!)[] params, "            \
    "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] master_params, float lr, "      \
    "float beta1, float beta2, float eps, int step, bool bias_correction, float weight_decay, "    \
    "bool grad_averaging, bool adam_w_mode, Tensor global_grad_norm, float max_grad_norm, bool "   \
    "use_nvlamb, Tensor? inv_scale=None, Tensor? found_inf=None, bool unscale_grads=False) -> "    \
    "()")                                                                                          \
  X(multi_tensor_novograd,                                                                         \
    "multi_tensor_novograd(Tensor(a!) noop_flag, Tensor(g!)[] grads, Tensor(b!)[] params, "        \
    "Tensor(c!)[] exp_avgs, Tensor(d!)[] master_params, Tensor grad_norms, float lr, float "       \
    "beta1, float beta2, float eps, int step, bool bias_correction, float weight_decay, bool "     \
    "grad_averaging, bool reg_inside_moment, Tensor? inv_scale=None, Tensor? found_inf=None, "     \
    "bool unscale_grads=False) -> ()")

// apex's loss-scale update with hysteresis (amp_C.update_scale_hysteresis).
#define APEX_PY_UPDATE_SCALE_HYSTERESIS_SCHEMA                                    \
  "update_scale_hysteresis(Tensor(a!) current_scale, Tensor(b!) growth_tracker, " \
  "Tensor(c!) hysteresis_tracker, Tensor found_inf, float growth_factor, "        \
  "float backoff_factor, int growth_interval, int hysteresis) -> ()"

// The norms' forward and backward (fused_norm, the modules' op, is the regular library's alone).
#define APEX_PY_NORM_FWD_SCHEMA                                                                    \
  "fused_norm_fwd(Tensor input, int[] normalized_shape, Tensor? weight, Tensor? bias, float eps, " \
  "bool rms, bool mixed, bool memory_efficient) -> (Tensor, Tensor, Tensor)"
#define APEX_PY_NORM_BWD_SCHEMA                                                                    \
  "fused_norm_bwd(Tensor grad_out, Tensor saved, Tensor mean, Tensor rstd, Tensor? weight, "       \
  "Tensor? bias, int[] normalized_shape, float eps, bool rms, bool mixed, bool memory_efficient, " \
  "ScalarType input_dtype, bool[3] output_mask) -> (Tensor, Tensor, Tensor)"

// SyncBatchNorm's per-rank CPU pieces.
#define APEX_PY_BATCH_NORM_STATS_SCHEMA "batch_norm_stats(Tensor input) -> Tensor"
#define APEX_PY_BATCH_NORM_ELEMT_SCHEMA \
  "batch_norm_elemt(Tensor input, Tensor mean, Tensor scale, Tensor shift) -> Tensor"
#define APEX_PY_BATCH_NORM_BACKWARD_REDUCE_SCHEMA \
  "batch_norm_backward_reduce(Tensor grad_out, Tensor input, Tensor mean) -> Tensor"
#define APEX_PY_BATCH_NORM_BACKWARD_ELEMT_SCHEMA                                               \
  "batch_norm_backward_elemt(Tensor grad_out, Tensor input, Tensor mean, Tensor a, Tensor b, " \
  "Tensor k) -> Tensor"
