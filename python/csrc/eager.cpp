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

namespace {

using at::Tensor;

using NormSig = Tensor(const Tensor&, at::IntArrayRef, const std::optional<Tensor>&,
                       const std::optional<Tensor>&, double, bool, bool, bool);

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
  if (PyFloat_CheckExact(o)) {
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

// fused_norm(op, input, normalized_shape, weight, bias, eps, rms, mixed, memory_efficient):
// op(input, ...) where the direct call cannot stand for it, else the op through the dispatcher.
PyObject* fused_norm(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 9) {
    PyErr_Format(PyExc_TypeError, "apex._eager.fused_norm: expected 9 arguments, got %zd", nargs);
    return nullptr;
  }
  std::optional<Tensor> weight, bias;
  c10::SmallVector<int64_t, 4> shape;
  double eps = 0;
  bool rms = false, mixed = false, memory_efficient = false;
  const bool direct = plain_tensor(args[1]) && int_list(args[2], shape) &&
                      optional_tensor(args[3], weight) && optional_tensor(args[4], bias) &&
                      to_double(args[5], eps) && to_bool(args[6], rms) && to_bool(args[7], mixed) &&
                      to_bool(args[8], memory_efficient) &&
                      !at::impl::torch_function_mode_enabled() && !skip_next_torch_function();
  if (!direct) return PyObject_Vectorcall(args[0], args + 1, nargs - 1, nullptr);
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("apex_cpp::fused_norm", "").typed<NormSig>();
  const Tensor& input = THPVariable_Unpack(args[1]);
  Tensor y;
  {
    const pybind11::gil_scoped_release no_gil;
    y = op.call(input, shape, weight, bias, eps, rms, mixed, memory_efficient);
  }
  return THPVariable_Wrap(std::move(y));
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"fused_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fused_norm)),
     METH_FASTCALL,
     "fused_norm(op, input, normalized_shape, weight, bias, eps, rms, mixed, memory_efficient): "
     "apex_cpp::fused_norm called directly, or op(...) for what only torch.ops handles"},
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
