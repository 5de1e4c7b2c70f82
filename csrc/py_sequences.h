// Python sequences read into vectors and vectors made into Python lists, for the extension's plain CPython
// functions (controller.h). A read returns false with a Python exception set (naming the function and the
// argument) when an item is not what it must be.
#pragma once

#include <Python.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace specdec {

// Each item through `convert` (a CPython conversion: -1 with an exception set when it fails).
template <typename T, typename Convert>
bool read_sequence(PyObject* sequence, const char* function, const char* name, const char* kind,
                   std::vector<T>& out, Convert convert) {
  PyObject* fast = PySequence_Fast(sequence, "");
  if (fast == nullptr) {
    PyErr_Format(PyExc_TypeError, "%s: %s must be a sequence of %s", function, name, kind);
    return false;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  out.resize(n);
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < n; ++i) {
    out[i] = convert(PySequence_Fast_GET_ITEM(fast, i));
    ok = !(out[i] == T(-1) && PyErr_Occurred());
  }
  Py_DECREF(fast);
  return ok;
}

inline bool read_ints(PyObject* sequence, const char* function, const char* name, std::vector<int64_t>& out) {
  return read_sequence(sequence, function, name, "ints", out,
                       [](PyObject* item) -> int64_t { return PyLong_AsLongLong(item); });
}

// Finite floats only: a NaN or an infinity would leave a sort without an order or a factorisation without meaning.
inline bool read_floats(PyObject* sequence, const char* function, const char* name, std::vector<double>& out) {
  if (!read_sequence(sequence, function, name, "floats", out, PyFloat_AsDouble)) return false;
  for (double v : out) {
    if (!std::isfinite(v)) {
      PyErr_Format(PyExc_ValueError, "%s: %s must hold finite floats", function, name);
      return false;
    }
  }
  return true;
}

// A new Python list of `make(value)` for each value; nullptr with the exception set when one fails.
template <typename T, typename Make>
PyObject* make_list(const std::vector<T>& values, Make make) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* item = make(values[i]);
    if (item == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
  }
  return list;
}

// list[i] = float(value) for a Python list: false with the exception set when it fails.
inline bool set_float(PyObject* list, Py_ssize_t i, double value) {
  PyObject* item = PyFloat_FromDouble(value);
  return item != nullptr && PyList_SetItem(list, i, item) == 0;  // the list takes the new item, drops the old
}

}  // namespace specdec
