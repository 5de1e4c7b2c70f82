// launch_key: the key under which specdec.kernels.triton_dispatch keeps a compiled Triton kernel, made from a
// launch's positional arguments, meta-parameters and launch options in one C call instead of Triton's binder (one
// C call an argument from Python).
//
// The key must determine Triton's specialisation of every argument. Triton specialises a tensor on its dtype and on
// whether its address is a multiple of 16, an int on its value (1, a multiple of 16, its integer width), and passes a
// float, a bool or None by type. The key holds a tensor's dtype and alignment, an int's value, a float's bits, a bool
// and None, each behind a tag byte, so equal keys mean equal specialisations. The meta-parameters and the options
// follow as (name, value) pairs, a string value by its bytes. The key is None (Triton's own dispatch decides) for an
// int outside int64, a tensor without data and any other type.
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "launch_key.h"

namespace specdec {

namespace {

template <typename T>
void append(std::string& key, char tag, T value) {
  key.push_back(tag);
  char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  key.append(bytes, sizeof(T));
}

bool append_tensor(std::string& key, PyObject* arg) {
  const at::Tensor& tensor = THPVariable_Unpack(arg);
  if (!tensor.defined() || !tensor.has_storage()) return false;
  const bool aligned = reinterpret_cast<std::uintptr_t>(tensor.data_ptr()) % 16 == 0;
  append(key, aligned ? 't' : 'u', static_cast<std::int8_t>(tensor.scalar_type()));
  return true;
}

// Appends `arg` to `key`; false where the launch gets no key. The exact types come first: torch's check for a tensor
// subclass is an isinstance call.
bool append_argument(std::string& key, PyObject* arg) {
  if (THPVariable_CheckExact(arg)) return append_tensor(key, arg);
  if (PyLong_CheckExact(arg)) {
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(arg, &overflow);
    if (overflow != 0 || (value == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    append(key, 'i', static_cast<std::int64_t>(value));
    return true;
  }
  if (PyUnicode_CheckExact(arg)) {
    Py_ssize_t size = 0;
    const char* text = PyUnicode_AsUTF8AndSize(arg, &size);
    if (text == nullptr) {
      PyErr_Clear();
      return false;
    }
    append(key, 's', static_cast<std::int64_t>(size));
    key.append(text, static_cast<size_t>(size));
    return true;
  }
  if (PyBool_Check(arg)) {  // (a bool is an int to Python, not to Triton)
    append(key, 'b', static_cast<std::int8_t>(arg == Py_True));
    return true;
  }
  if (arg == Py_None) {
    key.push_back('n');
    return true;
  }
  if (PyFloat_CheckExact(arg)) {
    append(key, 'f', PyFloat_AS_DOUBLE(arg));
    return true;
  }
  if (THPVariable_Check(arg)) return append_tensor(key, arg);  // a subclass (nn.Parameter)
  return false;
}

// Appends the (name, value) pairs of the dict `items`, in its order, between brackets; false as above.
bool append_items(std::string& key, PyObject* items) {
  if (!PyDict_CheckExact(items)) return false;
  key.push_back('{');
  Py_ssize_t position = 0;
  PyObject *name, *value;
  while (PyDict_Next(items, &position, &name, &value)) {
    if (!append_argument(key, name) || !append_argument(key, value)) return false;
  }
  key.push_back('}');
  return true;
}

}  // namespace

PyObject* launch_key(PyObject* /*module*/, PyObject* const* arguments, Py_ssize_t count) {
  if (count != 3) {
    PyErr_Format(PyExc_TypeError, "launch_key takes (args, meta, config), got %zd arguments", count);
    return nullptr;
  }
  PyObject* args = arguments[0];
  if (!PyTuple_Check(args)) {
    PyErr_Format(PyExc_TypeError, "launch_key: args must be a tuple, got %s", Py_TYPE(args)->tp_name);
    return nullptr;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  std::string key;
  key.reserve(static_cast<size_t>(n) * 9 + 128);
  try {
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!append_argument(key, PyTuple_GET_ITEM(args, i))) Py_RETURN_NONE;
    }
    if (!append_items(key, arguments[1]) || !append_items(key, arguments[2])) Py_RETURN_NONE;
  } catch (const std::exception&) {  // a tensor without data, a failing isinstance: Triton's own dispatch decides
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  return PyBytes_FromStringAndSize(key.data(), static_cast<Py_ssize_t>(key.size()));
}

}  // namespace specdec
