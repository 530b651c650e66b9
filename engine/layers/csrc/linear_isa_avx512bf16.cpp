// The bfloat16 linear kernel for AVX512-BF16 (Cooper Lake, Sapphire Rapids,
// Zen 4/5): prompts' rows under prefill_dtype=bfloat16.  Only kBf16Rows
// comes out of this file; the float32 kernels stay in linear_isa_avx512.cpp.
// Standard headers first, outside the pragma: their inline code stays baseline.
#include <cstdint>
#include <cstring>

#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")
#define SPLITSERVE_ISA_AVX512 1
#define SPLITSERVE_ISA_BF16 1
#include "linear_isa.h"
