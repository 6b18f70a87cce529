// Internal, ATen-free: the kernels' hyperparameters from doubles (rounded once to the kernels'
// fp32), for the Python ops (ops/multi_tensor_ops.h) and the C++ optimizers (optim/state.h) alike;
// each caller adds its pointers (amp scalars, scratch).
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/multi_tensor.h"

namespace apex::ops {

inline kernels::AdamArgs adam_args(double lr, double beta1, double beta2, double eps, int64_t step,
                                   bool adam_w_mode, bool bias_correction, double weight_decay) {
  kernels::AdamArgs a;
  a.lr = static_cast<float>(lr);
  a.beta1 = static_cast<float>(beta1);
  a.beta2 = static_cast<float>(beta2);
  a.eps = static_cast<float>(eps);
  a.weight_decay = static_cast<float>(weight_decay);
  a.adam_w_mode = adam_w_mode;
  a.bias_correction = bias_correction;
  a.step = step;
  return a;
}

inline kernels::SgdArgs sgd_args(double lr, double momentum, double dampening, double weight_decay,
                                 bool nesterov, bool first_run, bool wd_after_momentum) {
  kernels::SgdArgs a;
  a.lr = static_cast<float>(lr);
  a.momentum = static_cast<float>(momentum);
  a.dampening = static_cast<float>(dampening);
  a.weight_decay = static_cast<float>(weight_decay);
  a.nesterov = nesterov;
  a.first_run = first_run;
  a.wd_after_momentum = wd_after_momentum;
  return a;
}

inline kernels::AdagradArgs adagrad_args(double lr, double eps, bool adagrad_w_mode,
                                         double weight_decay) {
  kernels::AdagradArgs a;
  a.lr = static_cast<float>(lr);
  a.eps = static_cast<float>(eps);
  a.weight_decay = static_cast<float>(weight_decay);
  a.adagrad_w_mode = adagrad_w_mode;
  return a;
}

inline kernels::LambArgs lamb_args(double lr, double beta1, double beta2, double eps, int64_t step,
                                   bool bias_correction, double weight_decay, bool grad_averaging,
                                   bool adam_w_mode, double max_grad_norm, bool use_nvlamb) {
  kernels::LambArgs a;
  a.lr = static_cast<float>(lr);
  a.beta1 = static_cast<float>(beta1);
  a.beta2 = static_cast<float>(beta2);
  a.beta3 = kernels::grad_weight(beta1, grad_averaging);
  a.eps = static_cast<float>(eps);
  a.weight_decay = static_cast<float>(weight_decay);
  a.bias_correction1 = static_cast<float>(kernels::bias_correction(beta1, step, bias_correction));
  a.bias_correction2 = static_cast<float>(kernels::bias_correction(beta2, step, bias_correction));
  a.adam_w_mode = adam_w_mode;
  a.use_nvlamb = use_nvlamb;
  a.max_grad_norm = static_cast<float>(max_grad_norm);
  return a;
}

inline kernels::NovoGradArgs novograd_args(double lr, double beta1, double beta2, double eps,
                                           int64_t step, bool bias_correction, double weight_decay,
                                           bool grad_averaging, bool reg_inside_moment) {
  kernels::NovoGradArgs a;
  a.lr = static_cast<float>(lr);
  a.beta1 = static_cast<float>(beta1);
  a.beta3 = kernels::grad_weight(beta1, grad_averaging);
  a.eps = static_cast<float>(eps);
  a.weight_decay = static_cast<float>(weight_decay);
  a.bias_correction1 = static_cast<float>(kernels::bias_correction(beta1, step, bias_correction));
  a.bias_correction2 =
      static_cast<float>(std::sqrt(kernels::bias_correction(beta2, step, bias_correction)));
  a.reg_inside_moment = reg_inside_moment;
  return a;
}

}  // namespace apex::ops
