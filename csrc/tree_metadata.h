// Shared parts of the tree-metadata op (CPU and CUDA implementations).
#pragma once

#include <ATen/ATen.h>

namespace specdec {

// Dtypes (TypeError), shapes, devices and max_nodes (ValueError) of the op's arguments.
void check_tree_metadata_args(const at::Tensor& parents, const at::Tensor& offsets, int64_t max_nodes);
// Values, on host copies: offsets start at 0, grow, cover every parent, each tree has 1..max_nodes
// nodes, roots are -1 and every other parent is the local index of an earlier node (ValueError).
void check_trees_host(const int32_t* parents, const int32_t* offsets, int64_t num_trees, int64_t num_nodes,
                      int64_t max_nodes);

}  // namespace specdec
