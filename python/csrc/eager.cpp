// apex._eager: the norms' modules call apex_cpp::fused_norm from here in eager mode, where a call
// through torch.ops (OpOverload -> schema-driven argument parsing into a boxed stack) costs ~1.5 us
// more than torch's own bindings (torch.layer_norm). This parses the eight arguments directly and
// calls the op through the dispatcher, unboxed; every dispatch key (autograd, autocast, Python
// modes, functorch, tracing) sees the same call as from torch.ops.
//
// What the dispatcher does not see is __torch_function__: for tensor subclasses, torch function
// modes, arguments of other types, or anything unusual, the call goes to the op object passed in
// first (the OpOverload), unchanged. torch.compile never reaches here (the modules test
// torch.compiler.is_compiling() first).
//
// A CPython extension module of its own, so that _apex_cpp.so stays a plain library for
// torch.ops.load_library; it finds the op by name (apex._ops loads the library first).
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <optional>
#include <tuple>

namespace {

using at::Tensor;

using NormSig = Tensor(const Tensor&, at::IntArrayRef, const std::optional<Tensor>&,
                       const std::optional<Tensor>&, double, bool, bool, bool);
using NormFwdSig = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, at::IntArrayRef,
                                                      const std::optional<Tensor>&,
                                                      const std::optional<Tensor>&, double, bool,
                                                      bool, bool);

bool plain_tensor(PyObject* o) { return THPVariable_CheckExact(o); }

bool optional_tensor(PyObject* o, std::optional<Tensor>& out) {
  if (o == Py_None) return true;
  if (!plain_tensor(o)) return false;
  out = THPVariable_Unpack(o);
  return true;
}

bool int_list(PyObject* o, c10::SmallVector<int64_t, 4>& out) {
  const bool list = PyList_CheckExact(o);
  if (!list && !PyTuple_Check(o)) return false;  // tuples include torch.Size
  const Py_ssize_t n = list ? PyList_GET_SIZE(o) : PyTuple_GET_SIZE(o);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = list ? PyList_GET_ITEM(o, i) : PyTuple_GET_ITEM(o, i);
    if (!PyLong_CheckExact(item)) return false;
    const long long v = PyLong_AsLongLong(item);
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    out.push_back(v);
  }
  return true;
}

bool to_double(PyObject* o, double& out) {
  if (PyFloat_Check(o)) {  // subclasses too (numpy.float64): their value, as torch.ops reads it
    out = PyFloat_AS_DOUBLE(o);
    return true;
  }
  if (!PyLong_CheckExact(o)) return false;
  out = PyLong_AsDouble(o);
  if (out == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

bool to_bool(PyObject* o, bool& out) {
  if (o != Py_True && o != Py_False) return false;
  out = o == Py_True;
  return true;
}

// Whether the next __torch_function__ check is to be skipped (torch.ops would consume the flag;
// the op takes that route then). Newer than torch 2.11, which has no such flag.
bool skip_next_torch_function() {
#ifdef APEX_TORCH_HAS_SKIP_NEXT
  return at::impl::PythonTorchFunctionTLS::peek_skip_next();
#else
  return false;
#endif
}

// The arguments after the first, in apex_cpp::fused_norm's order, when they allow the direct call.
struct NormArgs {
  std::optional<Tensor> weight, bias;
  c10::SmallVector<int64_t, 4> shape;
  double eps = 0;
  bool rms = false, mixed = false, memory_efficient = false;

  bool parse(PyObject* const* a) {
    return plain_tensor(a[0]) && int_list(a[1], shape) && optional_tensor(a[2], weight) &&
           optional_tensor(a[3], bias) && to_double(a[4], eps) && to_bool(a[5], rms) &&
           to_bool(a[6], mixed) && to_bool(a[7], memory_efficient) &&
           !at::impl::torch_function_mode_enabled() && !skip_next_torch_function();
  }
};

// fused_norm(op, input, normalized_shape, weight, bias, eps, rms, mixed, memory_efficient):
// op(input, ...) where the direct call cannot stand for it, else the op through the dispatcher.
PyObject* fused_norm(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 9) {
    PyErr_Format(PyExc_TypeError, "apex._eager.fused_norm: expected 9 arguments, got %zd", nargs);
    return nullptr;
  }
  NormArgs n;
  if (!n.parse(args + 1)) return PyObject_Vectorcall(args[0], args + 1, nargs - 1, nullptr);
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("apex_cpp::fused_norm", "").typed<NormSig>();
  const Tensor& input = THPVariable_Unpack(args[1]);
  Tensor y;
  {
    const pybind11::gil_scoped_release no_gil;
    y = op.call(input, n.shape, n.weight, n.bias, n.eps, n.rms, n.mixed, n.memory_efficient);
  }
  return THPVariable_Wrap(std::move(y));
  END_HANDLE_TH_ERRORS
}

// fused_norm_fwd_output(input, normalized_shape, weight, bias, eps, rms, mixed,
// memory_efficient): the output of apex_cpp::fused_norm_fwd (the op of apex's autograd
// Functions: no autocast rule) called directly, or NotImplemented where only the Function can
// stand for it.
PyObject* fused_norm_fwd_output(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 8) {
    PyErr_Format(PyExc_TypeError,
                 "apex._eager.fused_norm_fwd_output: expected 8 arguments, got %zd", nargs);
    return nullptr;
  }
  NormArgs n;
  if (!n.parse(args)) Py_RETURN_NOTIMPLEMENTED;
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("apex_cpp::fused_norm_fwd", "")
                             .typed<NormFwdSig>();
  const Tensor& input = THPVariable_Unpack(args[0]);
  Tensor y;
  {
    const pybind11::gil_scoped_release no_gil;
    y = std::get<0>(
        op.call(input, n.shape, n.weight, n.bias, n.eps, n.rms, n.mixed, n.memory_efficient));
  }
  return THPVariable_Wrap(std::move(y));
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"fused_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fused_norm)),
     METH_FASTCALL,
     "fused_norm(op, input, normalized_shape, weight, bias, eps, rms, mixed, memory_efficient): "
     "apex_cpp::fused_norm called directly, or op(...) for what only torch.ops handles"},
    {"fused_norm_fwd_output",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fused_norm_fwd_output)),
     METH_FASTCALL,
     "fused_norm_fwd_output(input, normalized_shape, weight, bias, eps, rms, mixed, "
     "memory_efficient): apex_cpp::fused_norm_fwd's output, called directly, or NotImplemented"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT,
                      "apex._eager",
                      "Direct eager entry points to apex-cpp's ops",
                      -1,
                      methods,
                      nullptr,
                      nullptr,
                      nullptr,
                      nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__eager() { return PyModule_Create(&module); }
