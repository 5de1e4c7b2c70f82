// The module specdec._C. Importing it loads the library, whose static initialisers register the torch ops
// (torch.ops.specdec) with the dispatcher; its own functions are the host-side helpers that take Python objects.

#include <Python.h>

#include "controller.h"
#include "launch_key.h"

namespace {

PyMethodDef methods[] = {
    {"best_depths", specdec::best_depths, METH_VARARGS,
     "The adaptive controller's choice of depths, as specdec.decoding.depth_choice.best_depths makes it."},
    {"observe_acceptance", specdec::observe_acceptance, METH_VARARGS,
     "A step's observations, as specdec.decoding.acceptance.AcceptanceModel.observe_step records them."},
    {"expected_tokens", specdec::expected_tokens, METH_VARARGS,
     "Expected tokens per depth, as specdec.decoding.acceptance.AcceptanceModel.expected_tokens computes them."},
    {"observe_cost", specdec::observe_cost, METH_VARARGS,
     "A step's time learnt, as specdec.decoding.step_cost.StepCostModel.observe learns it."},
    {"launch_key", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(specdec::launch_key)), METH_FASTCALL,
     "The key under which specdec.kernels.triton_dispatch keeps a compiled kernel, from a launch's arguments."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", "specdec C++/CUDA ops (torch.ops.specdec)", -1, methods, nullptr,
                          nullptr, nullptr, nullptr};

}  // namespace

extern "C" PyObject* PyInit__C(void) { return PyModule_Create(&module_def); }
