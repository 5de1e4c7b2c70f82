// The adaptive controller's host loops as plain CPython functions on specdec._C (module.cpp): the Python's
// arithmetic in the Python's order, so the same bits (tests/test_controller_ops.py).
#pragma once

#include <Python.h>

namespace specdec {

// specdec.decoding.depth_choice.best_depths, over the cost model's tables (depth_choice.cpp).
PyObject* best_depths(PyObject* module, PyObject* args);

// specdec.decoding.acceptance.AcceptanceModel's observe_step and expected_tokens, over its tables (acceptance.cpp).
PyObject* observe_acceptance(PyObject* module, PyObject* args);
PyObject* expected_tokens(PyObject* module, PyObject* args);

// specdec.decoding.step_cost.StepCostModel.observe, over the model's attributes (step_cost.cpp).
PyObject* observe_cost(PyObject* module, PyObject* args);

}  // namespace specdec
