// specdec.kernels.triton_dispatch's launch key as a plain CPython function on specdec._C (module.cpp; launch_key.cpp).
#pragma once

#include <Python.h>

namespace specdec {

// launch_key(args: tuple, meta: dict, config: dict) -> bytes | None: a key that determines Triton's specialisation of
// every argument and the meta-parameters and options of the launch, or None.
PyObject* launch_key(PyObject* module, PyObject* const* arguments, Py_ssize_t count);

}  // namespace specdec
