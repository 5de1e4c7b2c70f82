// CUDA implementation of specdec::tree_metadata (contract in tree_metadata.cpp).
//
// One launch, one thread per node: each node walks up to its root, setting its mask
// bits and counting its depth. Output shapes come from N and max_nodes only. With
// check=true the parents and offsets are first copied to the host and validated there
// (one read-back, ValueError as on the CPU); with check=false nothing is read back, and
// the kernel stays inside its buffers whatever the values: a node whose tree cannot be
// placed (bad offsets) gets depth -1 and an empty row, and a walk stops at any parent
// that is not an earlier node of its tree.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "tree_metadata.h"

namespace specdec {
namespace {

constexpr int kThreads = 256;

// Tree that owns global node i: the last b in [0, num_trees) with offsets[b] <= i (0 if none).
__device__ int64_t owning_tree(const int32_t* offsets, int64_t num_trees, int64_t i) {
  int64_t lo = 0, hi = num_trees - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= i) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__global__ void fill_kernel(const int32_t* parents, const int32_t* offsets, int64_t num_trees, int64_t num_nodes,
                            int64_t words, int64_t max_nodes, int32_t* depth, int64_t* mask) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_nodes) return;
  const int64_t start = offsets[owning_tree(offsets, num_trees, i)];
  const int64_t local = i - start;
  if (start < 0 || local < 0 || local >= max_nodes) {  // unchecked bad offsets: no row for this node
    depth[i] = -1;
    return;
  }
  int64_t* row = mask + i * words;
  int32_t d = 0;
  for (int64_t node = local; node >= 0; ++d) {  // start + node lies in [start, i]: inside parents
    row[node / 64] |= static_cast<long long>(1ull << (node % 64));
    const int32_t p = parents[start + node];
    node = (p >= 0 && p < node) ? p : -1;  // the root's -1, or a malformed parent, ends the walk
  }
  depth[i] = d - 1;
}

std::tuple<at::Tensor, at::Tensor> tree_metadata_cuda(const at::Tensor& parents_in, const at::Tensor& offsets_in,
                                                      int64_t max_nodes, bool check) {
  check_tree_metadata_args(parents_in, offsets_in, max_nodes);
  const c10::cuda::CUDAGuard guard(parents_in.device());
  const at::Tensor parents = parents_in.contiguous();
  const at::Tensor offsets = offsets_in.contiguous();
  const int64_t num_nodes = parents.size(0);
  const int64_t num_trees = offsets.size(0) - 1;
  const int64_t words = (max_nodes + 63) / 64;
  if (check) {  // the one read-back: validate on the host, with the CPU op's messages
    const at::Tensor host = at::cat({parents, offsets}).cpu();
    const int32_t* values = host.data_ptr<int32_t>();
    check_trees_host(values, values + num_nodes, num_trees, num_nodes, max_nodes);
  }
  at::Tensor depth = at::empty({num_nodes}, parents.options());
  at::Tensor mask = at::zeros({num_nodes, words}, parents.options().dtype(at::kLong));
  if (num_nodes > 0 && num_trees > 0) {
    const int blocks = static_cast<int>((num_nodes + kThreads - 1) / kThreads);
    fill_kernel<<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        parents.data_ptr<int32_t>(), offsets.data_ptr<int32_t>(), num_trees, num_nodes, words, max_nodes,
        depth.data_ptr<int32_t>(), mask.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else if (num_nodes > 0) {  // no trees but nodes: only an unchecked call gets here
    depth.fill_(-1);
  }
  return {depth, mask};
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec, CUDA, m) { m.impl("tree_metadata", &tree_metadata_cuda); }

}  // namespace specdec
