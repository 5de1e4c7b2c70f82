// Which version of a CPU kernel runs: the AVX2 + FMA one where the CPU has both (or a kernel's AVX-512 one), unless
// the kernel's environment switch forces the generic one (how the tests reach it on such CPUs). Shared by skinny_linear_cpu.cpp and
// padded_attention_cpu.cpp.
#pragma once

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#define SPECDEC_HAVE_AVX2_VERSION 1
// An AVX-512 version where the compiler can join two 8-lane vectors into one of 16 (GCC 12, clang).
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define SPECDEC_HAVE_AVX512_VERSION 1
#endif
#endif
#endif

namespace specdec {

// The switch `name` is set to anything but "" or "0".
inline bool generic_forced(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' && std::strcmp(value, "0") != 0;
}

#ifdef SPECDEC_HAVE_AVX2_VERSION
// Run the AVX2 + FMA version (callers keep the answer in a static: the choice is made once per process).
inline bool runs_avx2_fma(const char* generic_switch) {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && !generic_forced(generic_switch);
}
#endif

}  // namespace specdec
