// The 4-bit x bfloat16 linear kernel for AVX512-BF16 with AVX512-VBMI
// (Sapphire Rapids, Zen 4/5): generated tokens' rows under
// decode_dtype=bfloat16.  Only kQ4Bf16 comes out of this file.
// Standard headers first, outside the pragma: their inline code stays baseline.
#include <cstdint>
#include <cstring>
#include <vector>

#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi")
#define SPLITSERVE_ISA_AVX512 1
#define SPLITSERVE_ISA_BF16 1
#define SPLITSERVE_ISA_BF16Q4 1
#include "linear_isa.h"
