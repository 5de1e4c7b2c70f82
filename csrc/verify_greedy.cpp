// Greedy verification on the CPU, chains and trees: one pass per request instead of the PyTorch bodies'
// dozens of small ops (_chain_greedy_torch, _tree_greedy_torch in specdec/kernels/verify_greedy.py, whose
// readable references verify_chain_greedy_reference / verify_tree_greedy_reference are the oracles).
//
// verify_chain_greedy_cpu:
//   logits         [T + B, V] fp32/fp64/fp16/bf16, last dim contiguous; request b owns rows
//                  offsets[b] + b .. offsets[b+1] + b (one per draft, then the bonus row)
//   tokens         [T]   int32 drafts, flattened
//   offsets        [B+1] int32 draft offsets
//   output_tokens  [B, W] int32 out: accepted drafts, then the argmax after them, -1 padded
//   num_accepted   [B]   int32 out
//   invalid        [B]   bool  out: some row of the request is bad (NaN, +inf, or no finite logit);
//                  such a request emits only -1 and accepts 0
// A row is bad exactly when torch's row max is not finite; a good row's argmax is the first maximum
// (torch.max's tie rule). Drafts past W - 1 are never accepted, but their rows still count for invalid.
//
// verify_tree_greedy_cpu: the same for trees of nodes (one logits row each, node 0 the root):
//   parents [N] int32 local parents (-1 for the root, parents before children), offsets [B+1] node offsets;
//   from the root, follow the first child whose token is its parent's argmax, at most W - 1 deep;
//   accepted_path [B, W] int32 out: the local nodes followed (0 first), -1 padded; an invalid request
//   keeps only its root there.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include "tree_metadata.h"

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace specdec {
namespace {

// The row max over values that are not NaN, and whether a NaN was seen.
template <typename scalar_t, typename acc_t>
acc_t row_max_scalar(const scalar_t* row, int64_t vocab, bool& saw_nan) {
  acc_t m = -std::numeric_limits<acc_t>::infinity();
  bool nan = false;
  for (int64_t i = 0; i < vocab; ++i) {
    const acc_t x = static_cast<acc_t>(row[i]);
    m = x > m ? x : m;
    nan |= x != x;
  }
  saw_nan = nan;
  return m;
}

template <typename scalar_t, typename acc_t>
int64_t first_equal_scalar(const scalar_t* row, int64_t vocab, acc_t m) {
  for (int64_t i = 0; i < vocab; ++i) {
    if (static_cast<acc_t>(row[i]) == m) return i;
  }
  return 0;  // unreachable for a good row
}

#if defined(__SSE2__)
// x86-64's baseline vectors, for fp32 and bf16 (GCC does not vectorise the scalar loops above: a float max
// reduction needs -ffinite-math-only, which would also drop the NaN test). 4 floats at a time.
constexpr bool kVectorised = true;
inline __m128 load4(const float* p) { return _mm_loadu_ps(p); }
inline __m128 load4(const c10::BFloat16* p) {  // bf16 is a float's upper half
  const __m128i half = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), half));
}

template <typename scalar_t>
float row_max_sse(const scalar_t* row, int64_t vocab, bool& saw_nan) {
  __m128 best[4], nan[4];  // four independent chains keep the max unit busy
  for (int l = 0; l < 4; ++l) {
    best[l] = _mm_set1_ps(-std::numeric_limits<float>::infinity());
    nan[l] = _mm_setzero_ps();
  }
  int64_t i = 0;
  for (; i + 16 <= vocab; i += 16) {
    for (int l = 0; l < 4; ++l) {
      const __m128 x = load4(row + i + 4 * l);
      best[l] = _mm_max_ps(x, best[l]);  // a NaN x keeps best (maxps returns its second operand)
      nan[l] = _mm_or_ps(nan[l], _mm_cmpunord_ps(x, x));
    }
  }
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, _mm_max_ps(_mm_max_ps(best[0], best[1]), _mm_max_ps(best[2], best[3])));
  bool rest_nan = false;
  float m = row_max_scalar<scalar_t, float>(row + i, vocab - i, rest_nan);
  for (int l = 0; l < 4; ++l) m = lanes[l] > m ? lanes[l] : m;
  saw_nan = rest_nan || _mm_movemask_ps(_mm_or_ps(_mm_or_ps(nan[0], nan[1]), _mm_or_ps(nan[2], nan[3]))) != 0;
  return m;
}

template <typename scalar_t>
int64_t first_equal_sse(const scalar_t* row, int64_t vocab, float m) {
  const __m128 target = _mm_set1_ps(m);
  int64_t i = 0;
  for (; i + 4 <= vocab; i += 4) {
    const int hits = _mm_movemask_ps(_mm_cmpeq_ps(load4(row + i), target));
    if (hits != 0) return i + __builtin_ctz(hits);
  }
  return i + first_equal_scalar<scalar_t, float>(row + i, vocab - i, m);
}
#else
constexpr bool kVectorised = false;
#endif

template <typename scalar_t>
constexpr bool vectorised() {
  return kVectorised && (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>);
}

template <typename scalar_t, typename acc_t>
acc_t row_max(const scalar_t* row, int64_t vocab, bool& saw_nan) {
#if defined(__SSE2__)
  if constexpr (vectorised<scalar_t>()) return row_max_sse(row, vocab, saw_nan);
#endif
  return row_max_scalar<scalar_t, acc_t>(row, vocab, saw_nan);
}

template <typename scalar_t, typename acc_t>
int64_t first_equal(const scalar_t* row, int64_t vocab, acc_t m) {
#if defined(__SSE2__)
  if constexpr (vectorised<scalar_t>()) return first_equal_sse(row, vocab, m);
#endif
  return first_equal_scalar<scalar_t, acc_t>(row, vocab, m);
}

// Each row's max into `maxes`; false when a row is bad as torch sees it: its max (which propagates NaN) is
// not finite. Stops at the first bad row.
template <typename scalar_t, typename acc_t>
bool rows_are_good(const scalar_t* rows, int64_t row_stride, int64_t n, int64_t vocab, std::vector<acc_t>& maxes) {
  maxes.resize(n);
  for (int64_t j = 0; j < n; ++j) {
    bool saw_nan = false;
    maxes[j] = row_max<scalar_t, acc_t>(rows + j * row_stride, vocab, saw_nan);
    if (saw_nan || !std::isfinite(static_cast<double>(maxes[j]))) return false;
  }
  return true;
}

template <typename scalar_t>
void chain_greedy_requests(const scalar_t* logits, int64_t row_stride, int64_t vocab, const int32_t* tokens,
                           const int32_t* offsets, int32_t* out_tokens, int64_t out_stride, int64_t width,
                           int32_t* num_accepted, bool* invalid, int64_t begin, int64_t end) {
  using acc_t = at::opmath_type<scalar_t>;
  std::vector<acc_t> maxes;  // the request's row maxes, reused across requests
  for (int64_t b = begin; b < end; ++b) {
    const int64_t draft_start = offsets[b], drafted = offsets[b + 1] - draft_start;
    const scalar_t* rows = logits + (draft_start + b) * row_stride;
    int32_t* out = out_tokens + b * out_stride;
    for (int64_t d = 0; d < width; ++d) out[d] = -1;
    const bool good = rows_are_good<scalar_t, acc_t>(rows, row_stride, drafted + 1, vocab, maxes);
    invalid[b] = !good;
    num_accepted[b] = 0;
    if (!good) continue;
    // Accept drafts while they equal their row's argmax and fit the width; emit the argmax after them.
    int64_t accepted = 0;
    int64_t argmax = first_equal<scalar_t, acc_t>(rows, vocab, maxes[0]);
    while (accepted < drafted && accepted < width - 1 && tokens[draft_start + accepted] == argmax) {
      out[accepted] = static_cast<int32_t>(argmax);
      ++accepted;
      argmax = first_equal<scalar_t, acc_t>(rows + accepted * row_stride, vocab, maxes[accepted]);
    }
    out[accepted] = static_cast<int32_t>(argmax);
    num_accepted[b] = static_cast<int32_t>(accepted);
  }
}

template <typename scalar_t>
void tree_greedy_requests(const scalar_t* logits, int64_t row_stride, int64_t vocab, const int32_t* tokens,
                          const int32_t* parents, const int32_t* offsets, int32_t* out_tokens, int32_t* out_path,
                          int64_t out_stride, int64_t path_stride, int64_t width, int32_t* num_accepted, bool* invalid,
                          int64_t begin, int64_t end) {
  using acc_t = at::opmath_type<scalar_t>;
  std::vector<acc_t> maxes;  // the request's row maxes, reused across requests
  for (int64_t b = begin; b < end; ++b) {
    const int64_t start = offsets[b], nodes = offsets[b + 1] - start;
    const scalar_t* rows = logits + start * row_stride;
    int32_t* out = out_tokens + b * out_stride;
    int32_t* path = out_path + b * path_stride;
    for (int64_t d = 0; d < width; ++d) out[d] = path[d] = -1;
    path[0] = 0;
    const bool good = rows_are_good<scalar_t, acc_t>(rows, row_stride, nodes, vocab, maxes);
    invalid[b] = !good;
    num_accepted[b] = 0;
    if (!good) continue;
    // Nodes come after their parents, so one scan in index order meets each child after its parent.
    int64_t depth = 0, cur = 0;
    int64_t argmax = first_equal<scalar_t, acc_t>(rows, vocab, maxes[0]);
    for (int64_t j = 1; j < nodes && depth < width - 1; ++j) {
      if (parents[start + j] == cur && tokens[start + j] == argmax) {
        out[depth] = static_cast<int32_t>(argmax);
        path[++depth] = static_cast<int32_t>(j);
        cur = j;
        argmax = first_equal<scalar_t, acc_t>(rows + j * row_stride, vocab, maxes[j]);
      }
    }
    out[depth] = static_cast<int32_t>(argmax);
    num_accepted[b] = static_cast<int32_t>(depth);
  }
}

// Devices, dtypes and shapes both ops share; `tokens` / `offsets` are named as the Python op names them.
void check_common_args(const char* op, const char* tokens_name, const char* offsets_name, const at::Tensor& logits,
                       const at::Tensor& tokens, const at::Tensor& offsets, const at::Tensor& output_tokens,
                       const at::Tensor& num_accepted, const at::Tensor& invalid) {
  for (const at::Tensor* t : {&logits, &tokens, &offsets, &output_tokens, &num_accepted, &invalid}) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), op, " takes CPU tensors, got one on ", t->device());
  }
  TORCH_CHECK_VALUE(logits.dim() == 2, "target_logits must be 2-D, got shape ", logits.sizes());
  TORCH_CHECK_TYPE(tokens.scalar_type() == at::kInt, tokens_name, " must have dtype int32, got ", tokens.scalar_type());
  TORCH_CHECK_TYPE(offsets.scalar_type() == at::kInt, offsets_name, " must have dtype int32, got ",
                   offsets.scalar_type());
  TORCH_CHECK_TYPE(output_tokens.scalar_type() == at::kInt && num_accepted.scalar_type() == at::kInt &&
                       invalid.scalar_type() == at::kBool,
                   "outputs must be int32 output_tokens, int32 num_accepted and bool invalid");
  TORCH_CHECK_VALUE(tokens.dim() == 1 && offsets.dim() == 1 && offsets.size(0) >= 1, tokens_name, " must be 1-D and ",
                    offsets_name, " 1-D with B+1 >= 1 entries");
  const int64_t batch = offsets.size(0) - 1;
  TORCH_CHECK_VALUE(output_tokens.dim() == 2 && output_tokens.size(0) == batch && output_tokens.size(1) >= 1 &&
                        output_tokens.stride(1) == 1,
                    "output_tokens must be [B, W >= 1] with contiguous rows, got shape ", output_tokens.sizes());
  TORCH_CHECK_VALUE(num_accepted.numel() == batch && num_accepted.is_contiguous() && invalid.numel() == batch &&
                        invalid.is_contiguous(),
                    "num_accepted and invalid must be contiguous [B]");
  TORCH_CHECK_VALUE(batch == 0 || logits.size(1) >= 1, "target_logits needs a vocabulary of at least one entry");
}

// Offsets are read on the host anyway: checking them keeps every read inside the buffers.
void check_offsets_host(const int32_t* off, int64_t batch, int64_t total) {
  TORCH_CHECK_VALUE(off[0] == 0, "draft_offsets must start at 0, got ", off[0]);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(off[b + 1] >= off[b], "draft_offsets must not decrease, got ", off[b], " then ", off[b + 1],
                      " at ", b);
  }
  TORCH_CHECK_VALUE(off[batch] == total, "draft_offsets[-1] must equal the number of draft tokens (", total,
                    "), got ", off[batch]);
}

void verify_chain_greedy_cpu(const at::Tensor& logits_in, const at::Tensor& tokens_in, const at::Tensor& offsets_in,
                             at::Tensor& output_tokens, at::Tensor& num_accepted, at::Tensor& invalid) {
  check_common_args("verify_chain_greedy_cpu", "draft_tokens", "draft_offsets", logits_in, tokens_in, offsets_in,
                    output_tokens, num_accepted, invalid);
  TORCH_CHECK_VALUE(logits_in.size(0) == tokens_in.numel() + offsets_in.size(0) - 1, "target_logits must have T + B = ",
                    tokens_in.numel(), " + ", offsets_in.size(0) - 1, " rows, got ", logits_in.size(0));
  const at::Tensor logits = logits_in.stride(1) == 1 ? logits_in : logits_in.contiguous();
  const at::Tensor tokens = tokens_in.contiguous();
  const at::Tensor offsets = offsets_in.contiguous();
  const int64_t batch = offsets.size(0) - 1, vocab = logits.size(1);
  const int32_t* off = offsets.data_ptr<int32_t>();
  check_offsets_host(off, batch, tokens.numel());
  if (batch == 0) return;
  const int32_t* tok = tokens.data_ptr<int32_t>();
  int32_t* out = output_tokens.data_ptr<int32_t>();
  int32_t* acc = num_accepted.data_ptr<int32_t>();
  bool* inv = invalid.data_ptr<bool>();
  const int64_t width = output_tokens.size(1), out_stride = output_tokens.stride(0);
  // Requests are independent; split them only when a share is worth a thread (~64k logits each).
  const int64_t per_request = std::max<int64_t>(1, logits.size(0) / batch * vocab);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / per_request);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "verify_chain_greedy_cpu", [&] {
    const scalar_t* data = logits.data_ptr<scalar_t>();
    const int64_t row_stride = logits.stride(0);
    at::parallel_for(0, batch, grain, [&](int64_t begin, int64_t end) {
      chain_greedy_requests<scalar_t>(data, row_stride, vocab, tok, off, out, out_stride, width, acc, inv, begin,
                                      end);
    });
  });
}

void verify_tree_greedy_cpu(const at::Tensor& logits_in, const at::Tensor& tokens_in, const at::Tensor& parents_in,
                            const at::Tensor& offsets_in, at::Tensor& output_tokens, at::Tensor& num_accepted,
                            at::Tensor& accepted_path, at::Tensor& invalid) {
  check_common_args("verify_tree_greedy_cpu", "node_tokens", "node_offsets", logits_in, tokens_in, offsets_in,
                    output_tokens, num_accepted, invalid);
  check_tree_metadata_args(parents_in, offsets_in, 1);
  TORCH_CHECK_VALUE(tokens_in.numel() == parents_in.numel() && logits_in.size(0) == parents_in.numel(),
                    "node_tokens, parents and target_logits rows must be one per node, got ", tokens_in.numel(), ", ",
                    parents_in.numel(), " and ", logits_in.size(0));
  TORCH_CHECK_VALUE(accepted_path.scalar_type() == at::kInt && accepted_path.sizes() == output_tokens.sizes() &&
                        accepted_path.stride(1) == 1,
                    "accepted_path must be int32 shaped like output_tokens with contiguous rows");
  const at::Tensor logits = logits_in.stride(1) == 1 ? logits_in : logits_in.contiguous();
  const at::Tensor tokens = tokens_in.contiguous(), parents = parents_in.contiguous(), offsets = offsets_in.contiguous();
  const int64_t batch = offsets.size(0) - 1, vocab = logits.size(1), nodes = parents.size(0);
  const int32_t* off = offsets.data_ptr<int32_t>();
  const int32_t* par = parents.data_ptr<int32_t>();
  check_trees_host(par, off, batch, nodes, std::max<int64_t>(nodes, 1));  // every read stays inside the buffers
  if (batch == 0) return;
  const int32_t* tok = tokens.data_ptr<int32_t>();
  int32_t* out = output_tokens.data_ptr<int32_t>();
  int32_t* path = accepted_path.data_ptr<int32_t>();
  int32_t* acc = num_accepted.data_ptr<int32_t>();
  bool* inv = invalid.data_ptr<bool>();
  const int64_t width = output_tokens.size(1);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, nodes / batch * vocab));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(), "verify_tree_greedy_cpu", [&] {
    const scalar_t* data = logits.data_ptr<scalar_t>();
    const int64_t row_stride = logits.stride(0);
    at::parallel_for(0, batch, grain, [&](int64_t begin, int64_t end) {
      tree_greedy_requests<scalar_t>(data, row_stride, vocab, tok, par, off, out, path, output_tokens.stride(0),
                                     accepted_path.stride(0), width, acc, inv, begin, end);
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def(
      "verify_chain_greedy_cpu(Tensor target_logits, Tensor draft_tokens, Tensor draft_offsets, "
      "Tensor(a!) output_tokens, Tensor(b!) num_accepted, Tensor(c!) invalid) -> ()");
  m.def(
      "verify_tree_greedy_cpu(Tensor target_logits, Tensor node_tokens, Tensor parents, Tensor node_offsets, "
      "Tensor(a!) output_tokens, Tensor(b!) num_accepted, Tensor(c!) accepted_path, Tensor(d!) invalid) -> ()");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("verify_chain_greedy_cpu", &verify_chain_greedy_cpu);
  m.impl("verify_tree_greedy_cpu", &verify_tree_greedy_cpu);
}

}  // namespace specdec
