// The adaptive controller's host loops as plain CPython functions on specdec._C (module.cpp): the Python's
// arithmetic in the Python's order, so the same bits (tests/test_controller_ops.py).
#pragma once

#include <Python.h>

namespace specdec {

// specdec.decoding.depth_choice.fill_shapes (fill_shapes.cpp).
PyObject* fill_shapes(PyObject* module, PyObject* args);

// specdec.decoding.step_cost.ridge_solve (ridge_solve.cpp).
PyObject* ridge_solve(PyObject* module, PyObject* args);

}  // namespace specdec
