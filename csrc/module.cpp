// The module specdec._C. Importing it loads the library, whose static initialisers register the torch ops
// (torch.ops.specdec) with the dispatcher; its own functions are the host-side helpers that take Python objects.

#include <Python.h>

#include "fill_shapes.h"

namespace {

PyMethodDef methods[] = {
    {"fill_shapes", specdec::fill_shapes, METH_VARARGS,
     "The adaptive controller's greedy fills, as specdec.decoding.depth_choice.fill_shapes computes them."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "specdec C++/CUDA ops (torch.ops.specdec)", -1, methods};

}  // namespace

extern "C" PyObject* PyInit__C(void) { return PyModule_Create(&module_def); }
