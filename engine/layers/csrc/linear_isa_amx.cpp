// The bfloat16 linear kernel on AMX tiles (Sapphire Rapids and later):
// prompts' rows under prefill_dtype=bfloat16, and generated rows under
// decode_dtype=bfloat16-weights.  Only the kAmx kernels come out of this
// file (every CPU with AMX has AVX512-VBMI).
// Standard headers first, outside the pragma: their inline code stays baseline.
#include <cstdint>
#include <cstring>

#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi,amx-tile,amx-bf16")
#define SPLITSERVE_ISA_AVX512 1
#define SPLITSERVE_ISA_BF16 1
#define SPLITSERVE_ISA_AMX 1
#include "linear_isa.h"
