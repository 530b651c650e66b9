// The linear kernels for AVX-512 F/BW/VL (Skylake-SP, Sapphire Rapids, Zen 4/5).
// Standard headers first, outside the pragma: their inline code stays baseline.
#include <cstdint>
#include <cstring>

#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl")
#define SPLITSERVE_ISA_AVX512 1
#define SPLITSERVE_ISA_TABLE kAvx512Kernels
#define SPLITSERVE_ISA_NAME "avx512"
#include "linear_isa.h"
