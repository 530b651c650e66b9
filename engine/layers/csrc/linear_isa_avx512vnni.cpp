// The int8 linear kernel for AVX512-VNNI with AVX512-VBMI (Ice Lake, Sapphire
// Rapids, Zen 4/5): generated tokens' rows under decode_dtype=int8.  Only
// kQ4I8Vnni comes out of this file.
// Standard headers first, outside the pragma: their inline code stays baseline.
#include <cstdint>
#include <cstring>
#include <vector>

#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")
#define SPLITSERVE_ISA_AVX512 1
#define SPLITSERVE_ISA_VNNI 1
#include "linear_isa.h"
