// The adaptive controller's cost model learning from a step (specdec/decoding/step_cost.py, StepCostModel.observe):
// the shape's running mean, the level count's residual, the decayed normal equations and their ridge solve by
// Cholesky, over the model's own attributes, in the same arithmetic and order as the Python, so the same bits,
// without the interpreter's cost (it runs every step). The module's constants come in as arguments, read where
// the Python reads them, so a benchmark that swaps them (bench/ablate_adaptive.py) swaps them here too.

#include "fp_exact.h"  // first: its pragmas cover everything below

#include <Python.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "controller.h"
#include "cost_tables.h"
#include "py_sequences.h"

namespace specdec {
namespace {

constexpr size_t kFeatures = 7;  // StepCostModel.FEATURES
constexpr size_t kRequests = 1, kRows = 4, kLevels = 5, kContext = 6;

// An owned reference that lets go when it leaves scope.
struct Ref {
  PyObject* p;
  explicit Ref(PyObject* object) : p(object) {}
  ~Ref() { Py_XDECREF(p); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
};

// theta from (gram + diag(precision)) theta = moment + precision * prior_mean (step_cost.ridge_solve); false with
// a Python exception when the matrix is not positive definite.
bool ridge_solve(const std::vector<std::vector<double>>& gram, const std::vector<double>& precision,
                 const std::vector<double>& moment, const std::vector<double>& prior, std::vector<double>& theta) {
  const size_t n = moment.size();
  std::vector<std::vector<double>> low(n);  // the Cholesky factor's rows; only the lower triangle of gram is read
  for (size_t i = 0; i < n; ++i) {
    std::vector<double>& row = low[i];
    for (size_t j = 0; j < i; ++j) {
      double s = gram[i][j];
      for (size_t k = 0; k < j; ++k) s -= row[k] * low[j][k];
      row.push_back(s / low[j][j]);
    }
    double s = gram[i][i] + precision[i];
    for (double v : row) s -= v * v;
    if (!(s > 0.0)) {
      PyErr_SetString(PyExc_ValueError, "observe_cost: gram + diag(prior_precision) is not positive definite");
      return false;
    }
    row.push_back(std::sqrt(s));
  }
  std::vector<double> y(n);  // low y = moment + precision * prior_mean; low^T theta = y
  theta.assign(n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    double s = moment[i] + precision[i] * prior[i];
    for (size_t k = 0; k < i; ++k) s -= low[i][k] * y[k];
    y[i] = s / low[i][i];
  }
  for (size_t i = n; i-- > 0;) {
    double s = y[i];
    for (size_t k = i + 1; k < n; ++k) s -= low[k][i] * theta[k];
    theta[i] = s / low[i][i];
  }
  return true;
}

// The model's `name` (its value `value`) read as kFeatures floats.
bool read_features(PyObject* value, const char* name, std::vector<double>& out) {
  if (!read_floats(value, "observe_cost", name, out)) return false;
  if (out.size() == kFeatures) return true;
  PyErr_Format(PyExc_ValueError, "observe_cost: the model's %s must hold %zu floats, got %zu", name, kFeatures,
               out.size());
  return false;
}

// The model's attribute `name` read as kFeatures floats.
bool read_attribute(PyObject* model, const char* name, std::vector<double>& out) {
  Ref value(PyObject_GetAttrString(model, name));
  return value.p != nullptr && read_features(value.p, name, out);
}

bool set_attribute(PyObject* model, const char* name, PyObject* value) {
  if (value == nullptr) return false;
  const int failed = PyObject_SetAttrString(model, name, value);
  Py_DECREF(value);
  return failed == 0;
}

double python_max(double a, double b) { return b > a ? b : a; }  // max(a, b): a unless b is greater
double python_min(double a, double b) { return b < a ? b : a; }

}  // namespace

PyObject* observe_cost(PyObject* /*module*/, PyObject* args) {
  PyObject *model, *x_obj, *shares_obj, *weights_obj;
  double seconds, shape_step_cap, fit_outlier_cap, shape_decay, residual_decay;
  if (!PyArg_ParseTuple(args, "OOddddOOd:observe_cost", &model, &x_obj, &seconds, &shape_step_cap, &fit_outlier_cap,
                        &shape_decay, &shares_obj, &weights_obj, &residual_decay))
    return nullptr;
  std::vector<double> x, shares, weights;
  if (!read_floats(x_obj, "observe_cost", "x", x) || !read_floats(shares_obj, "observe_cost", "prior_shares", shares) ||
      !read_floats(weights_obj, "observe_cost", "prior_weights", weights))
    return nullptr;
  if (x.size() != kFeatures || shares.size() != kFeatures || weights.size() != kFeatures) {
    PyErr_Format(PyExc_ValueError, "observe_cost: x (%zu), prior_shares (%zu) and prior_weights (%zu) must hold the "
                 "%zu features", x.size(), shares.size(), weights.size(), kFeatures);
    return nullptr;
  }
  if (!std::isfinite(seconds)) {
    PyErr_SetString(PyExc_ValueError, "observe_cost: seconds must be finite");
    return nullptr;
  }
  Ref shape_mean(PyObject_GetAttrString(model, "shape_mean")), residual(PyObject_GetAttrString(model, "residual"));
  Ref gram(PyObject_GetAttrString(model, "gram")), moment(PyObject_GetAttrString(model, "moment"));
  Ref prior_mean_obj(PyObject_GetAttrString(model, "prior_mean")), theta_obj(PyObject_GetAttrString(model, "theta"));
  Ref decay_obj(PyObject_GetAttrString(model, "decay")), steps_obj(PyObject_GetAttrString(model, "steps"));
  if (!shape_mean.p || !residual.p || !gram.p || !moment.p || !prior_mean_obj.p || !theta_obj.p || !decay_obj.p ||
      !steps_obj.p)
    return nullptr;
  if (!PyDict_Check(shape_mean.p) || !PyDict_Check(residual.p) || !PyList_Check(moment.p) ||
      PyList_GET_SIZE(moment.p) != static_cast<Py_ssize_t>(kFeatures) || !PyList_Check(gram.p) ||
      PyList_GET_SIZE(gram.p) != static_cast<Py_ssize_t>(kFeatures)) {
    PyErr_SetString(PyExc_TypeError, "observe_cost: the model's shape_mean and residual must be dicts, its moment a "
                    "list of 7 floats and its gram a list of 7 such lists");
    return nullptr;
  }
  std::vector<std::vector<double>> gram_rows(kFeatures);  // read before anything changes: a bad model stays as it was
  std::vector<double> moment_values;
  bool lists = read_floats(moment.p, "observe_cost", "moment", moment_values);
  for (size_t i = 0; lists && i < kFeatures; ++i) {
    PyObject* row = PyList_GET_ITEM(gram.p, static_cast<Py_ssize_t>(i));
    lists = PyList_Check(row) && read_floats(row, "observe_cost", "gram[i]", gram_rows[i]) &&
            gram_rows[i].size() == kFeatures;
  }
  if (!lists) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_TypeError, "observe_cost: the model's gram must be a list of 7 lists of 7 floats");
    return nullptr;
  }
  const double decay = PyFloat_AsDouble(decay_obj.p);
  if (decay == -1.0 && PyErr_Occurred()) return nullptr;
  double row_price = 0.0, context_price = 0.0;
  {
    Ref row_obj(PyObject_GetAttrString(model, "row_price"));
    Ref context_obj(PyObject_GetAttrString(model, "context_price"));
    if (!row_obj.p || !context_obj.p) return nullptr;
    row_price = PyFloat_AsDouble(row_obj.p);
    context_price = PyFloat_AsDouble(context_obj.p);
    if (PyErr_Occurred()) return nullptr;
  }

  // The step's shape (requests and levels rounded half to even, as Python's round()).
  const auto requests = static_cast<int64_t>(std::nearbyint(x[kRequests]));
  const auto levels = static_cast<int64_t>(std::nearbyint(x[kLevels]));
  Ref shape(shape_key(requests, levels, x[kRows]));
  if (!shape.p) return nullptr;
  PyObject* mean = PyDict_GetItemWithError(shape_mean.p, shape.p);  // borrowed
  if (mean == nullptr && PyErr_Occurred()) return nullptr;
  double m[4] = {0.0, 0.0, 0.0, 0.0};  // [seconds, context, rows, weight]
  if (mean != nullptr) {
    if (!PyList_Check(mean) || PyList_GET_SIZE(mean) != 4) {
      PyErr_SetString(PyExc_TypeError, "observe_cost: shape_mean's values must be lists of 4 floats");
      return nullptr;
    }
    for (Py_ssize_t i = 0; i < 4; ++i) m[i] = PyFloat_AsDouble(PyList_GET_ITEM(mean, i));
    if (PyErr_Occurred()) return nullptr;
  }
  const bool fitted_before = theta_obj.p != Py_None;
  std::vector<double> theta_before;
  if (fitted_before && !read_features(theta_obj.p, "theta", theta_before)) return nullptr;
  double residual_before = 0.0;
  bool has_residual;
  if (!level_residual(residual.p, levels, "observe_cost: the model's residual must map level counts to floats",
                      residual_before, has_residual))
    return nullptr;
  // The prior: as the model holds it, or set by this, its first step.
  std::vector<double> prior_mean, prior_precision;
  if (prior_mean_obj.p != Py_None &&
      (!read_features(prior_mean_obj.p, "prior_mean", prior_mean) ||
       !read_attribute(model, "prior_precision", prior_precision)))
    return nullptr;

  double own = seconds;
  if (mean != nullptr && m[3] > 0) {  // a warm shape's mean takes a stalled step at no more than its cap
    const double price = m[0] + row_price * (x[kRows] - m[2]) + context_price * (x[kContext] - m[1]);
    own = python_min(python_max(seconds, (1 - shape_step_cap) * price), (1 + shape_step_cap) * price);
  }
  if (prior_mean_obj.p == Py_None) {  // the first step sets the scale of the prior
    prior_mean.resize(kFeatures);
    prior_precision.resize(kFeatures);
    for (size_t i = 0; i < kFeatures; ++i) {
      const double s = python_max(x[i], 1.0);
      prior_mean[i] = shares[i] * seconds / s;
      prior_precision[i] = weights[i] * s * s;
    }
    if (!set_attribute(model, "prior_mean", make_list(prior_mean, PyFloat_FromDouble)) ||
        !set_attribute(model, "prior_precision", make_list(prior_precision, PyFloat_FromDouble)))
      return nullptr;
  }
  if (mean == nullptr) {  // the shape's first step, cold: its price until the next step replaces it (weight 0)
    Ref fresh(Py_BuildValue("[dddd]", seconds, x[kContext], x[kRows], 0.0));
    if (!fresh.p || PyObject_SetItem(shape_mean.p, shape.p, fresh.p) != 0) return nullptr;
  } else {
    m[3] = shape_decay * m[3] + 1.0;  // weights fade, then normalise: no step counts more than a later one
    const double values[3] = {own, x[kContext], x[kRows]};
    for (int i = 0; i < 3; ++i) m[i] += (values[i] - m[i]) / m[3];
    for (Py_ssize_t i = 0; i < 4; ++i)
      if (!set_float(mean, i, m[i])) return nullptr;
  }
  if (fitted_before) {
    double fitted = 0.0;
    for (size_t i = 0; i < kFeatures; ++i) fitted += theta_before[i] * x[i];
    seconds = fitted > 0 ? python_min(seconds, fit_outlier_cap * fitted) : seconds;
    if (mean != nullptr) {  // the out-of-sample error of the linear part, at this level count (a warm step)
      const double error = seconds - fitted;
      const double previous = has_residual ? residual_before : error;
      Ref level_key(PyLong_FromLongLong(levels));
      Ref updated(PyFloat_FromDouble(residual_decay * previous + (1 - residual_decay) * error));
      if (!level_key.p || !updated.p || PyObject_SetItem(residual.p, level_key.p, updated.p) != 0) return nullptr;
    }
  }
  // The decayed normal equations, in place, then their solve.
  for (size_t i = 0; i < kFeatures; ++i) {
    moment_values[i] = decay * moment_values[i] + x[i] * seconds;
    if (!set_float(moment.p, static_cast<Py_ssize_t>(i), moment_values[i])) return nullptr;
    PyObject* row = PyList_GET_ITEM(gram.p, static_cast<Py_ssize_t>(i));
    for (size_t j = 0; j < kFeatures; ++j) {
      gram_rows[i][j] = decay * gram_rows[i][j] + x[i] * x[j];
      if (!set_float(row, static_cast<Py_ssize_t>(j), gram_rows[i][j])) return nullptr;
    }
  }
  const long long steps = PyLong_AsLongLong(steps_obj.p);
  if (steps == -1 && PyErr_Occurred()) return nullptr;
  if (!set_attribute(model, "steps", PyLong_FromLongLong(steps + 1))) return nullptr;
  std::vector<double> theta;
  if (!ridge_solve(gram_rows, prior_precision, moment_values, prior_mean, theta)) return nullptr;
  if (!set_attribute(model, "theta", make_list(theta, PyFloat_FromDouble)) ||
      !set_attribute(model, "row_price", PyFloat_FromDouble(python_max(theta[kRows], 0.0))) ||
      !set_attribute(model, "context_price", PyFloat_FromDouble(python_max(theta[kContext], 0.0))))
    return nullptr;
  Py_RETURN_NONE;
}

}  // namespace specdec
