// The adaptive controller's greedy fills (specdec/decoding/depth_choice.py, fill_shapes): the same arithmetic in
// the same order, so the same bits, without the interpreter's cost -- the controller runs this over every request
// and draft level every step, on the host, between two steps.
//
// A plain CPython function on the extension module (not a torch op): its arguments are Python sequences and
// floats and it returns Python objects, so no tensor is made and no dispatcher is crossed.
//
// No product may be fused with an addition (a fused multiply-add rounds once where the Python rounds twice):
// contraction is off for this file on every compiler (GCC contracts across statements where the target has FMA).

#include "fp_exact.h"  // first: its pragmas cover everything below

#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "controller.h"
#include "py_sequences.h"

namespace specdec {
namespace {

struct Item {
  double ratio;  // the level's capped ratio: expected tokens per second of extra cost
  int64_t depth;
  int64_t request;
  double gain;
  double cost;
};

// Fill order: ratio down, then the shallower level, then the later request (Python's sort of the tuples
// (ratio, -depth, request, ...) in reverse; depth and request make every item's key unique).
bool before(const Item& a, const Item& b) {
  if (a.ratio != b.ratio) return a.ratio > b.ratio;
  if (a.depth != b.depth) return a.depth < b.depth;
  return a.request > b.request;
}

// (tokens, nodes, context rows) of a shape, as a Python tuple; added in request order.
PyObject* shape_sums(const std::vector<std::vector<double>>& expected, const std::vector<int64_t>& rows,
                     const std::vector<int64_t>& depths, const std::vector<int64_t>& contexts) {
  double tokens = 0.0;
  int64_t nodes = 0, context_rows = 0;
  for (size_t r = 0; r < depths.size(); ++r) {
    int64_t n = rows[depths[r]];
    tokens = tokens + expected[r][depths[r]];
    nodes += n;
    context_rows += n * contexts[r];
  }
  return Py_BuildValue("(dLL)", tokens, static_cast<long long>(nodes), static_cast<long long>(context_rows));
}

}  // namespace

PyObject* fill_shapes(PyObject* /*module*/, PyObject* args) {
  PyObject *expected_obj, *rows_obj, *caps_obj, *contexts_obj, *starts_obj;
  double row_price, context_row_price, tokens0;
  if (!PyArg_ParseTuple(args, "OOOOddOd:fill_shapes", &expected_obj, &rows_obj, &caps_obj, &contexts_obj,
                        &row_price, &context_row_price, &starts_obj, &tokens0))
    return nullptr;
  std::vector<int64_t> rows, caps, contexts;
  std::vector<double> starts;
  if (!read_ints(rows_obj, "fill_shapes", "rows", rows) || !read_ints(caps_obj, "fill_shapes", "caps", caps) ||
      !read_ints(contexts_obj, "fill_shapes", "contexts", contexts) ||
      !read_floats(starts_obj, "fill_shapes", "starts", starts))
    return nullptr;
  PyObject* expected_rows = PySequence_Fast(expected_obj, "");
  if (expected_rows == nullptr) {
    PyErr_SetString(PyExc_TypeError, "fill_shapes: expected must be a sequence of sequences of floats");
    return nullptr;
  }
  const size_t requests = caps.size();
  std::vector<std::vector<double>> expected(static_cast<size_t>(PySequence_Fast_GET_SIZE(expected_rows)));
  bool read = true;
  for (size_t r = 0; read && r < expected.size(); ++r)
    read = read_floats(PySequence_Fast_GET_ITEM(expected_rows, r), "fill_shapes", "expected[r]", expected[r]);
  Py_DECREF(expected_rows);
  if (!read) return nullptr;
  if (expected.size() != requests || contexts.size() != requests) {
    PyErr_Format(PyExc_ValueError, "fill_shapes: expected (%zu), caps (%zu) and contexts (%zu) must have one entry per "
                 "request", expected.size(), requests, contexts.size());
    return nullptr;
  }
  int64_t top = 0;
  for (int64_t cap : caps) {
    if (cap < 0) {
      PyErr_SetString(PyExc_ValueError, "fill_shapes: caps must be >= 0");
      return nullptr;
    }
    top = std::max(top, cap);
  }
  if (static_cast<int64_t>(rows.size()) <= top || static_cast<int64_t>(starts.size()) < top) {
    PyErr_Format(PyExc_ValueError, "fill_shapes: rows needs max(caps) + 1 = %lld entries and starts max(caps), got "
                 "%zu and %zu", static_cast<long long>(top + 1), rows.size(), starts.size());
    return nullptr;
  }
  for (size_t r = 0; r < requests; ++r) {
    if (static_cast<int64_t>(expected[r].size()) != caps[r] + 1) {
      PyErr_Format(PyExc_ValueError, "fill_shapes: expected[%zu] must hold caps[%zu] + 1 = %lld values, got %zu", r, r,
                   static_cast<long long>(caps[r] + 1), expected[r].size());
      return nullptr;
    }
  }

  std::vector<Item> items;
  items.reserve(requests * static_cast<size_t>(top));
  for (size_t r = 0; r < requests; ++r) {
    const double context_cost = context_row_price * static_cast<double>(contexts[r]);
    const double row_cost = row_price + context_cost;
    double ratio_cap = INFINITY, previous = 1.0;
    for (int64_t i = 1; i <= caps[r]; ++i) {
      const double reach = expected[r][i] - previous;  // the chance its first i drafts are accepted
      previous = expected[r][i];
      double level_cost = static_cast<double>(rows[i] - rows[i - 1]) * row_cost;
      if (level_cost < 1e-12) level_cost = 1e-12;
      const double ratio = reach / level_cost;
      if (ratio < ratio_cap) ratio_cap = ratio;  // a deeper level never goes before a shallower one
      items.push_back({ratio_cap, i, static_cast<int64_t>(r), reach, level_cost});
    }
  }
  std::sort(items.begin(), items.end(), before);

  PyObject* shapes = PyList_New(top);
  if (shapes == nullptr) return nullptr;
  std::vector<int64_t> depth(requests), uniform(requests);
  for (int64_t levels = 1; levels <= top; ++levels) {
    // The greedy fill: the first item of depth <= levels that would not raise tokens / seconds ends it (the
    // items past the last of depth <= levels are all deeper, so the scan may run to the end).
    double tokens = tokens0, seconds = starts[levels - 1];
    std::fill(depth.begin(), depth.end(), 0);
    for (const Item& item : items) {
      if (item.depth > levels) continue;
      if (item.ratio * seconds <= tokens) break;
      tokens = tokens + item.gain;
      seconds = seconds + item.cost;
      depth[item.request] = item.depth;
    }
    for (size_t r = 0; r < requests; ++r) uniform[r] = std::min(levels, caps[r]);
    PyObject* shape = Py_BuildValue("(NNN)", make_list(depth, PyLong_FromLongLong),
                                    shape_sums(expected, rows, depth, contexts),
                                    shape_sums(expected, rows, uniform, contexts));
    if (shape == nullptr) {
      Py_DECREF(shapes);
      return nullptr;
    }
    PyList_SET_ITEM(shapes, levels - 1, shape);
  }
  return shapes;
}

}  // namespace specdec
