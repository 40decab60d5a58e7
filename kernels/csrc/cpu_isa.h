// The code paths every CPU op of kernels/csrc compiles its bodies for, and whether this CPU can run each: the ops
// include this header (kernels/paged_decode_cpu.py's CppOp hashes it into each op's build key with the source).
#pragma once

#include <cstdint>

#define AI inline __attribute__((always_inline))

namespace {

enum Isa : int64_t { ISA_DEFAULT = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

// whether this CPU runs code path `isa`; need_f16c: the op's vector paths also convert through F16C
inline bool isa_supported(int64_t isa, bool need_f16c = false) {
  __builtin_cpu_init();
  const bool f16c = !need_f16c || __builtin_cpu_supports("f16c");
  if (isa == ISA_AVX512) {
    return f16c && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
  if (isa == ISA_AVX2) return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return true;
}

}  // namespace
