// The linear kernels for any x86-64 (or other) CPU, no vector extensions.
#define SPLITSERVE_ISA_TABLE kScalarKernels
#define SPLITSERVE_ISA_NAME "scalar"
#include "linear_isa.h"
