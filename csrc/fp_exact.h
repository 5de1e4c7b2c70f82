// Included first by a file whose floating-point results must equal the Python's bit for bit: no product is fused
// with an addition into one rounding (GCC contracts by default wherever the target has FMA, across statements).
#pragma once

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
