// Token-tree metadata builder: depth and bit-packed ancestor-or-self masks.
//
// Contract (same as specdec/kernels/tree_metadata.py, whose reference is the oracle):
//   parents  [N]   int32  local parent index, -1 for the root (node 0 of each tree),
//                         parents[i] < i within a tree
//   offsets  [B+1] int32  node offsets of the B trees, each tree non-empty
//   max_nodes       int   mask width in nodes
//   check           bool  validate the values (CUDA: one read-back; the CPU op always validates)
// returns, with shapes from N and max_nodes only
//   depth         [N]     int32
//   ancestor_mask [N, W]  int64, W = ceil(max_nodes / 64), bit j of row i set when local
//                         node j is i or an ancestor of i
// Bad arguments raise ValueError (TypeError for dtypes), as the Python package promises.

#include <torch/library.h>
#include <ATen/ATen.h>

#include "tree_metadata.h"

namespace specdec {

void check_tree_metadata_args(const at::Tensor& parents, const at::Tensor& offsets, int64_t max_nodes) {
  TORCH_CHECK_TYPE(parents.scalar_type() == at::kInt, "parents must have dtype int32, got ", parents.scalar_type());
  TORCH_CHECK_TYPE(offsets.scalar_type() == at::kInt, "offsets must have dtype int32, got ", offsets.scalar_type());
  TORCH_CHECK_VALUE(parents.dim() == 1, "parents must be 1-D, got shape ", parents.sizes());
  TORCH_CHECK_VALUE(offsets.dim() == 1 && offsets.size(0) >= 1,
                    "offsets must be 1-D with B+1 >= 1 entries, got shape ", offsets.sizes());
  TORCH_CHECK_VALUE(parents.device() == offsets.device(), "offsets is on ", offsets.device(), " but parents is on ",
                    parents.device());
  TORCH_CHECK_VALUE(max_nodes >= 1, "max_nodes must be positive, got ", max_nodes);
}

void check_trees_host(const int32_t* par, const int32_t* off, int64_t num_trees, int64_t num_nodes,
                      int64_t max_nodes) {
  TORCH_CHECK_VALUE(off[0] == 0, "offsets must start at 0, got ", off[0]);
  for (int64_t b = 0; b < num_trees; ++b) {
    const int64_t n = static_cast<int64_t>(off[b + 1]) - off[b];
    TORCH_CHECK_VALUE(n >= 1, "offsets give tree ", b, " ", n, " nodes; every tree needs at least its root");
    TORCH_CHECK_VALUE(n <= max_nodes, "tree ", b, " has ", n, " nodes, more than max_nodes=", max_nodes);
  }
  TORCH_CHECK_VALUE(off[num_trees] == num_nodes, "offsets[-1] must equal the number of parents (", num_nodes,
                    "), got ", off[num_trees]);
  for (int64_t b = 0; b < num_trees; ++b) {
    const int64_t start = off[b], n = off[b + 1] - off[b];
    TORCH_CHECK_VALUE(par[start] == -1, "parents[", start, "] (root of tree ", b, ") must be -1, got ", par[start]);
    for (int64_t i = 1; i < n; ++i) {
      const int32_t p = par[start + i];
      TORCH_CHECK_VALUE(p >= 0 && p < i, "parents[", start + i, "] = ", p, " in tree ", b, " must lie in [0, ", i,
                        ") (local index of an earlier node: parents come before children)");
    }
  }
}

namespace {

std::tuple<at::Tensor, at::Tensor> tree_metadata_cpu(const at::Tensor& parents_in, const at::Tensor& offsets_in,
                                                     int64_t max_nodes, bool /*check: always, host data*/) {
  check_tree_metadata_args(parents_in, offsets_in, max_nodes);
  const at::Tensor parents = parents_in.contiguous();
  const at::Tensor offsets = offsets_in.contiguous();
  const int64_t num_nodes = parents.size(0);
  const int64_t num_trees = offsets.size(0) - 1;
  const int64_t words = (max_nodes + 63) / 64;
  const int32_t* par = parents.data_ptr<int32_t>();
  const int32_t* off = offsets.data_ptr<int32_t>();
  check_trees_host(par, off, num_trees, num_nodes, max_nodes);

  at::Tensor depth = at::empty({num_nodes}, parents.options());
  at::Tensor mask = at::zeros({num_nodes, words}, parents.options().dtype(at::kLong));
  int32_t* dep = depth.data_ptr<int32_t>();
  int64_t* msk = mask.data_ptr<int64_t>();
  for (int64_t b = 0; b < num_trees; ++b) {
    const int64_t start = off[b], n = off[b + 1] - off[b];
    dep[start] = 0;
    msk[start * words] = 1;
    for (int64_t i = 1; i < n; ++i) {
      const int32_t p = par[start + i];
      dep[start + i] = dep[start + p] + 1;
      // Row i = row of its parent plus bit i: parents precede children.
      for (int64_t w = 0; w < words; ++w) msk[(start + i) * words + w] = msk[(start + p) * words + w];
      msk[(start + i) * words + i / 64] |= static_cast<int64_t>(uint64_t{1} << (i % 64));
    }
  }
  return {depth, mask};
}

}  // namespace

TORCH_LIBRARY(specdec, m) {
  m.def("tree_metadata(Tensor parents, Tensor offsets, int max_nodes, bool check=True) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("tree_metadata", &tree_metadata_cpu); }

}  // namespace specdec
