// The module specdec._C. Importing it loads the library, whose static initialisers register the torch ops
// (torch.ops.specdec) with the dispatcher; its own functions are the host-side helpers that take Python objects.

#include <Python.h>

#include "controller.h"

namespace {

PyMethodDef methods[] = {
    {"fill_shapes", specdec::fill_shapes, METH_VARARGS,
     "The adaptive controller's greedy fills, as specdec.decoding.depth_choice.fill_shapes computes them."},
    {"ridge_solve", specdec::ridge_solve, METH_VARARGS,
     "The adaptive controller's cost fit, solved as specdec.decoding.step_cost.ridge_solve solves it."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "specdec C++/CUDA ops (torch.ops.specdec)", -1, methods, nullptr,
                          nullptr, nullptr, nullptr};

}  // namespace

extern "C" PyObject* PyInit__C(void) { return PyModule_Create(&module_def); }
