// The adaptive controller's choice of depths (specdec/decoding/depth_choice.py, best_depths, with its greedy fills
// and the cost model's prices, specdec/decoding/step_cost.py): the same arithmetic in the same order, so the same
// bits, without the interpreter's cost -- the controller runs this over every request and draft level every step,
// on the host, between two steps.
//
// A plain CPython function on the extension module (not a torch op): its arguments are Python objects (the cost
// model's tables as they are) and it returns a Python list, so no tensor is made and no dispatcher is crossed.
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
#include "cost_tables.h"
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

// A shape's expected tokens, nodes and context rows (nodes x context), added in request order.
struct Sums {
  double tokens = 0.0;
  int64_t nodes = 0, context_rows = 0;
};

Sums shape_sums(const std::vector<std::vector<double>>& expected, const std::vector<int64_t>& rows,
                const std::vector<int64_t>& depths, const std::vector<int64_t>& contexts) {
  Sums sums;
  for (size_t r = 0; r < depths.size(); ++r) {
    const int64_t n = rows[depths[r]];
    sums.tokens = sums.tokens + expected[r][depths[r]];
    sums.nodes += n;
    sums.context_rows += n * contexts[r];
  }
  return sums;
}

// StepCostModel.price over the model's own tables: a measured shape (requests, levels, mean depth rounded) at its
// running mean moved by the fitted row and context terms, any other at the linear part plus its level count's
// residual.
class Prices {
 public:
  Prices(PyObject* shape_mean, PyObject* residual, std::vector<double> theta, double row_price, double context_price)
      : shape_mean_(shape_mean), residual_(residual), theta_(std::move(theta)), row_price_(row_price),
        context_price_(context_price) {}

  // False with a Python exception set when a table holds what the cost model never puts there.
  bool price(int64_t requests, int64_t extra_rows, int64_t levels, int64_t context_rows, double& seconds) const {
    const double rows = static_cast<double>(extra_rows), context = static_cast<double>(context_rows) / 1024;
    PyObject* key = shape_key(requests, levels, rows);
    if (key == nullptr) return false;
    PyObject* mean = PyDict_GetItemWithError(shape_mean_, key);  // borrowed
    Py_DECREF(key);
    if (mean != nullptr) {
      double seconds_mean, context_mean, rows_mean;
      if (!read_mean(mean, seconds_mean, context_mean, rows_mean)) return false;
      seconds = seconds_mean + row_price_ * (rows - rows_mean) + context_price_ * (context - context_mean);
      return true;
    }
    if (PyErr_Occurred()) return false;
    const std::vector<double>& t = theta_;
    const double drafting = levels > 0 ? 1.0 : 0.0, count = static_cast<double>(requests);
    const double linear = t[0] + t[1] * count + t[2] * drafting + t[3] * (drafting * count) + t[4] * rows;
    double residual = 0.0;
    bool found;
    if (!level_residual(residual_, levels, "best_depths: residual's values must be floats", residual, found))
      return false;
    seconds = linear + t[5] * static_cast<double>(levels) + t[6] * context + residual;
    return true;
  }

  // expected_rate of a shape of `levels` levels (its deepest request's) from its sums.
  bool rate(int64_t requests, int64_t levels, const Sums& sums, double entry, double& out) const {
    double seconds;
    if (!price(requests, sums.nodes - requests, levels, sums.context_rows, seconds)) return false;
    if (levels > 0) seconds += entry;
    out = sums.tokens / (seconds > 1e-12 ? seconds : 1e-12);
    return true;
  }

 private:
  static bool read_mean(PyObject* mean, double& seconds, double& context, double& rows) {
    if (!PyList_Check(mean) || PyList_GET_SIZE(mean) < 3) {
      PyErr_SetString(PyExc_TypeError,
                      "best_depths: shape_mean's values must be lists of floats [seconds, context, rows, ...]");
      return false;
    }
    seconds = PyFloat_AsDouble(PyList_GET_ITEM(mean, 0));
    context = PyFloat_AsDouble(PyList_GET_ITEM(mean, 1));
    rows = PyFloat_AsDouble(PyList_GET_ITEM(mean, 2));
    if (!PyErr_Occurred()) return true;
    PyErr_SetString(PyExc_TypeError, "best_depths: shape_mean's values must be lists of floats");
    return false;
  }

  PyObject* shape_mean_;
  PyObject* residual_;
  std::vector<double> theta_;
  double row_price_, context_price_;
};

// The greedy fill of each level count L = 1 .. max(caps) (depth_choice.fill_shapes): each request's depth. A
// level's cost is its rows x (row_price + context_row_price x its request's context); a fill of L levels starts
// from tokens0 tokens (plain decoding's) and starts[L - 1] seconds (the L-level step's price).
std::vector<std::vector<int64_t>> greedy_fills(const std::vector<std::vector<double>>& expected,
                                               const std::vector<int64_t>& rows, const std::vector<int64_t>& caps,
                                               const std::vector<int64_t>& contexts, double row_price,
                                               double context_row_price, const std::vector<double>& starts,
                                               double tokens0, int64_t top) {
  const size_t requests = caps.size();
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
  std::vector<std::vector<int64_t>> fills(static_cast<size_t>(top), std::vector<int64_t>(requests, 0));
  for (int64_t levels = 1; levels <= top; ++levels) {
    // The first item of depth <= levels that would not raise tokens / seconds ends the fill (the items past the
    // last of depth <= levels are all deeper, so the scan may run to the end).
    double tokens = tokens0, seconds = starts[levels - 1];
    std::vector<int64_t>& depth = fills[levels - 1];
    for (const Item& item : items) {
      if (item.depth > levels) continue;
      if (item.ratio * seconds <= tokens) break;
      tokens = tokens + item.gain;
      seconds = seconds + item.cost;
      depth[item.request] = item.depth;
    }
  }
  return fills;
}

}  // namespace

PyObject* best_depths(PyObject* /*module*/, PyObject* args) {
  PyObject *shape_mean, *residual, *theta_obj, *expected_obj, *rows_obj, *caps_obj, *contexts_obj;
  double row_price, context_price, entry;
  if (!PyArg_ParseTuple(args, "O!O!OddOOOOd:best_depths", &PyDict_Type, &shape_mean, &PyDict_Type, &residual,
                        &theta_obj, &row_price, &context_price, &expected_obj, &rows_obj, &caps_obj, &contexts_obj,
                        &entry))
    return nullptr;
  std::vector<double> theta;
  std::vector<int64_t> rows, caps, contexts;
  if (!read_floats(theta_obj, "best_depths", "theta", theta) || !read_ints(rows_obj, "best_depths", "rows", rows) ||
      !read_ints(caps_obj, "best_depths", "caps", caps) ||
      !read_ints(contexts_obj, "best_depths", "contexts", contexts))
    return nullptr;
  if (theta.size() != 7) {
    PyErr_Format(PyExc_ValueError, "best_depths: theta must hold the cost model's 7 parameters, got %zu",
                 theta.size());
    return nullptr;
  }
  PyObject* expected_rows = PySequence_Fast(expected_obj, "");
  if (expected_rows == nullptr) {
    PyErr_SetString(PyExc_TypeError, "best_depths: expected must be a sequence of sequences of floats");
    return nullptr;
  }
  const size_t requests = caps.size();
  std::vector<std::vector<double>> expected(static_cast<size_t>(PySequence_Fast_GET_SIZE(expected_rows)));
  bool read = true;
  for (size_t r = 0; read && r < expected.size(); ++r)
    read = read_floats(PySequence_Fast_GET_ITEM(expected_rows, r), "best_depths", "expected[r]", expected[r]);
  Py_DECREF(expected_rows);
  if (!read) return nullptr;
  if (expected.size() != requests || contexts.size() != requests) {
    PyErr_Format(PyExc_ValueError, "best_depths: expected (%zu), caps (%zu) and contexts (%zu) must have one entry per "
                 "request", expected.size(), requests, contexts.size());
    return nullptr;
  }
  int64_t top = 0, context = 0;
  for (int64_t cap : caps) {
    if (cap < 0) {
      PyErr_SetString(PyExc_ValueError, "best_depths: caps must be >= 0");
      return nullptr;
    }
    top = std::max(top, cap);
  }
  for (int64_t c : contexts) context += c;
  if (static_cast<int64_t>(rows.size()) <= top) {
    PyErr_Format(PyExc_ValueError, "best_depths: rows needs max(caps) + 1 = %lld entries, got %zu",
                 static_cast<long long>(top + 1), rows.size());
    return nullptr;
  }
  for (size_t r = 0; r < requests; ++r) {
    if (static_cast<int64_t>(expected[r].size()) != caps[r] + 1) {
      PyErr_Format(PyExc_ValueError, "best_depths: expected[%zu] must hold caps[%zu] + 1 = %lld values, got %zu", r, r,
                   static_cast<long long>(caps[r] + 1), expected[r].size());
      return nullptr;
    }
  }

  const Prices prices(shape_mean, residual, std::move(theta), row_price, context_price);
  const int64_t count = static_cast<int64_t>(requests);
  const double tokens0 = static_cast<double>(requests);
  double seconds0, rate;
  if (!prices.price(count, 0, 0, context, seconds0)) return nullptr;
  double best_rate = tokens0 / std::max(seconds0, 1e-12);
  std::vector<int64_t> best(requests, 0);
  if (requests == 1) {  // the fill is the uniform depth: the best of every depth, priced as a whole shape
    for (int64_t levels = 1; levels <= top; ++levels) {
      const Sums sums{expected[0][levels], rows[levels], rows[levels] * contexts[0]};
      if (!prices.rate(1, levels, sums, entry, rate)) return nullptr;
      if (rate > best_rate) {
        best_rate = rate;
        best.assign(1, levels);
      }
    }
    return make_list(best, PyLong_FromLongLong);
  }
  std::vector<double> starts(static_cast<size_t>(top));
  for (int64_t levels = 1; levels <= top; ++levels) {
    double seconds;
    if (!prices.price(count, 0, levels, context, seconds)) return nullptr;
    starts[levels - 1] = std::max(seconds + entry, 1e-12);
  }
  const auto fills =
      greedy_fills(expected, rows, caps, contexts, row_price, context_price / 1024, starts, tokens0, top);
  std::vector<int64_t> uniform(requests);
  for (int64_t levels = 1; levels <= top; ++levels) {
    const std::vector<int64_t>& depth = fills[levels - 1];
    for (size_t r = 0; r < requests; ++r) uniform[r] = std::min(levels, caps[r]);
    if (*std::max_element(depth.begin(), depth.end()) == levels) {  // the whole shape, priced as measured where it was
      if (!prices.rate(count, levels, shape_sums(expected, rows, depth, contexts), entry, rate)) return nullptr;
      if (rate > best_rate) {
        best_rate = rate;
        best = depth;
      }
    }
    if (depth != uniform) {  // the shape fixed sizes use: often measured
      if (!prices.rate(count, levels, shape_sums(expected, rows, uniform, contexts), entry, rate)) return nullptr;
      if (rate > best_rate) {
        best_rate = rate;
        best = uniform;
      }
    }
  }
  return make_list(best, PyLong_FromLongLong);
}

}  // namespace specdec
