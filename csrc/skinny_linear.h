// The skinny-GEMM kernel of skinny_linear_cpu.cpp, for the extension's other C++ code (the fused draft forwards).
#pragma once

#include <ATen/ATen.h>

namespace specdec {

// out [M, N] = x [M, K] . W^T (+ bias) with W packed by skinny_linear_pack: float32 CPU tensors, x and out with unit
// stride along their last dimension (rows may be strided). Checks packed and bias against x and out (ValueError).
// row_invariant: each row summed in one order whatever the row count (slower at a few rows on some layers).
void skinny_linear_into(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                        at::Tensor& out, bool row_invariant = false);

}  // namespace specdec
