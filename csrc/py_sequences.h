// Python sequences read into vectors, for the extension's plain CPython functions (controller.h): false with a
// Python exception set (naming the function and the argument) when an item is not what it must be.
#pragma once

#include <Python.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace specdec {

inline bool read_ints(PyObject* sequence, const char* function, const char* name, std::vector<int64_t>& out) {
  PyObject* fast = PySequence_Fast(sequence, "");
  if (fast == nullptr) {
    PyErr_Format(PyExc_TypeError, "%s: %s must be a sequence of ints", function, name);
    return false;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  out.resize(n);
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < n; ++i) {
    out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    ok = !(out[i] == -1 && PyErr_Occurred());
  }
  Py_DECREF(fast);
  return ok;
}

// Finite floats only: a NaN or an infinity would leave a sort without an order or a factorisation without meaning.
inline bool read_floats(PyObject* sequence, const char* function, const char* name, std::vector<double>& out) {
  PyObject* fast = PySequence_Fast(sequence, "");
  if (fast == nullptr) {
    PyErr_Format(PyExc_TypeError, "%s: %s must be a sequence of floats", function, name);
    return false;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  out.resize(n);
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < n; ++i) {
    out[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(fast, i));
    ok = !(out[i] == -1.0 && PyErr_Occurred());
    if (ok && !std::isfinite(out[i])) {
      PyErr_Format(PyExc_ValueError, "%s: %s must hold finite floats", function, name);
      ok = false;
    }
  }
  Py_DECREF(fast);
  return ok;
}

}  // namespace specdec
