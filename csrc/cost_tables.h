// The adaptive controller's cost-model tables as specdec/decoding/step_cost.py keys them, read from C by the choice
// of depths (depth_choice.cpp) and the model's update (step_cost.cpp): one rule for both.
#pragma once

#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace specdec {

// A new reference to StepCostModel._shape's key: (requests, levels, mean depth rounded), where the mean depth is
// extra_rows / max(requests, 1) and the rounding is Python's round(), half to even (the default rounding mode).
inline PyObject* shape_key(int64_t requests, int64_t levels, double extra_rows) {
  const double depth = std::nearbyint(extra_rows / static_cast<double>(std::max<int64_t>(requests, 1)));
  return Py_BuildValue("(LLL)", static_cast<long long>(requests), static_cast<long long>(levels),
                       static_cast<long long>(depth));
}

// The running residual of steps of `levels` draft levels in `residual` (a dict by level count): `found` says whether
// it has one. False with a Python exception set on failure (`message`, a TypeError, when the value is no float).
inline bool level_residual(PyObject* residual, int64_t levels, const char* message, double& value, bool& found) {
  PyObject* key = PyLong_FromLongLong(levels);
  if (key == nullptr) return false;
  PyObject* item = PyDict_GetItemWithError(residual, key);  // borrowed
  Py_DECREF(key);
  found = item != nullptr;
  if (!found) return !PyErr_Occurred();
  value = PyFloat_AsDouble(item);
  if (value == -1.0 && PyErr_Occurred()) {
    PyErr_SetString(PyExc_TypeError, message);
    return false;
  }
  return true;
}

}  // namespace specdec
