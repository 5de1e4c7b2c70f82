// CUDA implementation of specdec::tree_metadata (contract in tree_metadata.cpp).
//
// Two launches, one thread per node: the first validates parents and marks nodes
// that have a child; after one small read-back (the first bad index and the leaf
// count, which sizes the output) the second walks each node up to its root to
// fill its depth, its mask row and, for leaves, its path.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>

#include "tree_metadata.h"

namespace specdec {
namespace {

constexpr int kThreads = 256;

// Tree that owns global node i: the last b with offsets[b] <= i.
__device__ int64_t owning_tree(const int32_t* offsets, int64_t num_trees, int64_t i) {
  int64_t lo = 0, hi = num_trees - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= i) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__global__ void validate_kernel(const int32_t* parents, const int32_t* offsets, int64_t num_trees,
                                int64_t num_nodes, int32_t* has_child, unsigned long long* first_bad) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_nodes) return;
  const int64_t start = offsets[owning_tree(offsets, num_trees, i)];
  const int64_t local = i - start;
  const int32_t p = parents[i];
  const bool ok = local == 0 ? p == -1 : (p >= 0 && p < local);
  if (!ok) {
    atomicMin(first_bad, static_cast<unsigned long long>(i));
  } else if (local > 0) {
    has_child[start + p] = 1;  // benign race: every writer stores 1
  }
}

__global__ void fill_kernel(const int32_t* parents, const int32_t* offsets, int64_t num_trees, int64_t num_nodes,
                            int64_t words, int64_t max_nodes, const int32_t* has_child,
                            const int64_t* leaf_rank, int32_t* depth, int64_t* mask, int32_t* paths) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_nodes) return;
  const int64_t start = offsets[owning_tree(offsets, num_trees, i)];
  int64_t* row = mask + i * words;
  int32_t d = 0;
  for (int64_t node = i - start; node >= 0; node = parents[start + node]) {
    row[node / 64] |= static_cast<long long>(1ull << (node % 64));
    ++d;
  }
  depth[i] = d - 1;
  if (has_child[i]) return;
  int32_t* path = paths + (leaf_rank[i] - 1) * max_nodes;  // inclusive rank -> row
  int32_t pos = d - 1;
  for (int64_t node = i - start; node >= 0; node = parents[start + node]) path[pos--] = static_cast<int32_t>(node);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> tree_metadata_cuda(const at::Tensor& parents_in,
                                                                             const at::Tensor& offsets_in,
                                                                             int64_t max_nodes) {
  check_tree_metadata_args(parents_in, offsets_in, max_nodes);
  const c10::cuda::CUDAGuard guard(parents_in.device());
  const at::Tensor parents = parents_in.contiguous();
  const at::Tensor offsets = offsets_in.contiguous();
  const int64_t num_nodes = parents.size(0);
  const int64_t num_trees = offsets.size(0) - 1;
  const int64_t words = (max_nodes + 63) / 64;
  const at::Tensor offsets_host = offsets.cpu();
  check_offsets_host(offsets_host.data_ptr<int32_t>(), num_trees, num_nodes, max_nodes);

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int blocks = static_cast<int>((num_nodes + kThreads - 1) / kThreads);
  at::Tensor has_child = at::zeros({num_nodes}, parents.options());
  at::Tensor first_bad = at::full({1}, std::numeric_limits<int64_t>::max(), parents.options().dtype(at::kLong));
  if (num_nodes > 0) {
    validate_kernel<<<blocks, kThreads, 0, stream>>>(
        parents.data_ptr<int32_t>(), offsets.data_ptr<int32_t>(), num_trees, num_nodes,
        has_child.data_ptr<int32_t>(), reinterpret_cast<unsigned long long*>(first_bad.data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const at::Tensor leaf_rank = at::cumsum(has_child.eq(0), 0, at::kLong);
  const at::Tensor ends = offsets.slice(0, 1).to(at::kLong) - 1;
  const at::Tensor leaf_offsets = at::cat({at::zeros({1}, leaf_rank.options()),
                                           num_nodes > 0 ? leaf_rank.index_select(0, ends)
                                                         : at::zeros({num_trees}, leaf_rank.options())})
                                      .to(at::kInt);
  // One read-back: the first malformed node and the number of leaves.
  const at::Tensor host = at::stack({first_bad[0], leaf_offsets[num_trees].to(at::kLong)}).cpu();
  const int64_t bad = host.data_ptr<int64_t>()[0];
  const int64_t num_leaves = host.data_ptr<int64_t>()[1];
  if (bad != std::numeric_limits<int64_t>::max()) {
    const int32_t value = parents[bad].item<int32_t>();
    TORCH_CHECK(false, "parents[", bad, "] = ", value,
                " is malformed: a root (first node of a tree) must be -1 and any other node's parent "
                "must be the local index of an earlier node");
  }

  at::Tensor depth = at::empty({num_nodes}, parents.options());
  at::Tensor mask = at::zeros({num_nodes, words}, parents.options().dtype(at::kLong));
  at::Tensor paths = at::full({num_leaves, max_nodes}, -1, parents.options());
  if (num_nodes > 0) {
    fill_kernel<<<blocks, kThreads, 0, stream>>>(
        parents.data_ptr<int32_t>(), offsets.data_ptr<int32_t>(), num_trees, num_nodes, words, max_nodes,
        has_child.data_ptr<int32_t>(), leaf_rank.data_ptr<int64_t>(), depth.data_ptr<int32_t>(),
        mask.data_ptr<int64_t>(), paths.data_ptr<int32_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {depth, mask, paths, leaf_offsets};
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CUDA, m) { m.impl("tree_metadata", &tree_metadata_cuda); }

}  // namespace specdec
