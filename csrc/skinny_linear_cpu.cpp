// Linear layers of a few rows on the CPU: y [M, N] = x [M, K] . W^T (+ bias), float32, the weight packed once.
//
// A decode batch, a chain's or a tree's verification, a draft level or a short prefill hands the linear layers 1 to
// ~100 rows. There the GEMM should cost what reading the weight costs, but the BLAS and oneDNN paths of PyTorch's CPU
// build take several times that on some CPUs (the fused gate/up of the embedded target at 6 rows, on an AMD EPYC),
// and more rows only amortise the read (cpu_linear.py runs this kernel up to 128 rows, chosen end to end: bench/
// RESULTS.md, "CPU GEMMs"). This kernel reads each weight element from memory once (passes of 8 rows over slices
// held in L1, run_passes): the weight is packed as [ceil(N / 8), K, 8] (8 output features interleaved per input feature, zero-padded), so one pass over k
// streams the pack contiguously while up to 8 rows of x (a few KB, cache-resident) are broadcast against it and 8
// accumulators per row stay in vector registers. Each output is a float32 sum over k in partial sums whose number
// depends on the rows in a pass (another order than BLAS's: results agree up to rounding, not bit for bit), or,
// with row_invariant, in one order for every row count (fixed_blocks_kernel). A weight whose every value is a
// bfloat16 may be packed in bfloat16 (load_lanes): the same sums from half the bytes.
//
// On x86-64 an AVX-512 and an AVX2 + FMA version are compiled beside the generic one and chosen at run time; elsewhere
// (or without AVX2, or with SPECDEC_SKINNY_GENERIC=1 set when the process first calls it: how the tests reach it)
// the generic version runs, in whatever vectors the compiler targets. The AVX-512 version runs two adjacent packed
// blocks as one 16-lane vector: each output's sum is the AVX2 version's, operation for operation, so the two give
// the same bits (SPECDEC_SKINNY_AVX2=1 keeps the AVX2 one on an AVX-512 CPU: how the tests compare them).

#include "cpu_version.h"
#include "skinny_linear.h"

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <string>

namespace {

constexpr int64_t kLanes = 8;    // output features per packed block
constexpr int64_t kMaxRows = 8;  // rows per pass over the pack

typedef float lanes_t __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint32_t words_t __attribute__((vector_size(kLanes * sizeof(uint32_t))));

// A bfloat16 pack keeps input features k and k + 1 (k even) of a block's 8 lanes in one 32-byte row of 8 words, k in
// each word's low half: [blocks, ceil(K / 2), 16]. Block b + 1 starts kPairRow * ceil(K / 2) elements after block b.
constexpr int64_t kPairRow = 2 * kLanes;

// The 8 words of a bfloat16 pack's block holding input features k and k + 1 (k even; k odd reads k - 1's row).
__attribute__((always_inline)) inline void load_words(words_t& words, const uint16_t* w, int64_t k) {
  std::memcpy(&words, w + (k >> 1) * kPairRow, sizeof(words));
}

// One block's 8 lanes at input feature k, from a float32 pack or a bfloat16 one (uint16_t: the bits). A bfloat16 is
// the top half of the float32 of the same value, so widening is exact and every product and sum is the float32
// pack's, from half the bytes; each half is taken by a shift or a mask, no shuffle.
__attribute__((always_inline)) inline void load_lanes(lanes_t& v, const float* w, int64_t k) {
  std::memcpy(&v, w + k * kLanes, sizeof(v));
}

__attribute__((always_inline)) inline void load_lanes(lanes_t& v, const uint16_t* w, int64_t k) {
  words_t words;
  load_words(words, w, k);
  const uint32_t shift = (k & 1) ? 0 : 16;
  v = (lanes_t)((words << shift) & 0xFFFF0000u);
}

// Input features k and k + 1 (k even) of one block: two loads from a float32 pack, one from a bfloat16 pack.
__attribute__((always_inline)) inline void load_pair(lanes_t& even, lanes_t& odd, const float* w, int64_t k) {
  load_lanes(even, w, k);
  load_lanes(odd, w, k + 1);
}

__attribute__((always_inline)) inline void load_pair(lanes_t& even, lanes_t& odd, const uint16_t* w, int64_t k) {
  words_t words;
  load_words(words, w, k);
  even = (lanes_t)(words << 16);
  odd = (lanes_t)(words & 0xFFFF0000u);
}

// Elements from one packed block to the next: K rows of 8 floats, or ceil(K / 2) rows of 16 bfloat16.
__attribute__((always_inline)) inline int64_t block_stride(const float*, int64_t K) { return K * kLanes; }
__attribute__((always_inline)) inline int64_t block_stride(const uint16_t*, int64_t K) {
  return (K + 1) / 2 * kPairRow;
}

// The lanes of P adjacent packed blocks at input feature k, as one vector: P = 1, one block (8 lanes); P = 2, two
// (16 lanes, one AVX-512 register).
template <int P>
struct Lanes;

template <>
struct Lanes<1> {
  typedef lanes_t type;
  template <typename W>
  __attribute__((always_inline)) static inline void load(type& v, const W* w, int64_t, int64_t k) {
    load_lanes(v, w, k);
  }
  template <typename W>
  __attribute__((always_inline)) static inline void load_pair(type& even, type& odd, const W* w, int64_t, int64_t k) {
    ::load_pair(even, odd, w, k);
  }
};

#ifdef SPECDEC_HAVE_AVX512_VERSION
template <>
struct Lanes<2> {
  typedef float type __attribute__((vector_size(2 * kLanes * sizeof(float))));
  template <typename W>
  __attribute__((always_inline)) static inline void load(type& v, const W* w, int64_t K, int64_t k) {
    lanes_t low, high;
    load_lanes(low, w, k);
    load_lanes(high, w + block_stride(w, K), k);
    v = __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  }
  // A bfloat16 pack: the two blocks' words joined first, so one shuffle, one shift and one mask serve 16 lanes.
  __attribute__((always_inline)) static inline void load_pair(type& even, type& odd, const uint16_t* w, int64_t K,
                                                              int64_t k) {
    typedef uint32_t wide_words_t __attribute__((vector_size(2 * kLanes * sizeof(uint32_t))));
    words_t low, high;
    load_words(low, w, k);
    load_words(high, w + block_stride(w, K), k);
    const wide_words_t words =
        __builtin_shufflevector(low, high, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    even = (type)(words << 16);
    odd = (type)(words & 0xFFFF0000u);
  }
  template <typename W>
  __attribute__((always_inline)) static inline void load_pair(type& even, type& odd, const W* w, int64_t K, int64_t k) {
    lanes_t low_even, low_odd, high_even, high_odd;
    ::load_pair(low_even, low_odd, w, k);
    ::load_pair(high_even, high_odd, w + block_stride(w, K), k);
    even = __builtin_shufflevector(low_even, high_even, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    odd = __builtin_shufflevector(low_odd, high_odd, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  }
};
#endif

// Writes a pass's sums for rows [0, M) to the outputs of blocks [nb, nb + P), plus the bias: the lanes past N
// (the last block's padding) are dropped.
template <int M, int P>
__attribute__((always_inline)) inline void store_lanes(const typename Lanes<P>::type (&sums)[M], int64_t nb,
                                                       const float* bias, float* out, int64_t ldo, int64_t N) {
  constexpr int64_t lanes = P * kLanes;
  const int64_t n0 = nb * kLanes, width = std::min(lanes, N - n0);
  for (int m = 0; m < M; ++m) {
    float lane[lanes];
    std::memcpy(lane, &sums[m], sizeof(lane));
    if (bias != nullptr)
      for (int64_t j = 0; j < width; ++j) lane[j] += bias[n0 + j];
    std::memcpy(out + m * ldo + n0, lane, width * sizeof(float));
  }
}

// Rows [0, M) of x against packed blocks [block_begin, block_end), P blocks at a time (block_end - block_begin a
// multiple of P): out[m, n] for the features in those blocks. Each row keeps S partial sums (k = s mod S): an FMA
// waits for the previous one on its accumulator, so a few rows alone would leave the FMA units idle; S x M >= 6
// independent chains keep them busy. Always inlined, so each version below compiles it for its own instruction
// set (a generic copy called from the AVX2 one would split the accumulators in two and spill them).
template <int M, int P, typename W>
__attribute__((always_inline)) inline void blocks_kernel(const float* x, int64_t ldx, int64_t K, const W* packed,
                                                          int64_t block_begin, int64_t block_end, const float* bias,
                                                          float* out, int64_t ldo, int64_t N) {
  using V = typename Lanes<P>::type;
  constexpr int S = M == 1 ? 8 : M == 2 ? 4 : M <= 4 ? 2 : 1;
  for (int64_t nb = block_begin; nb < block_end; nb += P) {
    V acc[S][M];
    for (int s = 0; s < S; ++s)
      for (int m = 0; m < M; ++m) acc[s][m] = V{};
    const W* w = packed + nb * block_stride(packed, K);
    // Input features in pairs (one load from a bfloat16 pack), each still added to sum k mod S in order.
    constexpr int step = S == 1 ? 2 : S;
    int64_t k = 0;
    for (; k + step <= K; k += step) {
      for (int s = 0; s < step; s += 2) {
        V even, odd;
        Lanes<P>::load_pair(even, odd, w, K, k + s);
        for (int m = 0; m < M; ++m) acc[s % S][m] += x[m * ldx + k + s] * even;
        for (int m = 0; m < M; ++m) acc[(s + 1) % S][m] += x[m * ldx + k + s + 1] * odd;
      }
    }
    for (; k < K; ++k) {
      V wk;
      Lanes<P>::load(wk, w, K, k);
      for (int m = 0; m < M; ++m) acc[0][m] += x[m * ldx + k] * wk;
    }
    for (int sums = S; sums > 1; sums /= 2)  // pairwise: (0 + 1) + (2 + 3), ...
      for (int s = 0; s < sums / 2; ++s)
        for (int m = 0; m < M; ++m) acc[s][m] = acc[2 * s][m] + acc[2 * s + 1][m];
    store_lanes<M, P>(acc[0], nb, bias, out, ldo, N);
  }
}

// The row-invariant order (SPECDEC_ROW_INVARIANT): each row sums in one order whatever the rows beside it. k runs in
// 8 segments of K / 8 (the last one takes the rest), each summed in order from zero, and the 8 segment sums are
// added pairwise, whatever M. M rows cannot keep 8 sums each in registers, so C = 8 / M segments (a power of two)
// run side by side per round, over 8 / C rounds, their sums kept in memory between rounds: with one row, 8 chains
// of FMAs keep the units busy; with 8, a round streams one segment of the pack for all rows, and the rounds together
// stream the pack once, as blocks_kernel<8> does.
template <int M, int P, typename W>
__attribute__((always_inline)) inline void fixed_blocks_kernel(const float* x, int64_t ldx, int64_t K,
                                                                const W* packed, int64_t block_begin,
                                                                int64_t block_end, const float* bias, float* out,
                                                                int64_t ldo, int64_t N) {
  using V = typename Lanes<P>::type;
  constexpr int S = 8, C = M == 1 ? 8 : M == 2 ? 4 : M <= 4 ? 2 : 1;
  const int64_t seg = K / S;
  for (int64_t nb = block_begin; nb < block_end; nb += P) {
    V part[S][M];
    const W* w = packed + nb * block_stride(packed, K);
    for (int s0 = 0; s0 < S; s0 += C) {
      V acc[C][M];
      for (int c = 0; c < C; ++c)
        for (int m = 0; m < M; ++m) acc[c][m] = V{};
      if (seg % 2 == 0) {  // every segment starts at an even k: input features in pairs, in order
        for (int64_t j = 0; j < seg; j += 2) {
          for (int c = 0; c < C; ++c) {
            const int64_t k = (s0 + c) * seg + j;
            V even, odd;
            Lanes<P>::load_pair(even, odd, w, K, k);
            for (int m = 0; m < M; ++m) acc[c][m] += x[m * ldx + k] * even;
            for (int m = 0; m < M; ++m) acc[c][m] += x[m * ldx + k + 1] * odd;
          }
        }
      } else {
        for (int64_t j = 0; j < seg; ++j) {
          for (int c = 0; c < C; ++c) {
            const int64_t k = (s0 + c) * seg + j;
            V wk;
            Lanes<P>::load(wk, w, K, k);
            for (int m = 0; m < M; ++m) acc[c][m] += x[m * ldx + k] * wk;
          }
        }
      }
      if (s0 + C == S)  // the last segment's rest
        for (int64_t k = S * seg; k < K; ++k) {
          V wk;
          Lanes<P>::load(wk, w, K, k);
          for (int m = 0; m < M; ++m) acc[C - 1][m] += x[m * ldx + k] * wk;
        }
      for (int c = 0; c < C; ++c)
        for (int m = 0; m < M; ++m) part[s0 + c][m] = acc[c][m];
    }
    for (int sums = S; sums > 1; sums /= 2)  // pairwise: (0 + 1) + (2 + 3), ...
      for (int s = 0; s < sums / 2; ++s)
        for (int m = 0; m < M; ++m) part[s][m] = part[2 * s][m] + part[2 * s + 1][m];
    store_lanes<M, P>(part[0], nb, bias, out, ldo, N);
  }
}

// One block at a time (P = 1) or pairs of blocks then the odd one left (P = 2).
template <int M, bool Fixed, int P, typename W>
__attribute__((always_inline)) inline void run_blocks(const float* x, int64_t ldx, int64_t K, const W* packed,
                                                       int64_t b0, int64_t b1, const float* bias, float* out,
                                                       int64_t ldo, int64_t N) {
  const int64_t whole = b0 + (b1 - b0) / P * P;
  if constexpr (Fixed)
    fixed_blocks_kernel<M, P>(x, ldx, K, packed, b0, whole, bias, out, ldo, N);
  else
    blocks_kernel<M, P>(x, ldx, K, packed, b0, whole, bias, out, ldo, N);
  if constexpr (P > 1)
    run_blocks<M, Fixed, 1>(x, ldx, K, packed, whole, b1, bias, out, ldo, N);
}

template <typename W>
using BlocksFn = void (*)(const float*, int64_t, int64_t, const W*, int64_t, int64_t, const float*, float*, int64_t,
                          int64_t);

template <int M, bool Fixed, typename W>
void blocks_generic(const float* x, int64_t ldx, int64_t K, const W* packed, int64_t b0, int64_t b1,
                    const float* bias, float* out, int64_t ldo, int64_t N) {
  run_blocks<M, Fixed, 1>(x, ldx, K, packed, b0, b1, bias, out, ldo, N);
}

#ifdef SPECDEC_HAVE_AVX2_VERSION
template <int M, bool Fixed, typename W>
__attribute__((target("avx2,fma"))) void blocks_avx2(const float* x, int64_t ldx, int64_t K, const W* packed,
                                                      int64_t b0, int64_t b1, const float* bias, float* out,
                                                      int64_t ldo, int64_t N) {
  run_blocks<M, Fixed, 1>(x, ldx, K, packed, b0, b1, bias, out, ldo, N);
}
#endif

#ifdef SPECDEC_HAVE_AVX512_VERSION
template <int M, bool Fixed, typename W>
__attribute__((target("avx512f,avx2,fma"))) void blocks_avx512(const float* x, int64_t ldx, int64_t K,
                                                                const W* packed, int64_t b0, int64_t b1,
                                                                const float* bias, float* out, int64_t ldo,
                                                                int64_t N) {
  run_blocks<M, Fixed, 2>(x, ldx, K, packed, b0, b1, bias, out, ldo, N);
}
#endif

#define SPECDEC_ROW_TABLE(fn, fixed)                                                                    \
  {                                                                                                     \
    fn<1, fixed, W>, fn<2, fixed, W>, fn<3, fixed, W>, fn<4, fixed, W>, fn<5, fixed, W>, fn<6, fixed, W>, \
        fn<7, fixed, W>, fn<8, fixed, W>                                                                \
  }

enum class Version { generic, avx2, avx512 };

// The version this CPU runs, chosen once per process.
Version skinny_version() {
#ifdef SPECDEC_HAVE_AVX2_VERSION
  static const Version version = [] {
    if (!specdec::runs_avx2_fma("SPECDEC_SKINNY_GENERIC")) return Version::generic;
#ifdef SPECDEC_HAVE_AVX512_VERSION
    if (__builtin_cpu_supports("avx512f") && !specdec::generic_forced("SPECDEC_SKINNY_AVX2")) return Version::avx512;
#endif
    return Version::avx2;
  }();
  return version;
#else
  return Version::generic;
#endif
}

// The kernel for a pass of `rows` rows (1 .. kMaxRows) over a pack of W (float, or uint16_t: bfloat16 bits), in the
// version this CPU runs; `fixed`: the row-invariant order.
template <typename W>
BlocksFn<W> kernel_for(int64_t rows, bool fixed) {
#ifdef SPECDEC_HAVE_AVX512_VERSION
  static constexpr BlocksFn<W> avx512[2][kMaxRows] = {SPECDEC_ROW_TABLE(blocks_avx512, false),
                                                      SPECDEC_ROW_TABLE(blocks_avx512, true)};
  if (skinny_version() == Version::avx512) return avx512[fixed][rows - 1];
#endif
#ifdef SPECDEC_HAVE_AVX2_VERSION
  static constexpr BlocksFn<W> avx2[2][kMaxRows] = {SPECDEC_ROW_TABLE(blocks_avx2, false),
                                                    SPECDEC_ROW_TABLE(blocks_avx2, true)};
  if (skinny_version() == Version::avx2) return avx2[fixed][rows - 1];
#endif
  static constexpr BlocksFn<W> generic[2][kMaxRows] = {SPECDEC_ROW_TABLE(blocks_generic, false),
                                                       SPECDEC_ROW_TABLE(blocks_generic, true)};
  return generic[fixed][rows - 1];
}

std::string skinny_linear_version() {
  switch (skinny_version()) {
    case Version::avx512: return "avx512";
    case Version::avx2: return "avx2";
    default: return "generic";
  }
}

void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor, got ",
                    t.scalar_type(), " on ", t.device());
}

// weight [N, K] -> packed [ceil(N / 8), K, 8]: packed[b, k, j] = weight[8 b + j, k], 0 past N; with `bf16`
// (every value of weight must be a bfloat16: a bfloat16 checkpoint's weights widened to float32) a bfloat16 pack
// [ceil(N / 8), ceil(K / 2), 16] of the same values: packed[b, k / 2, 2 j + k % 2] (load_lanes).
at::Tensor skinny_linear_pack(const at::Tensor& weight, bool bf16) {
  check_float_cpu(weight, "weight");
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(0) > 0 && weight.size(1) > 0,
                    "weight must be a non-empty 2-D [out_features, in_features] tensor, got shape ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1), blocks = (N + kLanes - 1) / kLanes;
  if (!bf16) {
    at::Tensor padded = at::zeros({blocks * kLanes, K}, weight.options());
    padded.narrow(0, 0, N).copy_(weight);
    return padded.view({blocks, kLanes, K}).transpose(1, 2).contiguous();
  }
  const int64_t pairs = (K + 1) / 2;
  at::Tensor padded = at::zeros({blocks * kLanes, 2 * pairs}, weight.options().dtype(at::kBFloat16));
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  TORCH_CHECK_VALUE(padded.narrow(0, 0, N).narrow(1, 0, K).to(at::kFloat).equal(weight),
                    "bf16=True needs a weight whose every value is a bfloat16 (one widened from a bfloat16 "
                    "checkpoint); this weight has other values: pack it with bf16=False");
  return padded.view({blocks, kLanes, pairs, 2}).permute({0, 2, 1, 3}).contiguous().view({blocks, pairs, kPairRow});
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const c10::optional<at::Tensor>& bias, bool row_invariant) {
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be a 2-D [rows, in_features] tensor, got shape ", x.sizes());
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  specdec::skinny_linear_into(x, packed, bias, out, row_invariant);
  return out;
}

// out = x . W^T (+ bias) over a checked pack of W (float, or uint16_t: bfloat16 bits). Threads split the output
// features. More than 8 rows take several passes; each pass runs over a slice of blocks small enough (~16 KB of
// float32 pack) to stay in the L1 cache for the next pass, and at least two, so the AVX-512 version has a pair to run.
template <typename W>
void run_passes(const at::Tensor& x, const W* wp, const float* bias, at::Tensor& out, bool row_invariant) {
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1), blocks = (N + kLanes - 1) / kLanes;
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  const int64_t slice = std::max<int64_t>(2, 4096 / (K * kLanes));
  at::parallel_for(0, blocks, /*grain_size=*/slice, [&](int64_t b0, int64_t b1) {
    for (int64_t s0 = b0; s0 < b1; s0 += slice) {
      const int64_t s1 = std::min(b1, s0 + slice);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int64_t rows = std::min(kMaxRows, M - m0);
        kernel_for<W>(rows, row_invariant)(xp + m0 * ldx, ldx, K, wp, s0, s1, bias, op + m0 * ldo, ldo, N);
      }
    }
  });
}

}  // namespace

namespace specdec {

void skinny_linear_into(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                        at::Tensor& out, bool row_invariant) {
  check_float_cpu(x, "x");
  TORCH_CHECK_VALUE(packed.device().is_cpu() && (packed.scalar_type() == at::kFloat ||
                                                 packed.scalar_type() == at::kBFloat16),
                    "packed must be a float32 or bfloat16 CPU tensor from skinny_linear_pack, got ",
                    packed.scalar_type(), " on ", packed.device());
  check_float_cpu(out, "out");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1, "x must be a 2-D [rows, in_features] tensor with unit stride "
                    "along in_features, got shape ", x.sizes(), " and strides ", x.strides());
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == x.size(0) && out.stride(1) == 1, "out must be a 2-D [",
                    x.size(0), ", out_features] tensor with unit stride along out_features, got shape ", out.sizes(),
                    " and strides ", out.strides());
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0), N = out.size(1);
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.size(2) == (bf16 ? kPairRow : kLanes) && packed.is_contiguous(),
                    "packed must be a contiguous [blocks, in_features, 8] float32 or [blocks, ceil(in_features / 2), "
                    "16] bfloat16 tensor from skinny_linear_pack, got shape ", packed.sizes(), " of ",
                    packed.scalar_type());
  TORCH_CHECK_VALUE(packed.size(1) == (bf16 ? (K + 1) / 2 : K), "x has ", K, " in_features but packed was made "
                    "for ", bf16 ? "a different count (" : "", packed.size(1), bf16 ? " pairs)" : "");
  TORCH_CHECK_VALUE(N > (blocks - 1) * kLanes && N <= blocks * kLanes, "out_features=", N,
                    " does not match packed's ", blocks, " blocks of ", kLanes, " features");
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    check_float_cpu(*bias, "bias");
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous(),
                      "bias must be a contiguous [", N, "] tensor, got shape ", bias->sizes());
    bias_ptr = bias->data_ptr<float>();
  }
  if (M == 0) return;
  if (bf16)
    run_passes(x, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), bias_ptr, out, row_invariant);
  else
    run_passes(x, packed.data_ptr<float>(), bias_ptr, out, row_invariant);
}

}  // namespace specdec

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("skinny_linear_pack(Tensor weight, bool bf16=False) -> Tensor");
  m.def("skinny_linear(Tensor x, Tensor packed, int out_features, Tensor? bias=None, bool row_invariant=False) "
        "-> Tensor");
  m.def("skinny_linear_version() -> str", &skinny_linear_version);
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("skinny_linear_pack", &skinny_linear_pack);
  m.impl("skinny_linear", &skinny_linear);
}
