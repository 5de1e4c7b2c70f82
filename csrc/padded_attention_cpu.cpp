// Masked attention over a padded batch on the CPU, float32: the kernel of tree attention's PyTorch path
// (specdec/kernels/tree_attention_torch.py) where its layout is a view (uniform query counts, a finite contiguous
// cache).
//
//   q                 [B n, Hq, D]              row b n + i: query slot i of request b
//   k_cache, v_cache  [rows, max_len, Hkv, D]   request b reads positions 0 .. L-1 of row b (rows >= B, max_len >= L)
//   attn_bias         [B, 1, n, L]              added to the scaled scores; -inf hides a position
//   out               [B n, Hq, D]              softmax(scale q.k + bias) . v; a row that sees nothing gets 0
//
// Only the last dim of each tensor must be contiguous (a layer of a stacked cache, q split from a fused qkv).
// Grouped-query heads: Hq = G Hkv, query head h reads KV head h / G. The bias is added as given (-inf hides; a
// +inf or NaN makes its row NaN, as in SDPA).
//
// Why: torch's CPU flash-attention kernel is built for long blocks of queries; a decode step (n = 1) or a chain's
// verification (n = K + 1) with a few heads of 32 ran it at under 2 GFLOP/s. Here a work item is a request (or a
// chunk of its query slots or KV heads) and all its query rows are processed together: each K and V row is read
// from memory once, then from the L1 cache for every query head of its group and every slot. The positions are
// walked in order with all the item's KV heads at each, so the request's K and V stream through once (prefetched
// ahead: a step's caches are usually cold). Scores of 8 positions come from 8 vector accumulators reduced at once;
// the softmax takes two passes over a row's scores (max, then exp in place, vectorised); positions that every query
// of the request hides (a context shorter than L, a tree's unrelated nodes) are never read. Results equal the exact
// softmax up to float32 rounding (other summation orders than SDPA's): bench/bench_cpu_attention.py measures both.
//
// row_invariant (SPECDEC_ROW_INVARIANT): a work item is one query slot, whose positions list is that slot's own, so
// a row's sums (scores, softmax total, P.V) run over exactly the positions it sees, in order, whatever the other
// slots of its request: the same bits as the row alone in a decode step.
//
// On x86-64 an AVX2 + FMA version is compiled beside the generic one and chosen at run time; elsewhere (or without
// AVX2, or with SPECDEC_ATTENTION_GENERIC=1 set when the process first calls it: how the tests reach it) the
// generic version runs. The 8-wide vector code needs D % 8 == 0; other head dims take scalar loops.

#include "cpu_version.h"

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#pragma GCC diagnostic ignored "-Wpsabi"  // 32-byte vectors by value: only between inlined helpers

namespace {

constexpr int64_t kLanes = 8;
constexpr int64_t kMaxRows = 64;    // query rows (slots x heads) per work item, where a KV head's group fits
constexpr int64_t kPrefetchBytes = 64 << 10;  // K bytes between a row's prefetch and its use (about L2's reach)
constexpr int64_t kValueBlock = 64; // positions per block of the P.V pass (their V rows stay in L1 across rows)

typedef float lanes_t __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t ilanes_t __attribute__((vector_size(kLanes * sizeof(int32_t))));

__attribute__((always_inline)) inline lanes_t load(const float* p) {
  lanes_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

__attribute__((always_inline)) inline void store(float* p, lanes_t v) { std::memcpy(p, &v, sizeof(v)); }

__attribute__((always_inline)) inline lanes_t splat(float x) { return lanes_t{} + x; }

// exp(x) for x <= 0 (scores minus their row's max); 0 below -86 and at -inf, NaN kept. x = n ln2 + r with
// |r| <= ln2 / 2; exp(r) by its Taylor series to r^7 (truncation error < 0.1 ulp there), times 2^n built in the
// exponent bits (n >= -125 keeps the result normal). Measured over [-86, 0] against exp in double: within 0.93 ulp
// with FMA, 1.22 without.
__attribute__((always_inline)) inline lanes_t exp_nonpositive(lanes_t x) {
  const lanes_t shifter = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  const lanes_t xc = x < splat(-86.0f) ? splat(-86.0f) : x;
  const lanes_t t = xc * splat(1.44269504088896341f) + shifter;
  const lanes_t n = t - shifter;
  lanes_t r = xc - n * splat(0.693145751953125f);  // ln2 split in two: its high part times n is exact
  r = r - n * splat(1.42860682030941723212e-6f);
  lanes_t p = splat(1.0f / 5040);
  p = p * r + splat(1.0f / 720);
  p = p * r + splat(1.0f / 120);
  p = p * r + splat(1.0f / 24);
  p = p * r + splat(1.0f / 6);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.0f);
  p = p * r + splat(1.0f);
  ilanes_t bits, tbits, sbits;
  std::memcpy(&bits, &p, sizeof(p));
  std::memcpy(&tbits, &t, sizeof(t));
  std::memcpy(&sbits, &shifter, sizeof(shifter));
  bits += (tbits - sbits) << 23;
  bits &= ~(x < splat(-86.0f));  // zero below -86 and at -inf; a NaN stays NaN
  lanes_t out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Lanes of (a, b) by index (0-7 from a, 8-15 from b); GCC and Clang spell vector shuffles differently.
#if defined(__clang__)
#define SPECDEC_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SPECDEC_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, ilanes_t{__VA_ARGS__})
#endif

// Within each 128-bit half (one instruction each on AVX): lanes 0 + 1, 2 + 3 of a, then of b.
__attribute__((always_inline)) inline lanes_t add_pairs(lanes_t a, lanes_t b) {
  return SPECDEC_SHUFFLE(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + SPECDEC_SHUFFLE(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// The low halves of a and b, and their high halves.
__attribute__((always_inline)) inline lanes_t low_halves(lanes_t a, lanes_t b) {
  return SPECDEC_SHUFFLE(a, b, 0, 1, 2, 3, 8, 9, 10, 11);
}

__attribute__((always_inline)) inline lanes_t high_halves(lanes_t a, lanes_t b) {
  return SPECDEC_SHUFFLE(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
}

// The sums of each of 8 vectors' lanes, as one vector: three rounds of adding lanes paired by shuffles (what
// AVX's horizontal adds do), in portable vector code so both versions compile it for their own instructions.
__attribute__((always_inline)) inline lanes_t sum8(const lanes_t* a) {
  // u0 = [a0 lanes 01, 23, a1 lanes 01, 23 | a0 lanes 45, 67, a1 lanes 45, 67], ...
  const lanes_t u0 = add_pairs(a[0], a[1]), u1 = add_pairs(a[2], a[3]);
  const lanes_t u2 = add_pairs(a[4], a[5]), u3 = add_pairs(a[6], a[7]);
  // w0 = [a0..a3 over lanes 0-3 | a0..a3 over lanes 4-7], w1 the same for a4..a7
  const lanes_t w0 = add_pairs(u0, u1), w1 = add_pairs(u2, u3);
  return low_halves(w0, w1) + high_halves(w0, w1);
}

struct Problem {
  const float* q;
  const float* k;
  const float* v;
  const float* bias;
  float* out;
  int64_t n, L, Hkv, G, D;
  int64_t q_b, q_i, q_h;    // strides (elements)
  int64_t k_b, k_l, k_h;
  int64_t v_b, v_l, v_h;
  int64_t bias_b, bias_i, bias_l;
  int64_t out_b, out_i, out_h;
  float scale;
  uint64_t call;  // distinct per call of the op: a thread's scratch knows which request its positions are of
  bool per_slot;  // row-invariant: one query slot per work item, which lists only the positions that slot sees
};

// Rows of a work item: query slot i and head h of request b at row (h / G - g0) per_head + (i - i0) G + h % G
// (the rows of a KV head together, per_head = (i1 - i0) G of them).
struct Rows {
  int64_t count = 0, per_head = 0;
  std::vector<const float*> q, bias;
  std::vector<float*> out;
  std::vector<float> inv_sum;
};

// Per-thread scratch, kept between calls (no allocation once it has grown to the largest shape).
struct Scratch {
  uint64_t call = 0;
  int64_t request = -1;
  int64_t slot = -1;             // the item's first slot where the list is per slot, else -1
  int64_t count = 0;             // of visible
  int64_t live = 0;              // query slots up to the last that sees a position
  std::vector<int32_t> visible;  // positions some query of the request sees
  std::vector<float> scores;     // [rows, visible]
  Rows rows;
};

// Scores of up to 8 positions of one row: scale . dots + the row's bias at those positions.
__attribute__((always_inline)) inline void put_scores(float* out, lanes_t dots, const float* bias_row,
                                                      const int32_t* vis, int64_t width, bool in_a_row,
                                                      const Problem& P) {
  if (in_a_row) {  // 8 consecutive positions, the bias contiguous along them
    store(out, dots * splat(P.scale) + load(bias_row + vis[0]));
    return;
  }
  float d[kLanes];
  store(d, dots);
  for (int64_t t = 0; t < width; ++t) out[t] = d[t] * P.scale + bias_row[vis[t] * P.bias_l];
}

// Scores of rows [r0, r0 + R) against 8 positions whose K rows (of their KV head) are krow.
__attribute__((always_inline)) inline void score_block(const Rows& rows, int64_t r0, int64_t R,
                                                       const float* const* krow, int64_t D, bool vec, float* scores,
                                                       int64_t V, int64_t j0, const int32_t* vis, int64_t width,
                                                       bool in_a_row, const Problem& P) {
  int64_t r = r0;
  const int64_t r1 = r0 + R;
  if (vec) {
    for (; r + 2 <= r1; r += 2) {  // a pair of rows against 4 positions at a time: 6 loads per 8 FMAs
      lanes_t half[2];
      for (int hh = 0; hh < 2; ++hh) {
        lanes_t acc[kLanes];  // rows r and r + 1 against positions 4 hh .. 4 hh + 3
        for (int t = 0; t < kLanes; ++t) acc[t] = lanes_t{};
        for (int64_t d = 0; d < D; d += kLanes) {
          const lanes_t q0 = load(rows.q[r] + d), q1 = load(rows.q[r + 1] + d);
          for (int t = 0; t < 4; ++t) {
            const lanes_t kt = load(krow[4 * hh + t] + d);
            acc[t] += q0 * kt;
            acc[4 + t] += q1 * kt;
          }
        }
        half[hh] = sum8(acc);  // [row r: 4 positions | row r + 1: 4 positions]
      }
      put_scores(scores + r * V + j0, low_halves(half[0], half[1]), rows.bias[r], vis + j0, width, in_a_row, P);
      put_scores(scores + (r + 1) * V + j0, high_halves(half[0], half[1]), rows.bias[r + 1], vis + j0, width,
                 in_a_row, P);
    }
    for (; r < r1; ++r) {
      lanes_t acc[kLanes];
      for (int t = 0; t < kLanes; ++t) acc[t] = lanes_t{};
      for (int64_t d = 0; d < D; d += kLanes) {
        const lanes_t qd = load(rows.q[r] + d);
        for (int t = 0; t < kLanes; ++t) acc[t] += qd * load(krow[t] + d);
      }
      put_scores(scores + r * V + j0, sum8(acc), rows.bias[r], vis + j0, width, in_a_row, P);
    }
  } else {
    for (; r < r1; ++r) {
      float dots[kLanes] = {};
      for (int64_t t = 0; t < width; ++t)
        for (int64_t d = 0; d < D; ++d) dots[t] += rows.q[r][d] * krow[t][d];
      put_scores(scores + r * V + j0, load(dots), rows.bias[r], vis + j0, width, in_a_row, P);
    }
  }
}

// out += p . V for rows [r0, r0 + R) over visible positions [j0, j1) of one KV head (V rows from vb).
__attribute__((always_inline)) inline void value_block(const Rows& rows, int64_t r0, int64_t R, const float* vb,
                                                       int64_t D, bool vec, const float* scores, int64_t V, int64_t j0,
                                                       int64_t j1, const int32_t* vis, const Problem& P) {
  int64_t r = r0;
  const int64_t r1 = r0 + R;
  if (vec) {
    for (; r + 2 <= r1; r += 2) {  // a pair of rows: each V load feeds both
      const float* p0 = scores + r * V;
      const float* p1 = p0 + V;
      float* o0 = rows.out[r];
      float* o1 = rows.out[r + 1];
      int64_t d = 0;
      for (; d + 4 * kLanes <= D; d += 4 * kLanes) {  // 4 vectors of dims x 2 rows: 8 accumulators
        lanes_t a0[4], a1[4];
        for (int c = 0; c < 4; ++c) a0[c] = load(o0 + d + c * kLanes), a1[c] = load(o1 + d + c * kLanes);
        for (int64_t j = j0; j < j1; ++j) {
          const float* vr = vb + vis[j] * P.v_l + d;
          const lanes_t w0 = splat(p0[j]), w1 = splat(p1[j]);
          for (int c = 0; c < 4; ++c) {
            const lanes_t vc = load(vr + c * kLanes);
            a0[c] += w0 * vc;
            a1[c] += w1 * vc;
          }
        }
        for (int c = 0; c < 4; ++c) store(o0 + d + c * kLanes, a0[c]), store(o1 + d + c * kLanes, a1[c]);
      }
      for (; d < D; d += kLanes) {
        lanes_t a0 = load(o0 + d), a1 = load(o1 + d);
        for (int64_t j = j0; j < j1; ++j) {
          const lanes_t vc = load(vb + vis[j] * P.v_l + d);
          a0 += splat(p0[j]) * vc;
          a1 += splat(p1[j]) * vc;
        }
        store(o0 + d, a0), store(o1 + d, a1);
      }
    }
    for (; r < r1; ++r) {  // an odd row: even and odd positions apart (8 accumulators)
      const float* pr = scores + r * V;
      float* o = rows.out[r];
      int64_t d = 0;
      for (; d + 4 * kLanes <= D; d += 4 * kLanes) {
        lanes_t a[2][4];
        for (int c = 0; c < 4; ++c) a[0][c] = load(o + d + c * kLanes), a[1][c] = lanes_t{};
        int64_t j = j0;
        for (; j + 2 <= j1; j += 2) {
          const float* v0 = vb + vis[j] * P.v_l + d;
          const float* v1 = vb + vis[j + 1] * P.v_l + d;
          const lanes_t w0 = splat(pr[j]), w1 = splat(pr[j + 1]);
          for (int c = 0; c < 4; ++c) a[0][c] += w0 * load(v0 + c * kLanes), a[1][c] += w1 * load(v1 + c * kLanes);
        }
        if (j < j1) {
          const float* v0 = vb + vis[j] * P.v_l + d;
          const lanes_t w0 = splat(pr[j]);
          for (int c = 0; c < 4; ++c) a[0][c] += w0 * load(v0 + c * kLanes);
        }
        for (int c = 0; c < 4; ++c) store(o + d + c * kLanes, a[0][c] + a[1][c]);
      }
      for (; d < D; d += kLanes) {
        lanes_t a = load(o + d);
        for (int64_t j = j0; j < j1; ++j) a += splat(pr[j]) * load(vb + vis[j] * P.v_l + d);
        store(o + d, a);
      }
    }
  } else {
    for (; r < r1; ++r) {
      const float* pr = scores + r * V;
      float* o = rows.out[r];
      for (int64_t j = j0; j < j1; ++j) {
        const float* vr = vb + vis[j] * P.v_l;
        const float p = pr[j];
        for (int64_t e = 0; e < D; ++e) o[e] += p * vr[e];
      }
    }
  }
}

// Softmax numerators of each row in place and 1 / their sum (0 for a row that sees nothing); zeroes the outputs.
__attribute__((always_inline)) inline void softmax_rows(const Rows& rows, float* scores, int64_t V, int64_t D,
                                                        float* inv_sum) {
  const float hidden = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows.count; ++r) {
    float* sr = scores + r * V;
    lanes_t tops = splat(hidden);
    int64_t j = 0;
    for (; j + kLanes <= V; j += kLanes) {
      const lanes_t x = load(sr + j);
      tops = x > tops ? x : tops;
    }
    float top = hidden;
    for (; j < V; ++j) top = std::max(top, sr[j]);
    for (int t = 0; t < kLanes; ++t) top = std::max(top, tops[t]);
    std::memset(rows.out[r], 0, D * sizeof(float));
    if (top == hidden) {
      inv_sum[r] = 0.0f;
      std::memset(sr, 0, V * sizeof(float));
      continue;
    }
    lanes_t total = lanes_t{};
    for (j = 0; j + kLanes <= V; j += kLanes) {
      const lanes_t e = exp_nonpositive(load(sr + j) - splat(top));
      store(sr + j, e);
      total += e;
    }
    if (j < V) {  // the tail through a padded vector
      float tail[kLanes];
      for (int64_t t = 0; t < kLanes; ++t) tail[t] = j + t < V ? sr[j + t] - top : hidden;
      const lanes_t e = exp_nonpositive(load(tail));
      store(tail, e);
      for (int64_t t = 0; j + t < V; ++t) sr[j + t] = tail[t];
      total += e;
    }
    float sum = 0.0f;
    for (int t = 0; t < kLanes; ++t) sum += total[t];
    inv_sum[r] = 1.0f / sum;
  }
}

// Asks for the cache lines of KV heads [g0, g1) at visible positions [j0, j1) (a prefetch: no fault, no wait).
// A step's caches are usually cold (every layer's K/V and weights passed through the caches since the last step),
// and a few hundred rows of 128 bytes per head are too short a stream for the hardware prefetcher to get ahead.
template <int kLocality>
__attribute__((always_inline)) inline void prefetch_rows(const float* base, int64_t stride_l, int64_t stride_h,
                                                         int64_t g0, int64_t g1, int64_t D, const int32_t* vis,
                                                         int64_t j0, int64_t j1) {
  constexpr int64_t kLine = 64 / sizeof(float);
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t g = g0; g < g1; ++g) {
      const float* row = base + vis[j] * stride_l + g * stride_h;
      for (int64_t e = 0; e < D; e += kLine) __builtin_prefetch(row + e, 0, kLocality);
      __builtin_prefetch(row + D - 1, 0, kLocality);  // the last line when the row is not line-aligned
    }
}

// Work item: request b, query slots [i0, i1), KV heads [g0, g1) (kMaxRows rows or fewer, unless one slot's
// group of query heads alone is more). The positions are walked
// in order with every KV head's rows at each: the K and V rows of a position (all its heads side by side in a
// cache) stream through once.
__attribute__((always_inline)) inline void attend_kernel(const Problem& P, int64_t b, int64_t i0, int64_t i1,
                                                         int64_t g0, int64_t g1, Scratch& s) {
  const int64_t n = P.n, L = P.L, G = P.G, D = P.D;
  const float* bias_b = P.bias + b * P.bias_b;
  const float hidden = -std::numeric_limits<float>::infinity();
  // A request's work items share its list; per slot, a row's sums run over exactly the positions it sees, in
  // order, as the same row's would in any other forward (a decode row, a chain, a tree with other branches).
  const int64_t slot = P.per_slot ? i0 : -1, seen0 = P.per_slot ? i0 : 0, seen1 = P.per_slot ? i1 : n;
  if (s.call != P.call || s.request != b || s.slot != slot) {
    s.visible.resize(L);
    int64_t count = 0;
    for (int64_t l = 0; l < L; ++l) {
      bool seen = false;
      for (int64_t i = seen0; i < seen1; ++i) seen |= bias_b[i * P.bias_i + l * P.bias_l] != hidden;
      s.visible[count] = static_cast<int32_t>(l);
      count += seen;
    }
    // Past the last query slot that sees a position: the padding of a request with fewer queries than n.
    int64_t live = seen0;
    for (int64_t i = seen1; i > seen0 && live == seen0; --i)
      for (int64_t l = 0; l < L && live == seen0; ++l)
        if (bias_b[(i - 1) * P.bias_i + l * P.bias_l] != hidden) live = i;
    s.call = P.call, s.request = b, s.slot = slot, s.count = count, s.live = live;
  }
  // Slots that see nothing get 0 without a pass over the positions.
  const int64_t i_end = std::max(i0, std::min(i1, s.live));
  for (int64_t i = i_end; i < i1; ++i)
    for (int64_t h = g0 * G; h < g1 * G; ++h)
      std::memset(P.out + b * P.out_b + i * P.out_i + h * P.out_h, 0, D * sizeof(float));
  if (i_end == i0) return;
  i1 = i_end;
  const int64_t V = s.count;
  const int32_t* vis = s.visible.data();
  const bool vec = D % kLanes == 0;
  Rows& rows = s.rows;
  rows.per_head = (i1 - i0) * G;
  rows.count = (g1 - g0) * rows.per_head;
  rows.q.resize(rows.count), rows.bias.resize(rows.count), rows.out.resize(rows.count), rows.inv_sum.resize(rows.count);
  for (int64_t r = 0; r < rows.count; ++r) {
    const int64_t g = g0 + r / rows.per_head, i = i0 + (r % rows.per_head) / G, h = g * G + r % G;
    rows.q[r] = P.q + b * P.q_b + i * P.q_i + h * P.q_h;
    rows.out[r] = P.out + b * P.out_b + i * P.out_i + h * P.out_h;
    rows.bias[r] = bias_b + i * P.bias_i;
  }
  s.scores.resize(std::max<int64_t>(1, rows.count * V));
  float* scores = s.scores.data();
  const float* kb = P.k + b * P.k_b;
  const float* vb = P.v + b * P.v_b;

  // K rows `ahead` positions before their use (all of them first when the request is short: measured best on the
  // embedded target's decode, 0.8x the attention time of 32 positions ahead); this block's V rows for the P.V pass.
  const int64_t ahead = std::max(kLanes, kPrefetchBytes / (int64_t(sizeof(float)) * D * (g1 - g0)) / kLanes * kLanes);
  prefetch_rows<3>(kb, P.k_l, P.k_h, g0, g1, D, vis, 0, std::min(V, ahead));
  for (int64_t j0 = 0; j0 < V; j0 += kLanes) {
    const int64_t width = std::min(kLanes, V - j0);
    prefetch_rows<3>(kb, P.k_l, P.k_h, g0, g1, D, vis, std::min(V, j0 + ahead), std::min(V, j0 + ahead + kLanes));
    prefetch_rows<2>(vb, P.v_l, P.v_h, g0, g1, D, vis, j0, j0 + width);
    const bool in_a_row = width == kLanes && P.bias_l == 1 && vis[j0 + kLanes - 1] - vis[j0] == kLanes - 1;
    const float* krow[kLanes];
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t t = 0; t < kLanes; ++t) krow[t] = kb + vis[j0 + std::min(t, width - 1)] * P.k_l + g * P.k_h;
      score_block(rows, (g - g0) * rows.per_head, rows.per_head, krow, D, vec, scores, V, j0, vis, width, in_a_row,
                  P);
    }
  }
  softmax_rows(rows, scores, V, D, rows.inv_sum.data());
  for (int64_t j0 = 0; j0 < V; j0 += kValueBlock) {
    const int64_t j1 = std::min(V, j0 + kValueBlock);
    for (int64_t g = g0; g < g1; ++g)
      value_block(rows, (g - g0) * rows.per_head, rows.per_head, vb + g * P.v_h, D, vec, scores, V, j0, j1, vis, P);
  }
  for (int64_t r = 0; r < rows.count; ++r)
    for (int64_t e = 0; e < D; ++e) rows.out[r][e] *= rows.inv_sum[r];
}

using AttendFn = void (*)(const Problem&, int64_t, int64_t, int64_t, int64_t, int64_t, Scratch&);

void attend_generic(const Problem& P, int64_t b, int64_t i0, int64_t i1, int64_t g0, int64_t g1, Scratch& s) {
  attend_kernel(P, b, i0, i1, g0, g1, s);
}

#ifdef SPECDEC_HAVE_AVX2_VERSION
__attribute__((target("avx2,fma"))) void attend_avx2(const Problem& P, int64_t b, int64_t i0, int64_t i1, int64_t g0,
                                                      int64_t g1, Scratch& s) {
  attend_kernel(P, b, i0, i1, g0, g1, s);
}
#endif

AttendFn attend_fn() {
#ifdef SPECDEC_HAVE_AVX2_VERSION
  static const bool avx2 = specdec::runs_avx2_fma("SPECDEC_ATTENTION_GENERIC");
  if (avx2) return attend_avx2;
#endif
  return attend_generic;
}

void check_float_cpu(const at::Tensor& t, const char* name, int64_t dims, const char* layout) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor, got ",
                    t.scalar_type(), " on ", t.device());
  TORCH_CHECK_VALUE(t.dim() == dims && (t.size(dims - 1) <= 1 || t.stride(dims - 1) == 1), name, " must be a ",
                    layout, " tensor with unit stride in its last dim, got shape ", t.sizes(), " and strides ",
                    t.strides());
}

void padded_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& attn_bias, double scale, const at::Tensor& out, bool row_invariant) {
  check_float_cpu(q, "q", 3, "[B * n, Hq, D]");
  check_float_cpu(k_cache, "k_cache", 4, "[rows, max_len, Hkv, D]");
  check_float_cpu(v_cache, "v_cache", 4, "[rows, max_len, Hkv, D]");
  check_float_cpu(attn_bias, "attn_bias", 4, "[B, 1, n, L]");
  check_float_cpu(out, "out", 3, "[B * n, Hq, D]");
  const int64_t B = attn_bias.size(0), n = attn_bias.size(2), L = attn_bias.size(3);
  const int64_t Hq = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK_VALUE(attn_bias.size(1) == 1, "attn_bias must be [B, 1, n, L], got shape ", attn_bias.sizes());
  TORCH_CHECK_VALUE(q.size(0) == B * n, "q must have B * n = ", B * n, " rows for attn_bias of shape ",
                    attn_bias.sizes(), ", got shape ", q.sizes());
  TORCH_CHECK_VALUE(k_cache.size(0) >= B && k_cache.size(1) >= L && k_cache.size(3) == D && Hkv > 0 && Hq % Hkv == 0,
                    "k_cache must be [rows >= B=", B, ", max_len >= L=", L, ", Hkv, D=", D, "] with Hkv dividing Hq=",
                    Hq, ", got shape ", k_cache.sizes());
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "v_cache must have k_cache's shape ", k_cache.sizes(),
                    ", got ", v_cache.sizes());
  TORCH_CHECK_VALUE(out.sizes() == q.sizes(), "out must have q's shape ", q.sizes(), ", got ", out.sizes());
  if (B == 0 || n == 0 || Hq == 0 || D == 0) return;
  const int64_t G = Hq / Hkv;
  const at::Tensor& k = k_cache;
  const at::Tensor& v = v_cache;
  Problem P{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), attn_bias.data_ptr<float>(),
            out.data_ptr<float>(), n, L, Hkv, G, D,
            n * q.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), attn_bias.stride(0), attn_bias.stride(2),
            attn_bias.stride(3), n * out.stride(0), out.stride(0), out.stride(1), static_cast<float>(scale), 0,
            row_invariant};
  static std::atomic<uint64_t> calls{0};
  P.call = ++calls;
  const AttendFn attend = attend_fn();
  // Work items: (request, a chunk of query slots, a chunk of KV heads) of at most kMaxRows rows, all the heads
  // together where they fit. With several threads and fewer items than threads, the heads split further; a thread
  // takes at least ~1 MFLOP (a parallel region costs microseconds).
  const int64_t heads_per_item_max = std::max<int64_t>(1, std::min(Hkv, kMaxRows / G));
  const int64_t threads = at::get_num_threads();
  int64_t heads_per_item = heads_per_item_max;
  const int64_t slots_per_item =
      row_invariant ? 1 : std::max<int64_t>(1, std::min(n, kMaxRows / (heads_per_item * G)));
  const int64_t slot_chunks = (n + slots_per_item - 1) / slots_per_item;
  if (threads > 1 && B * slot_chunks * ((Hkv + heads_per_item - 1) / heads_per_item) < threads)
    heads_per_item = std::max<int64_t>(1, Hkv / ((threads + B * slot_chunks - 1) / (B * slot_chunks)));
  const int64_t head_chunks = (Hkv + heads_per_item - 1) / heads_per_item;
  const int64_t work = std::max<int64_t>(1, 4 * slots_per_item * heads_per_item * G * L * D);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / work);
  at::parallel_for(0, B * slot_chunks * head_chunks, grain, [&](int64_t w0, int64_t w1) {
    thread_local Scratch scratch;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / (slot_chunks * head_chunks), c = w % (slot_chunks * head_chunks);
      const int64_t i0 = (c / head_chunks) * slots_per_item, g0 = (c % head_chunks) * heads_per_item;
      attend(P, b, i0, std::min(n, i0 + slots_per_item), g0, std::min(Hkv, g0 + heads_per_item), scratch);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("padded_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor attn_bias, float scale, Tensor(a!) out, "
        "bool row_invariant=False) -> ()");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("padded_attention", &padded_attention); }
