// specdec._C.fill_shapes: the adaptive controller's greedy fills (fill_shapes.cpp).
#pragma once

#include <Python.h>

namespace specdec {

PyObject* fill_shapes(PyObject* module, PyObject* args);

}  // namespace specdec
