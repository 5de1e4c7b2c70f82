// A small LLaMA-style draft's forwards on the CPU without leaving C++ (specdec/model/draft_forward_cpu.py is the
// Python side): a greedy chain's K forwards with their argmax feedback in one call, one forward of causal rows or of
// a token tree's newest level, and the same forward for an EAGLE head, whose rows enter as feature rows, not tokens.
//
// Why: a 1-layer draft's forward is a few small GEMMs and ~40 tiny ops; from Python each op costs more to
// dispatch than to compute, and the step around each forward (positions, the attention plan, the cache's
// bookkeeping, the argmax) costs as much again. Here the GEMMs are ATen calls (the same as F.linear), or the
// skinny-GEMM kernel where the caller packed a weight for it (the model's own policy, cpu_linear.py), and the
// rest -- RMSNorm, RoPE, the K/V write, attention over the cache, SwiGLU, the argmax feedback -- are
// plain loops over rows, in float arithmetic, rounded to the model dtype where the PyTorch path rounds.
// The results equal the PyTorch forward's up to float rounding, not bit for bit: drafts only propose, the
// target's verification decides, so the output of speculative decoding is the same either way.
//
// Shared arguments:
//   slots         [R]    int64   cache slot of each running request
//   embed         [V, H]; layer_weights: per layer input_norm [H], qkv [(Hq + 2 Hkv) D, H], o [H, Hq D],
//                 post_norm [H], gate_up [2 I, H], down [H, I]; layer_biases: per layer qkv, o, gate_up, down
//                 (None where the model has none); final_norm [H]; lm_head [V, H]
//   packs, pack_rows  the skinny-GEMM kernel's packed weights (skinny_linear.h) of a float32 model's linear layers and
//                 the row counts [lo, hi] each is used at (struct Packs); empty: ATen's GEMMs throughout
//   rotary_table  [P, 2, 1, D]  cos and sin (sign folded in, specdec.kernels.rotary.rotary_table), P > every
//                 position rotated
//   cache         contiguous [L, 2, B, max_len, Hkv, D] or paged [L, 2, num_blocks, block_size, Hkv, D] with
//                 block_tables [B, max_blocks] int32; seq_lens [B] int32 (read, not changed: the caller commits the
//                 rows written, KVCache.advance)
//
// draft_chain_greedy_cpu(first_tokens [R, n] int64, slots, num_drafts K >= 1, ..., drafts [R, K] int64 out,
//                        logits [K, R, V] out): forward 0 feeds the n first tokens (a chain step: the last committed
//   token and the root) at positions seq_lens[slot] .. + n - 1, forward j > 0 draft j at + n - 1 + j, each draft the
//   argmax of the logits before it: n + K - 1 cache rows per request.
// draft_forward_cpu(tokens [R, n] int64, slots, positions?, tree_mask?, tree_start?, kept, ..., logits out): one
//   forward writing its rows at seq_lens[slot] .. + n - 1; causal rows when tree_mask is None (rotated by their cache
//   position unless positions [R, n] int64 is given); with tree_mask [R * n, words] int64 and tree_start [B] int32
//   the rows are a token tree's newest level: each sees every position before tree_start and, after it, the ones
//   its mask row marks (bit k: tree_start + k), rotated by positions. logits [R * kept, V]: the last `kept` rows of
//   each request.
// head_forward_cpu(residual [R * n, H] in/out, first_input? [R * n, Din], first_norm, slots, positions [R, n] int64,
//   tree_mask?, tree_start?, kept, layer_weights, layer_biases, final_norm?, lm_head, ..., logits out): the same
//   forward for an EAGLE head: its rows enter as the residual stream (the head's fc output), updated in place to the
//   stream after the last layer (the predicted features). Layer 0's q/k/v read first_input where given (EAGLE-3's
//   [embedding, feature] rows), else the residual, normalised by layer 0's input norm if first_norm (else its
//   layer_weights entry is not read). The kept rows pass the final norm where given, then the LM head.
// head_chain_greedy_cpu(features [R, H], logits [R, Vd], slots, num_drafts K >= 1, embed, fc_weight?, fc_bias?,
//   input_norm?, hidden_norm?, norm_before_residual, draft_to_target?, layer_weights, ..., drafts [R, K] int64 out):
//   an EAGLE head's greedy chain in one call, as a draft model's. Draft 0 is the argmax of `logits` (the root's, from
//   the catch-up that predicted `features`); draft j > 0 the argmax after a forward of one row per request -- draft
//   j - 1 with the feature predicted for it -- written and rotated at seq_lens[slot] + j - 1: K - 1 cache rows.
//   Draft ids map to target ids through draft_to_target [Vd] where given (EAGLE-3's reduced vocabulary); the
//   target ids are drafted and fed back. A row enters as fc([embed(token), feature]) (EAGLE-1/2: fc_weight), or
//   (EAGLE-3: input_norm and hidden_norm) as the normalised feature (norm_before_residual) or the feature itself,
//   with layer 0 reading [input_norm(embed(token)), hidden_norm(feature)].

#include "skinny_linear.h"

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace specdec {
namespace {

constexpr int64_t kWeightsPerLayer = 6;  // input_norm, qkv, o, post_norm, gate_up, down
constexpr int64_t kBiasesPerLayer = 4;   // qkv, o, gate_up, down
constexpr int64_t kLinearsPerLayer = 4;  // qkv, o, gate_up, down: the packs' order, the LM head's last

// The skinny-GEMM packs of float32 linear layers (skinny_linear.h), per layer qkv, o, gate_up, down, then the LM
// head, each used at the row counts [lo, hi] where the caller measured the kernel faster than ATen's GEMM; none
// given (an empty list, or None for a layer): ATen's.
struct Packs {
  std::vector<c10::optional<at::Tensor>> packed;
  std::vector<int64_t> rows;  // lo, hi per pack

  const at::Tensor* at_rows(int64_t index, int64_t m) const {
    if (packed.empty() || !packed[index].has_value()) return nullptr;
    return m >= rows[2 * index] && m <= rows[2 * index + 1] ? &*packed[index] : nullptr;
  }
};

// x . w^T (+ b) as a new contiguous [rows, out] tensor: linear `index`'s pack where it applies, else ATen.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& b, const Packs& packs,
                  int64_t index) {
  const at::Tensor* pack = packs.at_rows(index, x.size(0));
  if (pack == nullptr) return at::linear(x, w, b).contiguous();
  at::Tensor out = at::empty({x.size(0), w.size(0)}, x.options());
  skinny_linear_into(x, *pack, b, out);
  return out;
}

// logits [rows, vocab] = x . lm_head^T, in place.
void lm_head_into(at::Tensor& logits, const at::Tensor& x, const at::Tensor& lm_head, const Packs& packs,
                  int64_t layers) {
  const at::Tensor* pack = packs.at_rows(layers * kLinearsPerLayer, x.size(0));
  if (pack == nullptr) {
    at::mm_out(logits, x, lm_head.t());
  } else {
    skinny_linear_into(x, *pack, c10::nullopt, logits);
  }
}

// Where the cache rows of one request live: row index of position p in the [rows, Hkv, D] view of a layer's K
// (or V) plane.
struct CacheRows {
  int64_t max_len = 0;           // contiguous
  int64_t block_size = 0;        // paged
  const int32_t* table = nullptr;
  int64_t table_stride = 0;

  int64_t row(int64_t slot, int64_t pos) const {
    if (table == nullptr) return slot * max_len + pos;
    return int64_t{table[slot * table_stride + pos / block_size]} * block_size + pos % block_size;
  }
};

// Where one forward's rows go and what they see. Row t = r * n + i (request r, i-th row) is written at cache position
// write_start[r] + i and rotated by position[t]. Causal rows see positions 0 .. write_start[r] + i; the newest level
// of token trees (tree_mask set) sees every position before tree_start[r] and, from there on, the positions whose
// bit is set in its mask row ([T, words] int64: bit k stands for tree_start + k, as the attention op reads it).
struct Rows {
  int64_t n = 0;
  std::vector<int64_t> write_start, position;
  const int64_t* tree_mask = nullptr;
  int64_t words = 0;
  std::vector<int64_t> tree_start;

  int64_t context(int64_t t) const {  // cache positions row t may read: 0 .. context - 1
    const int64_t r = t / n;
    return tree_mask == nullptr ? write_start[r] + t % n + 1 : write_start[r] + n;
  }
  bool sees(int64_t t, int64_t j) const {
    if (tree_mask == nullptr || j < tree_start[t / n]) return true;
    const int64_t bit = j - tree_start[t / n];
    return bit < words * 64 && ((tree_mask[t * words + bit / 64] >> (bit % 64)) & 1);
  }
};

struct Geometry {
  int64_t hidden, heads, kv_heads, head_dim, inter, vocab, layers;
  int64_t plane;  // elements of one layer's K (or V) plane
};

// out[t] = weight * rms_norm(x[t]) for rows `rows` of x [T, H] (normalised in float, rounded like the PyTorch path).
template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const scalar_t* weight, scalar_t* out, int64_t rows, int64_t hidden, double eps,
                   const int64_t* row_ids = nullptr) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t t = row_ids == nullptr ? i : row_ids[i];
    const scalar_t* h = x + t * hidden;
    acc_t sum = 0;
    for (int64_t c = 0; c < hidden; ++c) sum += static_cast<acc_t>(h[c]) * static_cast<acc_t>(h[c]);
    const acc_t inv = acc_t(1) / std::sqrt(sum / static_cast<acc_t>(hidden) + static_cast<acc_t>(eps));
    scalar_t* o = out + i * hidden;
    for (int64_t c = 0; c < hidden; ++c) {
      const scalar_t normed = static_cast<scalar_t>(static_cast<acc_t>(h[c]) * inv);
      o[c] = static_cast<scalar_t>(static_cast<acc_t>(weight[c]) * static_cast<acc_t>(normed));
    }
  }
}

// residual += x, then out = weight * rms_norm(residual), row by row.
template <typename scalar_t>
void add_rms_norm_rows(const scalar_t* x, scalar_t* residual, const scalar_t* weight, scalar_t* out, int64_t rows,
                       int64_t hidden, double eps) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t t = 0; t < rows * hidden; ++t)
    residual[t] = static_cast<scalar_t>(static_cast<acc_t>(residual[t]) + static_cast<acc_t>(x[t]));
  rms_norm_rows(residual, weight, out, rows, hidden, eps);
}

// x [D] rotated in place by the table row of its position: x * cos + roll(x, D / 2) * sin.
template <typename scalar_t>
void rotate_head(scalar_t* x, const scalar_t* cos, const scalar_t* sin, int64_t dim, float* scratch) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < dim; ++i) scratch[i] = static_cast<float>(x[i]);
  for (int64_t i = 0; i < dim; ++i) {
    const acc_t rolled = static_cast<acc_t>(static_cast<scalar_t>(scratch[(i + half) % dim]));
    const scalar_t a = static_cast<scalar_t>(rolled * static_cast<acc_t>(sin[i]));
    const scalar_t b = static_cast<scalar_t>(static_cast<acc_t>(static_cast<scalar_t>(scratch[i])) *
                                             static_cast<acc_t>(cos[i]));
    x[i] = static_cast<scalar_t>(static_cast<acc_t>(a) + static_cast<acc_t>(b));
  }
}

// The stream's input to one forward: the residual rows [T, H] (updated in place through every layer) and what
// layer 0's q/k/v read. A draft model's rows are its token embeddings, normalised by layer 0's input norm; an
// EAGLE head's rows come from its fc, read as they are (EAGLE-1) or beside the normalised embedding (EAGLE-3's
// [T, 2 H] first_input).
struct Stream {
  at::Tensor residual;
  const at::Tensor* first_input = nullptr;  // [T, Din]: layer 0's attention input, in place of the normalised rows
  bool first_norm = true;                   // without first_input: layer 0 normalises the residual (else reads it)
  const at::Tensor* final_norm = nullptr;   // the kept rows' norm; none: they leave as the residual stream
};

// One forward of `rows_in.n` rows per request (Rows) through every layer; returns the last `kept` rows of each
// request ([R * kept, H]) after the final norm, or as the residual stream without one.
template <typename scalar_t>
at::Tensor forward_rows(Stream& in, const Rows& rows_in, int64_t kept, const std::vector<int64_t>& slots,
                        const std::vector<at::Tensor>& weights, const std::vector<c10::optional<at::Tensor>>& biases,
                        const Packs& packs, const at::Tensor& rotary, scalar_t* cache, const CacheRows& rows,
                        const Geometry& g, double eps, double scale) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t n = rows_in.n, R = static_cast<int64_t>(slots.size()), T = R * n, H = g.hidden, D = g.head_dim;
  const int64_t Hq = g.heads, Hkv = g.kv_heads, group = Hq / Hkv, width = (Hq + 2 * Hkv) * D;
  at::Tensor& residual = in.residual;
  at::Tensor normed = at::empty_like(residual);
  at::Tensor attn = at::empty({T, Hq * D}, residual.options());
  at::Tensor act = at::empty({T, g.inter}, residual.options());
  scalar_t* res = residual.data_ptr<scalar_t>();
  scalar_t* nrm = normed.data_ptr<scalar_t>();
  const scalar_t* table = rotary.data_ptr<scalar_t>();  // [P, 2, D]
  if (in.first_input == nullptr && in.first_norm) rms_norm_rows(res, weights[0].data_ptr<scalar_t>(), nrm, T, H, eps);
  const at::Tensor& first_input = in.first_input != nullptr ? *in.first_input : in.first_norm ? normed : residual;
  int64_t max_context = 0;
  for (int64_t t = 0; t < T; ++t) max_context = std::max(max_context, rows_in.context(t));
  for (int64_t l = 0; l < g.layers; ++l) {
    const at::Tensor* w = weights.data() + l * kWeightsPerLayer;
    const c10::optional<at::Tensor>* b = biases.data() + l * kBiasesPerLayer;
    const int64_t li = l * kLinearsPerLayer;
    at::Tensor qkv = linear(l == 0 ? first_input : normed, w[1], b[0], packs, li);  // [T, (Hq + 2 Hkv) D]
    scalar_t* qkv_p = qkv.data_ptr<scalar_t>();
    scalar_t* k_plane = cache + (l * 2) * g.plane;
    scalar_t* v_plane = k_plane + g.plane;
    // RoPE on q and k, then the K/V write: all rows of the layer are in the cache before any attends.
    std::vector<float> scratch(D);
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = r * n + i;
        const scalar_t* cos = table + rows_in.position[t] * 2 * D;
        scalar_t* row = qkv_p + t * width;
        for (int64_t h = 0; h < Hq + Hkv; ++h) rotate_head(row + h * D, cos, cos + D, D, scratch.data());
        const int64_t cache_row = rows.row(slots[r], rows_in.write_start[r] + i);
        std::copy(row + Hq * D, row + (Hq + Hkv) * D, k_plane + cache_row * Hkv * D);
        std::copy(row + (Hq + Hkv) * D, row + width, v_plane + cache_row * Hkv * D);
      }
    }
    // Attention over the positions each row sees (Rows); softmax in float.
    scalar_t* attn_p = attn.data_ptr<scalar_t>();
    at::parallel_for(0, T * Hq, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> p(max_context), o(D);
      for (int64_t job = begin; job < end; ++job) {
        const int64_t t = job / Hq, h = job % Hq, r = t / n, kv = h / group;
        const int64_t context = rows_in.context(t);
        const scalar_t* q = qkv_p + t * width + h * D;
        constexpr acc_t hidden = -std::numeric_limits<acc_t>::infinity();
        acc_t top = hidden;
        for (int64_t j = 0; j < context; ++j) {
          if (!rows_in.sees(t, j)) {
            p[j] = hidden;
            continue;
          }
          const scalar_t* k = k_plane + rows.row(slots[r], j) * Hkv * D + kv * D;
          acc_t dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += static_cast<acc_t>(q[d]) * static_cast<acc_t>(k[d]);
          p[j] = dot * static_cast<acc_t>(scale);
          top = std::max(top, p[j]);
        }
        acc_t total = 0;
        std::fill(o.begin(), o.end(), acc_t(0));
        for (int64_t j = 0; j < context; ++j) {
          if (p[j] == hidden) continue;
          const acc_t e = std::exp(p[j] - top);
          total += e;
          const scalar_t* v = v_plane + rows.row(slots[r], j) * Hkv * D + kv * D;
          for (int64_t d = 0; d < D; ++d) o[d] += e * static_cast<acc_t>(v[d]);
        }
        scalar_t* out = attn_p + t * Hq * D + h * D;  // a row that sees nothing gets 0, as the attention op's
        for (int64_t d = 0; d < D; ++d) out[d] = static_cast<scalar_t>(total > 0 ? o[d] / total : acc_t(0));
      }
    });
    at::Tensor o = linear(attn, w[2], b[1], packs, li + 1);
    add_rms_norm_rows(o.data_ptr<scalar_t>(), res, w[3].data_ptr<scalar_t>(), nrm, T, H, eps);
    at::Tensor gate_up = linear(normed, w[4], b[2], packs, li + 2);  // [T, 2 I]: gate | up
    const scalar_t* gu = gate_up.data_ptr<scalar_t>();
    scalar_t* a = act.data_ptr<scalar_t>();
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t c = 0; c < g.inter; ++c) {
        const acc_t x = static_cast<acc_t>(gu[t * 2 * g.inter + c]);
        const scalar_t silu = static_cast<scalar_t>(x / (acc_t(1) + std::exp(-x)));
        a[t * g.inter + c] = static_cast<scalar_t>(static_cast<acc_t>(silu) *
                                                   static_cast<acc_t>(gu[t * 2 * g.inter + g.inter + c]));
      }
    }
    at::Tensor down = linear(act, w[5], b[3], packs, li + 3);
    if (l + 1 < g.layers) {  // the next layer's input norm
      add_rms_norm_rows(down.data_ptr<scalar_t>(), res, weights[(l + 1) * kWeightsPerLayer].data_ptr<scalar_t>(), nrm,
                        T, H, eps);
    } else {  // only the kept rows go on to the LM head
      const scalar_t* d = down.data_ptr<scalar_t>();
      for (int64_t t = 0; t < T * H; ++t)
        res[t] = static_cast<scalar_t>(static_cast<acc_t>(res[t]) + static_cast<acc_t>(d[t]));
    }
  }
  at::Tensor last = at::empty({R * kept, H}, residual.options());
  std::vector<int64_t> kept_rows;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = n - kept; i < n; ++i) kept_rows.push_back(r * n + i);
  if (in.final_norm != nullptr) {
    rms_norm_rows(res, in.final_norm->data_ptr<scalar_t>(), last.data_ptr<scalar_t>(), R * kept, H, eps,
                  kept_rows.data());
  } else {
    scalar_t* out = last.data_ptr<scalar_t>();
    for (int64_t i = 0; i < R * kept; ++i) std::copy(res + kept_rows[i] * H, res + (kept_rows[i] + 1) * H, out + i * H);
  }
  return last;
}

// The layers' weights against the stream's geometry: `like` gives the dtype and the hidden size, `first_width` the
// width of what layer 0's q/k/v read (the hidden size, or EAGLE-3's 2 H), `first_norm` whether layer 0's input norm
// is read (else its entry may be any tensor, e.g. empty: EAGLE's layer 0 has none).
void check_model(const at::Tensor& like, int64_t first_width, bool first_norm, const std::vector<at::Tensor>& weights,
                 const std::vector<c10::optional<at::Tensor>>& biases, const at::Tensor* final_norm,
                 const at::Tensor& lm_head, const at::Tensor& rotary, const at::Tensor& cache, int64_t heads,
                 Geometry& g) {
  const auto dtype = like.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                   "the model must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK_VALUE(!weights.empty() && weights.size() % kWeightsPerLayer == 0,
                    "layer_weights must hold 6 tensors per layer, got ", weights.size());
  g.layers = static_cast<int64_t>(weights.size()) / kWeightsPerLayer;
  TORCH_CHECK_VALUE(static_cast<int64_t>(biases.size()) == g.layers * kBiasesPerLayer,
                    "layer_biases must hold 4 entries per layer, got ", biases.size());
  TORCH_CHECK_VALUE(cache.dim() == 6 && cache.is_contiguous() && cache.size(0) == g.layers && cache.size(1) == 2,
                    "cache must be a contiguous [L, 2, ., ., Hkv, D] tensor of the model's layers");
  g.hidden = like.size(1);
  g.kv_heads = cache.size(4);
  g.head_dim = cache.size(5);
  g.heads = heads;
  g.plane = cache.size(2) * cache.size(3) * g.kv_heads * g.head_dim;
  TORCH_CHECK_VALUE(heads > 0 && heads % g.kv_heads == 0 && g.head_dim % 2 == 0,
                    "num_heads must be a positive multiple of the cache's KV heads, and head_dim even");
  g.inter = weights[5].size(1);
  const int64_t H = g.hidden, D = g.head_dim, width = (heads + 2 * g.kv_heads) * D;
  for (int64_t l = 0; l < g.layers; ++l) {
    const at::Tensor* w = weights.data() + l * kWeightsPerLayer;
    const std::vector<std::vector<int64_t>> shapes = {{H}, {width, l == 0 ? first_width : H}, {H, heads * D}, {H},
                                                      {2 * g.inter, H}, {H, g.inter}};
    for (int64_t i = l == 0 && !first_norm ? 1 : 0; i < kWeightsPerLayer; ++i) {
      TORCH_CHECK_VALUE(w[i].sizes() == at::IntArrayRef(shapes[i]) && w[i].scalar_type() == dtype &&
                            w[i].is_cpu() && w[i].is_contiguous(),
                        "layer_weights[", l * kWeightsPerLayer + i, "] must be a contiguous CPU ", dtype, " tensor of ",
                        at::IntArrayRef(shapes[i]), ", got ", w[i].sizes(), " ", w[i].scalar_type());
    }
  }
  TORCH_CHECK_VALUE(final_norm == nullptr ||
                        (final_norm->sizes() == at::IntArrayRef({H}) && final_norm->scalar_type() == dtype),
                    "final_norm must be a [hidden] tensor of the model dtype");
  TORCH_CHECK_VALUE(lm_head.dim() == 2 && lm_head.size(1) == H && lm_head.scalar_type() == dtype,
                    "lm_head must be a [vocab, hidden] tensor of the model dtype");
  g.vocab = lm_head.size(0);
  TORCH_CHECK_VALUE(cache.scalar_type() == dtype && cache.is_cpu(), "cache must be a CPU tensor of the model dtype");
  TORCH_CHECK_VALUE(rotary.dim() == 4 && rotary.size(1) == 2 && rotary.size(3) == D && rotary.is_contiguous() &&
                        rotary.scalar_type() == dtype,
                    "rotary_table must be a contiguous [P, 2, 1, head_dim] tensor of the model dtype");
}

// What both ops check and prepare: the model, the cache's rows, the running requests' slots and their lengths.
struct Call {
  std::vector<at::Tensor> weights;
  std::vector<c10::optional<at::Tensor>> biases;
  Geometry g{};
  CacheRows rows;
  at::Tensor seq_lens, block_tables;
  std::vector<int64_t> slots, start;  // per running request: its slot, seq_lens[slot]
  Packs packs;
};

// packs: empty, or one per linear layer (Packs' order) and the LM head, each None or weight's skinny_linear_pack;
// pack_rows: [lo, hi] per pack.
Packs check_packs(const c10::List<c10::optional<at::Tensor>>& packs_in, at::IntArrayRef pack_rows,
                  const std::vector<at::Tensor>& weights, const at::Tensor& lm_head, const Geometry& g) {
  Packs packs;
  for (const c10::optional<at::Tensor> p : packs_in) packs.packed.push_back(p);
  packs.rows.assign(pack_rows.begin(), pack_rows.end());
  const int64_t count = static_cast<int64_t>(packs.packed.size());
  TORCH_CHECK_VALUE(count == 0 || count == g.layers * kLinearsPerLayer + 1, "packs must be empty or hold ",
                    g.layers * kLinearsPerLayer + 1, " entries (", kLinearsPerLayer,
                    " per layer and the LM head), got ", count);
  TORCH_CHECK_VALUE(static_cast<int64_t>(packs.rows.size()) == 2 * count, "pack_rows must hold [lo, hi] per pack: ",
                    2 * count, " values, got ", packs.rows.size());
  for (int64_t i = 0; i < count; ++i) {
    if (!packs.packed[i].has_value()) continue;
    const int64_t layer = i / kLinearsPerLayer;
    static constexpr int64_t kWeightOf[kLinearsPerLayer] = {1, 2, 4, 5};  // qkv, o, gate_up, down among its weights
    const at::Tensor& w =
        layer < g.layers ? weights[layer * kWeightsPerLayer + kWeightOf[i % kLinearsPerLayer]] : lm_head;
    const at::Tensor& p = *packs.packed[i];
    const bool bf16 = p.scalar_type() == at::kBFloat16;  // a bfloat16 pack holds input features in pairs of 16
    TORCH_CHECK_VALUE(w.scalar_type() == at::kFloat && (bf16 || p.scalar_type() == at::kFloat) && p.is_cpu() &&
                          p.dim() == 3 && p.size(0) == (w.size(0) + 7) / 8 &&
                          p.size(1) == (bf16 ? (w.size(1) + 1) / 2 : w.size(1)) && p.size(2) == (bf16 ? 16 : 8) &&
                          p.is_contiguous(),
                      "packs[", i, "] must be skinny_linear_pack of a float32 model's weight [", w.size(0), ", ",
                      w.size(1), "], got shape ", p.sizes(), " of ", p.scalar_type());
  }
  return packs;
}

// `rows` [R, n] int64 (named `rows_name` in errors: the tokens fed, or the positions of a head's rows) gives the
// forward's shape; `written` cache rows per request from seq_lens[slot] on.
Call prepare(const at::Tensor& rows, const char* rows_name, const at::Tensor& slots_in, int64_t written,
             const at::Tensor& like, int64_t first_width, bool first_norm, at::TensorList layer_weights,
             const c10::List<c10::optional<at::Tensor>>& layer_biases, const at::Tensor* final_norm,
             const at::Tensor& lm_head, const c10::List<c10::optional<at::Tensor>>& packs, at::IntArrayRef pack_rows,
             const at::Tensor& rotary_table, const at::Tensor& cache, const at::Tensor& seq_lens_in,
             const c10::optional<at::Tensor>& block_tables_in, int64_t num_heads) {
  Call c;
  c.weights.assign(layer_weights.begin(), layer_weights.end());
  for (const c10::optional<at::Tensor> b : layer_biases) c.biases.push_back(b);
  check_model(like, first_width, first_norm, c.weights, c.biases, final_norm, lm_head, rotary_table, cache, num_heads,
              c.g);
  c.packs = check_packs(packs, pack_rows, c.weights, lm_head, c.g);
  TORCH_CHECK_TYPE(rows.scalar_type() == at::kLong && slots_in.scalar_type() == at::kLong, rows_name,
                   " and slots must be int64");
  TORCH_CHECK_VALUE(rows.dim() == 2 && rows.size(1) >= 1 && slots_in.dim() == 1 && slots_in.size(0) == rows.size(0),
                    rows_name, " must be [R, n >= 1] and slots [R], got ", rows.sizes(), " and ", slots_in.sizes());
  TORCH_CHECK_TYPE(seq_lens_in.scalar_type() == at::kInt, "seq_lens must be int32");
  c.seq_lens = seq_lens_in.contiguous();
  const int64_t batch = c.seq_lens.size(0), R = rows.size(0);
  if (block_tables_in.has_value()) {
    c.block_tables = block_tables_in->contiguous();
    TORCH_CHECK_VALUE(c.block_tables.scalar_type() == at::kInt && c.block_tables.dim() == 2 &&
                          c.block_tables.size(0) == batch,
                      "block_tables must be int32 [B, max_blocks]");
    c.rows.table = c.block_tables.data_ptr<int32_t>();
    c.rows.table_stride = c.block_tables.size(1);
    c.rows.block_size = cache.size(3);
  } else {
    TORCH_CHECK_VALUE(cache.size(2) == batch, "a contiguous cache holds seq_lens' ", batch, " requests, got ",
                      cache.size(2));
    c.rows.max_len = cache.size(3);
  }
  const int64_t capacity = c.rows.table != nullptr ? c.rows.table_stride * c.rows.block_size : c.rows.max_len;
  const at::Tensor slots_t = slots_in.contiguous();
  const int64_t* slot_p = slots_t.data_ptr<int64_t>();
  const int32_t* lens = c.seq_lens.data_ptr<int32_t>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t slot = slot_p[r];
    TORCH_CHECK_VALUE(slot >= 0 && slot < batch, "slots[", r, "] = ", slot, " is not a request slot");
    TORCH_CHECK_VALUE(std::find(c.slots.begin(), c.slots.end(), slot) == c.slots.end(), "slots[", r, "] = ", slot,
                      " appears twice: each running request has one slot");
    const int64_t first = lens[slot], last = first + written - 1;  // the positions written
    TORCH_CHECK_VALUE(first >= 0 && last < capacity, "request ", slot, " would write position ", last,
                      " past the cache's capacity of ", capacity);
    if (c.rows.table != nullptr) {  // every block read or written is one of the pool's (KVCache.reserve)
      for (int64_t blk = 0; blk <= last / c.rows.block_size; ++blk) {
        const int32_t id = c.rows.table[slot * c.rows.table_stride + blk];
        TORCH_CHECK_VALUE(id >= 0 && id < cache.size(2), "block_tables[", slot, ", ", blk, "] = ", id,
                          " is not a block of the pool; reserve the step's rows first");
      }
    }
    c.slots.push_back(slot);
    c.start.push_back(first);
  }
  return c;
}

// Causal rows: n per request, written from `first[r]` on, rotated by their own positions.
Rows causal_rows(int64_t n, const std::vector<int64_t>& first) {
  Rows rows;
  rows.n = n;
  rows.write_start = first;
  for (const int64_t f : first)
    for (int64_t i = 0; i < n; ++i) rows.position.push_back(f + i);
  return rows;
}

void check_positions(const Rows& rows, const at::Tensor& rotary_table) {
  for (const int64_t pos : rows.position)
    TORCH_CHECK_VALUE(pos >= 0 && pos < rotary_table.size(0), "position ", pos,
                      " is outside the rotary table's ", rotary_table.size(0), " positions");
}

// A draft model's stream: its token embeddings, normalised by layer 0's input norm, and its final norm.
void check_embed(const at::Tensor& embed) {
  TORCH_CHECK_VALUE(embed.dim() == 2 && embed.is_contiguous(), "embed must be a contiguous [V, H] tensor");
}

void draft_chain_greedy_cpu(const at::Tensor& first_tokens, const at::Tensor& slots, int64_t num_drafts,
                            const at::Tensor& embed, at::TensorList layer_weights,
                            const c10::List<c10::optional<at::Tensor>>& layer_biases, const at::Tensor& final_norm,
                            const at::Tensor& lm_head, const c10::List<c10::optional<at::Tensor>>& packs,
                            at::IntArrayRef pack_rows, const at::Tensor& rotary_table, at::Tensor& cache,
                            const at::Tensor& seq_lens, const c10::optional<at::Tensor>& block_tables,
                            double eps, double softmax_scale, int64_t num_heads, at::Tensor& drafts,
                            at::Tensor& logits) {
  TORCH_CHECK_VALUE(num_drafts >= 1, "num_drafts must be >= 1, got ", num_drafts);
  check_embed(embed);
  const int64_t first_rows = first_tokens.dim() == 2 ? first_tokens.size(1) : 0;
  Call c = prepare(first_tokens, "first_tokens", slots, first_rows + num_drafts - 1, embed, embed.size(1), true,
                   layer_weights, layer_biases, &final_norm, lm_head, packs, pack_rows, rotary_table, cache, seq_lens,
                   block_tables, num_heads);
  const int64_t R = first_tokens.size(0);
  TORCH_CHECK_VALUE(drafts.scalar_type() == at::kLong && drafts.sizes() == at::IntArrayRef({R, num_drafts}),
                    "drafts must be int64 [R, num_drafts]");
  TORCH_CHECK_VALUE(logits.scalar_type() == embed.scalar_type() &&
                        logits.sizes() == at::IntArrayRef({num_drafts, R, c.g.vocab}) && logits.is_contiguous(),
                    "logits must be a contiguous [num_drafts, R, vocab] tensor of the model dtype");
  std::vector<Rows> forwards;  // forward j: the first rows, then one draft per request
  std::vector<int64_t> first(c.start);
  for (int64_t j = 0; j < num_drafts; ++j) {
    const int64_t n = j == 0 ? first_rows : 1;
    forwards.push_back(causal_rows(n, first));
    check_positions(forwards.back(), rotary_table);
    for (int64_t& f : first) f += n;
  }
  if (R == 0) return;
  at::Tensor feed = first_tokens.contiguous().view({-1});
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, embed.scalar_type(), "draft_chain_greedy_cpu", [&] {
    scalar_t* cache_p = cache.data_ptr<scalar_t>();
    for (int64_t j = 0; j < num_drafts; ++j) {
      Stream in{at::embedding(embed, feed).contiguous()};
      in.final_norm = &final_norm;
      at::Tensor last = forward_rows<scalar_t>(in, forwards[j], 1, c.slots, c.weights, c.biases, c.packs,
                                               rotary_table, cache_p, c.rows, c.g, eps, softmax_scale);
      at::Tensor step_logits = logits.select(0, j);
      lm_head_into(step_logits, last, lm_head, c.packs, c.g.layers);
      at::Tensor next = drafts.select(1, j);
      next.copy_(at::argmax(step_logits, -1));
      feed = next.contiguous();
    }
  });
}

// The rows of one forward of n rows per request: causal from seq_lens[slot] on, rotated by `positions` [R, n] where
// given; with tree_mask [R * n, words] and tree_start [B], the newest level of token trees (struct Rows). `mask`
// keeps the contiguous mask the rows point into.
Rows forward_layout(const Call& c, int64_t n, const c10::optional<at::Tensor>& positions,
                    const c10::optional<at::Tensor>& tree_mask, const c10::optional<at::Tensor>& tree_start,
                    const at::Tensor& rotary_table, at::Tensor& mask) {
  const int64_t T = static_cast<int64_t>(c.slots.size()) * n;
  Rows rows = causal_rows(n, c.start);
  if (positions.has_value()) {
    TORCH_CHECK_VALUE(positions->scalar_type() == at::kLong && positions->numel() == T,
                      "positions must be int64 [R, n] (", T, " entries), got ", positions->sizes());
    const at::Tensor pos = positions->contiguous();
    rows.position.assign(pos.data_ptr<int64_t>(), pos.data_ptr<int64_t>() + T);
  }
  TORCH_CHECK_VALUE(tree_mask.has_value() == tree_start.has_value() && (!tree_mask.has_value() || positions.has_value()),
                    "tree_mask and tree_start come together, with positions");
  if (tree_mask.has_value()) {
    TORCH_CHECK_VALUE(tree_mask->scalar_type() == at::kLong && tree_mask->dim() == 2 && tree_mask->size(0) == T,
                      "tree_mask must be int64 [R * n, words]");
    TORCH_CHECK_VALUE(tree_start->scalar_type() == at::kInt && tree_start->sizes() == c.seq_lens.sizes(),
                      "tree_start must be int32 [B]");
    mask = tree_mask->contiguous();
    rows.tree_mask = mask.data_ptr<int64_t>();
    rows.words = mask.size(1);
    const at::Tensor starts = tree_start->contiguous();
    for (const int64_t slot : c.slots) rows.tree_start.push_back(starts.data_ptr<int32_t>()[slot]);
  }
  check_positions(rows, rotary_table);
  return rows;
}

void check_logits(const at::Tensor& logits, const at::Tensor& like, int64_t rows, int64_t vocab) {
  TORCH_CHECK_VALUE(logits.scalar_type() == like.scalar_type() && logits.sizes() == at::IntArrayRef({rows, vocab}) &&
                        logits.is_contiguous(),
                    "logits must be a contiguous [R * kept, vocab] tensor of the model dtype");
}

void draft_forward_cpu(const at::Tensor& tokens, const at::Tensor& slots, const c10::optional<at::Tensor>& positions,
                       const c10::optional<at::Tensor>& tree_mask, const c10::optional<at::Tensor>& tree_start,
                       int64_t kept, const at::Tensor& embed, at::TensorList layer_weights,
                       const c10::List<c10::optional<at::Tensor>>& layer_biases, const at::Tensor& final_norm,
                       const at::Tensor& lm_head, const c10::List<c10::optional<at::Tensor>>& packs,
                       at::IntArrayRef pack_rows, const at::Tensor& rotary_table, at::Tensor& cache,
                       const at::Tensor& seq_lens, const c10::optional<at::Tensor>& block_tables, double eps,
                       double softmax_scale, int64_t num_heads, at::Tensor& logits) {
  check_embed(embed);
  const int64_t n = tokens.dim() == 2 ? tokens.size(1) : 0;
  Call c = prepare(tokens, "tokens", slots, n, embed, embed.size(1), true, layer_weights, layer_biases, &final_norm,
                   lm_head, packs, pack_rows, rotary_table, cache, seq_lens, block_tables, num_heads);
  const int64_t R = tokens.size(0), T = R * n;
  TORCH_CHECK_VALUE(kept >= 1 && kept <= n, "kept must be in [1, ", n, "], got ", kept);
  check_logits(logits, embed, R * kept, c.g.vocab);
  at::Tensor mask;
  const Rows rows = forward_layout(c, n, positions, tree_mask, tree_start, rotary_table, mask);
  if (T == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, embed.scalar_type(), "draft_forward_cpu", [&] {
    Stream in{at::embedding(embed, tokens.contiguous().view({-1})).contiguous()};
    in.final_norm = &final_norm;
    at::Tensor out = forward_rows<scalar_t>(in, rows, kept, c.slots, c.weights, c.biases, c.packs, rotary_table,
                                            cache.data_ptr<scalar_t>(), c.rows, c.g, eps, softmax_scale);
    lm_head_into(logits, out, lm_head, c.packs, c.g.layers);
  });
}

void head_forward_cpu(at::Tensor& residual, const c10::optional<at::Tensor>& first_input, bool first_norm,
                      const at::Tensor& slots, const at::Tensor& positions, const c10::optional<at::Tensor>& tree_mask,
                      const c10::optional<at::Tensor>& tree_start, int64_t kept, at::TensorList layer_weights,
                      const c10::List<c10::optional<at::Tensor>>& layer_biases,
                      const c10::optional<at::Tensor>& final_norm, const at::Tensor& lm_head,
                      const c10::List<c10::optional<at::Tensor>>& packs, at::IntArrayRef pack_rows,
                      const at::Tensor& rotary_table, at::Tensor& cache, const at::Tensor& seq_lens,
                      const c10::optional<at::Tensor>& block_tables, double eps, double softmax_scale,
                      int64_t num_heads, at::Tensor& logits) {
  TORCH_CHECK_VALUE(positions.dim() == 2, "positions must be int64 [R, n], got shape ", positions.sizes());
  const int64_t n = positions.size(1), R = positions.size(0), T = R * n;
  TORCH_CHECK_VALUE(residual.dim() == 2 && residual.size(0) == T && residual.is_contiguous() && residual.is_cpu(),
                    "residual must be a contiguous CPU [R * n, hidden] tensor, one row per position; got ",
                    residual.sizes());
  const at::Tensor* first = first_input.has_value() ? &*first_input : nullptr;
  if (first != nullptr) {
    TORCH_CHECK_VALUE(first->dim() == 2 && first->size(0) == T && first->is_contiguous() &&
                          first->scalar_type() == residual.scalar_type(),
                      "first_input must be a contiguous [R * n, width] tensor of the residual's dtype, got ",
                      first->sizes());
  }
  const int64_t first_width = first != nullptr ? first->size(1) : residual.size(1);
  Call c = prepare(positions, "positions", slots, n, residual, first_width, first_norm && first == nullptr,
                   layer_weights, layer_biases, final_norm.has_value() ? &*final_norm : nullptr, lm_head, packs,
                   pack_rows, rotary_table, cache, seq_lens, block_tables, num_heads);
  TORCH_CHECK_VALUE(kept >= 1 && kept <= n, "kept must be in [1, ", n, "], got ", kept);
  check_logits(logits, residual, R * kept, c.g.vocab);
  at::Tensor mask;
  const Rows rows = forward_layout(c, n, positions, tree_mask, tree_start, rotary_table, mask);
  if (T == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, residual.scalar_type(), "head_forward_cpu", [&] {
    Stream in{residual, first, first_norm, final_norm.has_value() ? &*final_norm : nullptr};
    at::Tensor out = forward_rows<scalar_t>(in, rows, kept, c.slots, c.weights, c.biases, c.packs, rotary_table,
                                            cache.data_ptr<scalar_t>(), c.rows, c.g, eps, softmax_scale);
    lm_head_into(logits, out, lm_head, c.packs, c.g.layers);
  });
}

// The row a chain level feeds an EAGLE head: `tokens` [R] (target ids) with the features [R, H] predicted for them.
struct HeadInput {
  const c10::optional<at::Tensor>& fc_weight;  // EAGLE-1/2: [H, 2 H]
  const c10::optional<at::Tensor>& fc_bias;
  const c10::optional<at::Tensor>& input_norm;  // EAGLE-3: [H] each
  const c10::optional<at::Tensor>& hidden_norm;
  bool norm_before_residual;

  template <typename scalar_t>
  void enter(Stream& in, at::Tensor& first_input, const at::Tensor& embed, const at::Tensor& tokens,
             const at::Tensor& feature, double eps) const {
    const at::Tensor embedded = at::embedding(embed, tokens);
    if (fc_weight.has_value()) {  // the head's nn.Linear over [embedding, feature]: F.linear's call
      in.residual = at::linear(at::cat({embedded, feature}, 1), *fc_weight, fc_bias).contiguous();
      in.first_norm = false;
      return;
    }
    const int64_t R = feature.size(0), H = feature.size(1);
    at::Tensor normed = at::empty({2, R, H}, feature.options());  // the embedding's and the feature's norms
    rms_norm_rows(embedded.contiguous().data_ptr<scalar_t>(), input_norm->data_ptr<scalar_t>(),
                  normed.data_ptr<scalar_t>(), R, H, eps);
    rms_norm_rows(feature.data_ptr<scalar_t>(), hidden_norm->data_ptr<scalar_t>(), normed.data_ptr<scalar_t>() + R * H,
                  R, H, eps);
    first_input = at::cat({normed[0], normed[1]}, 1);
    in.residual = norm_before_residual ? normed[1].clone() : feature.clone();
    in.first_input = &first_input;
  }
};

void check_head_input(const HeadInput& head, const at::Tensor& like) {
  const int64_t H = like.size(1);
  const bool eagle3 = head.input_norm.has_value() || head.hidden_norm.has_value();
  TORCH_CHECK_VALUE(head.fc_weight.has_value() != eagle3 && head.input_norm.has_value() == head.hidden_norm.has_value(),
                    "give fc_weight (an EAGLE-1/2 head) or input_norm and hidden_norm (an EAGLE-3 head), not both");
  auto check = [&](const c10::optional<at::Tensor>& t, const char* name, at::IntArrayRef shape) {
    TORCH_CHECK_VALUE(!t.has_value() || (t->sizes() == shape && t->scalar_type() == like.scalar_type() &&
                                         t->is_cpu() && t->is_contiguous()),
                      name, " must be a contiguous CPU ", like.scalar_type(), " tensor of ", shape, ", got ",
                      t.has_value() ? t->sizes() : at::IntArrayRef{});
  };
  check(head.fc_weight, "fc_weight", {H, 2 * H});
  check(head.fc_bias, "fc_bias", {H});
  check(head.input_norm, "input_norm", {H});
  check(head.hidden_norm, "hidden_norm", {H});
  TORCH_CHECK_VALUE(head.fc_weight.has_value() || !head.fc_bias.has_value(), "fc_bias needs fc_weight");
}

void head_chain_greedy_cpu(const at::Tensor& features, const at::Tensor& logits, const at::Tensor& slots,
                           int64_t num_drafts, const at::Tensor& embed, const c10::optional<at::Tensor>& fc_weight,
                           const c10::optional<at::Tensor>& fc_bias, const c10::optional<at::Tensor>& input_norm,
                           const c10::optional<at::Tensor>& hidden_norm, bool norm_before_residual,
                           const c10::optional<at::Tensor>& draft_to_target, at::TensorList layer_weights,
                           const c10::List<c10::optional<at::Tensor>>& layer_biases,
                           const c10::optional<at::Tensor>& final_norm, const at::Tensor& lm_head,
                           const c10::List<c10::optional<at::Tensor>>& packs, at::IntArrayRef pack_rows,
                           const at::Tensor& rotary_table, at::Tensor& cache, const at::Tensor& seq_lens,
                           const c10::optional<at::Tensor>& block_tables, double eps, double softmax_scale,
                           int64_t num_heads, at::Tensor& drafts) {
  TORCH_CHECK_VALUE(num_drafts >= 1, "num_drafts must be >= 1, got ", num_drafts);
  TORCH_CHECK_VALUE(features.dim() == 2 && features.is_cpu() && features.is_contiguous(),
                    "features must be a contiguous CPU [R, hidden] tensor, got ", features.sizes());
  check_embed(embed);
  TORCH_CHECK_VALUE(embed.size(1) == features.size(1) && embed.scalar_type() == features.scalar_type(),
                    "embed must be [vocab, ", features.size(1), "] of the features' dtype, got ", embed.sizes());
  const HeadInput head{fc_weight, fc_bias, input_norm, hidden_norm, norm_before_residual};
  check_head_input(head, features);
  const bool eagle3 = !fc_weight.has_value();
  const int64_t R = features.size(0);
  const at::Tensor shape = at::empty({R, 1}, at::kLong);  // one row per request and forward
  Call c = prepare(shape, "features", slots, num_drafts - 1, features, eagle3 ? 2 * features.size(1) : features.size(1),
                   false, layer_weights, layer_biases, final_norm.has_value() ? &*final_norm : nullptr, lm_head, packs,
                   pack_rows, rotary_table, cache, seq_lens, block_tables, num_heads);
  check_logits(logits, features, R, c.g.vocab);
  if (draft_to_target.has_value()) {
    TORCH_CHECK_VALUE(draft_to_target->scalar_type() == at::kLong && draft_to_target->dim() == 1 &&
                          draft_to_target->size(0) == c.g.vocab && draft_to_target->is_cpu(),
                      "draft_to_target must be an int64 CPU [", c.g.vocab, "] tensor (a target id per draft id), got ",
                      draft_to_target->sizes());
    const at::Tensor d2t = draft_to_target->contiguous();
    const int64_t* ids = d2t.data_ptr<int64_t>();
    const int64_t target_vocab = embed.size(0);
    TORCH_CHECK_VALUE(std::all_of(ids, ids + c.g.vocab, [&](int64_t t) { return t >= 0 && t < target_vocab; }),
                      "draft_to_target holds ids outside embed's ", target_vocab, " tokens");
  }
  TORCH_CHECK_VALUE(drafts.scalar_type() == at::kLong && drafts.sizes() == at::IntArrayRef({R, num_drafts}),
                    "drafts must be int64 [R, num_drafts]");
  std::vector<Rows> forwards;  // forward j feeds draft j (j < K - 1): one row per request
  std::vector<int64_t> first(c.start);
  for (int64_t j = 0; j + 1 < num_drafts; ++j) {
    forwards.push_back(causal_rows(1, first));
    check_positions(forwards.back(), rotary_table);
    for (int64_t& f : first) f += 1;
  }
  if (R == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, features.scalar_type(), "head_chain_greedy_cpu", [&] {
    scalar_t* cache_p = cache.data_ptr<scalar_t>();
    at::Tensor feature = features, step_logits = logits;
    for (int64_t j = 0; j < num_drafts; ++j) {
      at::Tensor ids = at::argmax(step_logits, -1);
      at::Tensor tokens = draft_to_target.has_value() ? draft_to_target->index_select(0, ids) : ids;
      drafts.select(1, j).copy_(tokens);
      if (j + 1 == num_drafts) break;
      Stream in{};
      at::Tensor first_input;
      head.enter<scalar_t>(in, first_input, embed, tokens, feature, eps);
      in.final_norm = final_norm.has_value() ? &*final_norm : nullptr;
      at::Tensor last = forward_rows<scalar_t>(in, forwards[j], 1, c.slots, c.weights, c.biases, c.packs,
                                               rotary_table, cache_p, c.rows, c.g, eps, softmax_scale);
      step_logits = at::empty({R, c.g.vocab}, features.options());
      lm_head_into(step_logits, last, lm_head, c.packs, c.g.layers);
      feature = in.residual;  // the stream after the last layer: the feature predicted for draft j + 1
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def(
      "draft_chain_greedy_cpu(Tensor first_tokens, Tensor slots, int num_drafts, Tensor embed, "
      "Tensor[] layer_weights, Tensor?[] layer_biases, Tensor final_norm, Tensor lm_head, Tensor?[] packs, "
      "int[] pack_rows, Tensor rotary_table, Tensor(a!) cache, Tensor seq_lens, Tensor? block_tables, float eps, "
      "float softmax_scale, int num_heads, Tensor(b!) drafts, Tensor(c!) logits) -> ()");
  m.def(
      "draft_forward_cpu(Tensor tokens, Tensor slots, Tensor? positions, Tensor? tree_mask, Tensor? tree_start, "
      "int kept, Tensor embed, Tensor[] layer_weights, Tensor?[] layer_biases, Tensor final_norm, Tensor lm_head, "
      "Tensor?[] packs, int[] pack_rows, Tensor rotary_table, Tensor(a!) cache, Tensor seq_lens, "
      "Tensor? block_tables, float eps, float softmax_scale, int num_heads, Tensor(b!) logits) -> ()");
  m.def(
      "head_forward_cpu(Tensor(a!) residual, Tensor? first_input, bool first_norm, Tensor slots, Tensor positions, "
      "Tensor? tree_mask, Tensor? tree_start, int kept, Tensor[] layer_weights, Tensor?[] layer_biases, "
      "Tensor? final_norm, Tensor lm_head, Tensor?[] packs, int[] pack_rows, Tensor rotary_table, Tensor(b!) cache, "
      "Tensor seq_lens, Tensor? block_tables, float eps, float softmax_scale, int num_heads, Tensor(c!) logits) -> ()");
  m.def(
      "head_chain_greedy_cpu(Tensor features, Tensor logits, Tensor slots, int num_drafts, Tensor embed, "
      "Tensor? fc_weight, Tensor? fc_bias, Tensor? input_norm, Tensor? hidden_norm, bool norm_before_residual, "
      "Tensor? draft_to_target, Tensor[] layer_weights, Tensor?[] layer_biases, Tensor? final_norm, Tensor lm_head, "
      "Tensor?[] packs, int[] pack_rows, Tensor rotary_table, Tensor(a!) cache, Tensor seq_lens, Tensor? block_tables, "
      "float eps, float softmax_scale, int num_heads, Tensor(b!) drafts) -> ()");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("draft_chain_greedy_cpu", &draft_chain_greedy_cpu);
  m.impl("draft_forward_cpu", &draft_forward_cpu);
  m.impl("head_forward_cpu", &head_forward_cpu);
  m.impl("head_chain_greedy_cpu", &head_chain_greedy_cpu);
}

}  // namespace specdec
