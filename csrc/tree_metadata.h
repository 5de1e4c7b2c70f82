// Shared argument checks of the tree-metadata op (CPU and CUDA implementations).
#pragma once

#include <ATen/ATen.h>

namespace specdec {

void check_tree_metadata_args(const at::Tensor& parents, const at::Tensor& offsets, int64_t max_nodes);
void check_offsets_host(const int32_t* offsets, int64_t num_trees, int64_t num_nodes, int64_t max_nodes);

}  // namespace specdec
