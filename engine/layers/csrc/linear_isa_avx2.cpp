// The linear kernels for AVX2 + FMA (Haswell, Zen 1-3 and later).
// Standard headers first, outside the pragma: their inline code stays baseline.
#include <cstdint>
#include <cstring>

#pragma GCC target("avx2,fma")
#define SPLITSERVE_ISA_AVX2 1
#define SPLITSERVE_ISA_TABLE kAvx2Kernels
#define SPLITSERVE_ISA_NAME "avx2"
#include "linear_isa.h"
