// The adaptive controller's cost fit, solved (specdec/decoding/step_cost.py, ridge_solve): theta from
// (gram + diag(precision)) theta = moment + precision * prior_mean, by Cholesky, every step; the same arithmetic in
// the same order as the Python, so the same bits, without the interpreter's cost.

#include "fp_exact.h"  // first: its pragmas cover everything below

#include <Python.h>

#include <cmath>
#include <vector>

#include "controller.h"
#include "py_sequences.h"

namespace specdec {

PyObject* ridge_solve(PyObject* /*module*/, PyObject* args) {
  PyObject *gram_obj, *precision_obj, *moment_obj, *prior_obj;
  if (!PyArg_ParseTuple(args, "OOOO:ridge_solve", &gram_obj, &precision_obj, &moment_obj, &prior_obj)) return nullptr;
  std::vector<double> precision, moment, prior;
  if (!read_floats(precision_obj, "ridge_solve", "precision", precision) ||
      !read_floats(moment_obj, "ridge_solve", "moment", moment) ||
      !read_floats(prior_obj, "ridge_solve", "prior_mean", prior))
    return nullptr;
  const size_t n = moment.size();
  PyObject* rows = PySequence_Fast(gram_obj, "");
  if (rows == nullptr) {
    PyErr_SetString(PyExc_TypeError, "ridge_solve: gram must be a sequence of sequences of floats");
    return nullptr;
  }
  std::vector<std::vector<double>> gram(static_cast<size_t>(PySequence_Fast_GET_SIZE(rows)));
  bool read = true;
  for (size_t i = 0; read && i < gram.size(); ++i)
    read = read_floats(PySequence_Fast_GET_ITEM(rows, i), "ridge_solve", "gram[i]", gram[i]);
  Py_DECREF(rows);
  if (!read) return nullptr;
  bool square = gram.size() == n && precision.size() == n && prior.size() == n;
  for (size_t i = 0; square && i < n; ++i) square = gram[i].size() >= i + 1;
  if (!square) {
    PyErr_Format(PyExc_ValueError, "ridge_solve: gram (%zu rows, each through its diagonal), precision (%zu) and "
                 "prior_mean (%zu) must match moment (%zu)", gram.size(), precision.size(), prior.size(), n);
    return nullptr;
  }

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
      PyErr_SetString(PyExc_ValueError, "ridge_solve: gram + diag(precision) is not positive definite");
      return nullptr;
    }
    row.push_back(std::sqrt(s));
  }
  std::vector<double> y(n), theta(n, 0.0);  // low y = moment + precision * prior_mean; low^T theta = y
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
  return make_list(theta, PyFloat_FromDouble);
}

}  // namespace specdec
