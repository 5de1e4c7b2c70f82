// The adaptive controller's acceptance estimate (specdec/decoding/acceptance.py, AcceptanceModel): the step's
// observations and the expected tokens per depth, over the model's own tables (a dict of per-request lists of
// [accepted, tested] counts, and the pooled list), in the same arithmetic and order as the Python, so the same bits,
// without the interpreter's cost: the controller runs both over every running request every step.

#include "fp_exact.h"  // first: its pragmas cover everything below

#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "controller.h"
#include "py_sequences.h"

namespace specdec {
namespace {

// counts[0], counts[1] of a [accepted, tested] pair; false with a Python exception naming the table otherwise.
bool read_counts(PyObject* counts, const char* function, const char* table, double& accepted, double& tested) {
  if (PyList_Check(counts) && PyList_GET_SIZE(counts) == 2) {
    accepted = PyFloat_AsDouble(PyList_GET_ITEM(counts, 0));
    tested = PyFloat_AsDouble(PyList_GET_ITEM(counts, 1));
    if (!PyErr_Occurred()) return true;
    PyErr_Clear();
  }
  PyErr_Format(PyExc_TypeError, "%s: %s must hold [accepted, tested] lists of floats", function, table);
  return false;
}

bool check_list(PyObject* table, const char* function, const char* name) {
  if (PyList_Check(table)) return true;
  PyErr_Format(PyExc_TypeError, "%s: %s must be a list of [accepted, tested] lists", function, name);
  return false;
}

// Appends [0.0, 0.0] pairs until the table holds n.
bool extend_to(PyObject* table, Py_ssize_t n) {
  while (PyList_GET_SIZE(table) < n) {
    PyObject* pair = Py_BuildValue("[dd]", 0.0, 0.0);
    if (pair == nullptr) return false;
    const int failed = PyList_Append(table, pair);
    Py_DECREF(pair);
    if (failed) return false;
  }
  return true;
}

// AcceptanceModel.observe of one request: its counts fade, then positions 1 .. accepted + 1 count as tested.
bool observe_one(PyObject* own, PyObject* pooled, int64_t depth, int64_t accepted, double request_decay,
                 double pooled_decay) {
  const char* fn = "observe_acceptance";
  double a, t;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(own); ++i) {
    PyObject* counts = PyList_GET_ITEM(own, i);
    if (!read_counts(counts, fn, "a request's table", a, t) || !set_float(counts, 0, a * request_decay) ||
        !set_float(counts, 1, t * request_decay))
      return false;
  }
  const Py_ssize_t tested = static_cast<Py_ssize_t>(std::min(depth, accepted + 1));
  if (!extend_to(own, tested) || !extend_to(pooled, tested)) return false;
  for (Py_ssize_t i = 0; i < tested; ++i) {
    const double hit = accepted > i ? 1.0 : 0.0;
    PyObject* mine = PyList_GET_ITEM(own, i);
    PyObject* everyone = PyList_GET_ITEM(pooled, i);
    if (!read_counts(mine, fn, "a request's table", a, t) || !set_float(mine, 0, a + hit) ||
        !set_float(mine, 1, t + 1.0) || !read_counts(everyone, fn, "pooled", a, t) ||
        !set_float(everyone, 0, pooled_decay * a + hit) || !set_float(everyone, 1, pooled_decay * t + 1.0))
      return false;
  }
  return true;
}

}  // namespace

PyObject* observe_acceptance(PyObject* /*module*/, PyObject* args) {
  PyObject *requests, *pooled, *running_obj, *depths_obj, *accepted_obj;
  double request_decay, pooled_decay;
  if (!PyArg_ParseTuple(args, "O!OOOOdd:observe_acceptance", &PyDict_Type, &requests, &pooled, &running_obj,
                        &depths_obj, &accepted_obj, &request_decay, &pooled_decay))
    return nullptr;
  if (!check_list(pooled, "observe_acceptance", "pooled")) return nullptr;
  std::vector<int64_t> running, depths;
  if (!read_ints(running_obj, "observe_acceptance", "running", running) ||
      !read_ints(depths_obj, "observe_acceptance", "depths", depths))
    return nullptr;
  PyObject* accepted = PySequence_Fast(accepted_obj, "observe_acceptance: accepted must be a sequence");
  if (accepted == nullptr) return nullptr;
  const Py_ssize_t n = static_cast<Py_ssize_t>(running.size());
  if (static_cast<Py_ssize_t>(depths.size()) != n || PySequence_Fast_GET_SIZE(accepted) != n) {
    PyErr_Format(PyExc_ValueError, "observe_acceptance: running (%zd), depths (%zu) and accepted (%zd) must have one "
                 "entry per request", n, depths.size(), PySequence_Fast_GET_SIZE(accepted));
    Py_DECREF(accepted);
    return nullptr;
  }
  bool ok = true;
  for (Py_ssize_t r = 0; ok && r < n; ++r) {
    PyObject* item = PySequence_Fast_GET_ITEM(accepted, r);
    if (item == Py_None || depths[r] <= 0) continue;  // invalid logits, or nothing drafted: nothing to learn
    const long long count = PyLong_AsLongLong(item);
    if (count == -1 && PyErr_Occurred()) {
      PyErr_SetString(PyExc_TypeError, "observe_acceptance: accepted must hold ints or None");
      ok = false;
      break;
    }
    PyObject* key = PyLong_FromLongLong(running[r]);
    PyObject* own = key == nullptr ? nullptr : PyDict_GetItemWithError(requests, key);  // borrowed
    if (own == nullptr && key != nullptr && !PyErr_Occurred()) {  // the request's first observation
      PyObject* fresh = PyList_New(0);
      if (fresh != nullptr && PyDict_SetItem(requests, key, fresh) == 0) own = fresh;
      Py_XDECREF(fresh);  // the dict holds it
    }
    Py_XDECREF(key);
    ok = own != nullptr && check_list(own, "observe_acceptance", "a request's table") &&
         observe_one(own, pooled, depths[r], count, request_decay, pooled_decay);
  }
  Py_DECREF(accepted);
  if (!ok) return nullptr;
  Py_RETURN_NONE;
}

PyObject* expected_tokens(PyObject* /*module*/, PyObject* args) {
  PyObject *requests, *pooled, *running_obj, *caps_obj;
  double prior, pooled_weight, request_weight;
  if (!PyArg_ParseTuple(args, "O!OdddOO:expected_tokens", &PyDict_Type, &requests, &pooled, &prior, &pooled_weight,
                        &request_weight, &running_obj, &caps_obj))
    return nullptr;
  const char* fn = "expected_tokens";
  if (!check_list(pooled, fn, "pooled")) return nullptr;
  std::vector<int64_t> running, caps;
  if (!read_ints(running_obj, fn, "running", running) || !read_ints(caps_obj, fn, "caps", caps)) return nullptr;
  if (running.size() != caps.size()) {
    PyErr_Format(PyExc_ValueError, "expected_tokens: running (%zu) and caps (%zu) must have one entry per request",
                 running.size(), caps.size());
    return nullptr;
  }
  int64_t top = 0;
  for (int64_t cap : caps) {
    if (cap < 0) {
      PyErr_SetString(PyExc_ValueError, "expected_tokens: caps must be >= 0");
      return nullptr;
    }
    top = std::max(top, cap);
  }
  // The pooled rate at each depth (pooled_rates), weighted as a request's prior, and the rate of a request with
  // no counts there.
  std::vector<double> weighted(static_cast<size_t>(top)), unseen(static_cast<size_t>(top));
  double previous = prior, a, t;
  for (int64_t i = 0; i < top; ++i) {
    a = t = 0.0;
    if (i < PyList_GET_SIZE(pooled) && !read_counts(PyList_GET_ITEM(pooled, i), fn, "pooled", a, t)) return nullptr;
    previous = (a + pooled_weight * previous) / (t + pooled_weight);
    weighted[i] = request_weight * previous;
    unseen[i] = (0.0 + weighted[i]) / (0.0 + request_weight);
  }
  PyObject* expected = PyList_New(static_cast<Py_ssize_t>(running.size()));
  if (expected == nullptr) return nullptr;
  std::vector<double> row;
  for (size_t r = 0; r < running.size(); ++r) {
    PyObject* key = PyLong_FromLongLong(running[r]);
    PyObject* own = key == nullptr ? nullptr : PyDict_GetItemWithError(requests, key);  // borrowed
    Py_XDECREF(key);
    if (PyErr_Occurred() || (own != nullptr && !check_list(own, fn, "a request's table"))) {
      Py_DECREF(expected);
      return nullptr;
    }
    const int64_t seen = own == nullptr ? 0 : std::min<int64_t>(caps[r], PyList_GET_SIZE(own));
    double reach = 1.0, total = 1.0;
    row.assign(1, 1.0);
    for (int64_t i = 0; i < seen; ++i) {
      if (!read_counts(PyList_GET_ITEM(own, i), fn, "a request's table", a, t)) {
        Py_DECREF(expected);
        return nullptr;
      }
      reach *= (a + weighted[i]) / (t + request_weight);  // the chance of depth i + 1, given i
      total += reach;
      row.push_back(total);
    }
    for (int64_t i = seen; i < caps[r]; ++i) {
      reach *= unseen[i];
      total += reach;
      row.push_back(total);
    }
    PyObject* made = make_list(row, PyFloat_FromDouble);
    if (made == nullptr) {
      Py_DECREF(expected);
      return nullptr;
    }
    PyList_SET_ITEM(expected, static_cast<Py_ssize_t>(r), made);
  }
  return expected;
}

}  // namespace specdec
