// Float32 linear layers for CPUs with the weights packed once at load time.
//
// The BLAS behind torch repacks the weight matrix on every call, which costs
// as much as the multiply itself when the batch is a few decode rows: on two
// AVX2 cores a 2-row GEMM took 5x as long as a 1-row one.  Packing the weight
// into panels of 16 output columns, stored k-major ([N/16][K][16]), lets each
// call stream every weight exactly once per block of rows, for any row count.
//
//   pack_weight(w [N, K])                -> panels [ceil(N/16), K, 16]
//   packed_linear(x [M, K], panels, N, bias or None) -> y [M, N]
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPLITSERVE_AVX2 1
#endif

namespace {

constexpr int64_t NR = 16;       // output columns per panel (two 8-float vectors)
constexpr int64_t MR = 6;        // rows per micro-kernel call (12 accumulators)
constexpr int64_t M_CHUNK = 192; // rows of x kept hot while the panels stream past

// y[0:R, 0:16] = x[0:R, :] @ panel, R <= MR.  x rows are ldx apart; the
// result goes to a 16-wide scratch tile.
template <int R>
inline void micro_kernel(const float* __restrict__ x, int64_t ldx, const float* __restrict__ panel,
                         int64_t K, float* __restrict__ tile) {
#ifdef SPLITSERVE_AVX2
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) { acc0[r] = _mm256_setzero_ps(); acc1[r] = _mm256_setzero_ps(); }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * NR);
    const __m256 b1 = _mm256_loadu_ps(panel + k * NR + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
      acc0[r] = _mm256_fmadd_ps(a, b0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(a, b1, acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(tile + r * NR, acc0[r]);
    _mm256_storeu_ps(tile + r * NR + 8, acc1[r]);
  }
#else
  for (int r = 0; r < R; ++r) {
    float acc[NR] = {0};
    for (int64_t k = 0; k < K; ++k) {
      const float a = x[r * ldx + k];
      for (int64_t j = 0; j < NR; ++j) acc[j] += a * panel[k * NR + j];
    }
    std::memcpy(tile + r * NR, acc, sizeof(acc));
  }
#endif
}

void rows_times_panel(const float* x, int64_t ldx, int64_t rows, const float* panel, int64_t K,
                      const float* bias, int64_t col0, int64_t cols, float* y, int64_t ldy) {
  float tile[MR * NR];
  for (int64_t m = 0; m < rows; m += MR) {
    const int64_t r = std::min<int64_t>(MR, rows - m);
    const float* xm = x + m * ldx;
    switch (r) {
      case 6: micro_kernel<6>(xm, ldx, panel, K, tile); break;
      case 5: micro_kernel<5>(xm, ldx, panel, K, tile); break;
      case 4: micro_kernel<4>(xm, ldx, panel, K, tile); break;
      case 3: micro_kernel<3>(xm, ldx, panel, K, tile); break;
      case 2: micro_kernel<2>(xm, ldx, panel, K, tile); break;
      default: micro_kernel<1>(xm, ldx, panel, K, tile); break;
    }
    for (int64_t i = 0; i < r; ++i) {
      float* out = y + (m + i) * ldy + col0;
      const float* t = tile + i * NR;
      if (bias) {
        for (int64_t j = 0; j < cols; ++j) out[j] = t[j] + bias[col0 + j];
      } else {
        std::memcpy(out, t, cols * sizeof(float));
      }
    }
  }
}

}  // namespace

at::Tensor pack_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack_weight: want a 2-D float32 weight");
  const auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), P = (N + NR - 1) / NR;
  auto out = at::zeros({P, K, NR}, wc.options());
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < NR && p * NR + j < N; ++j) {
        const float* row = src + (p * NR + j) * K;
        float* col = dst + p * K * NR + j;
        for (int64_t k = 0; k < K; ++k) col[k * NR] = row[k];
      }
  });
  return out;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat,
              "packed_linear: float32 only");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == NR, "packed_linear: panels must be [P, K, 16]");
  const int64_t K = panels.size(1), P = panels.size(0);
  TORCH_CHECK(x.size(-1) == K, "packed_linear: x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(P * NR >= N && (P - 1) * NR < N, "packed_linear: N does not match the panels");
  const auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = at::empty({M, N}, x2.options());
  if (M == 0) return y.view(sizes);
  const float* xp = x2.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float* bp = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == N, "packed_linear: bias must be [N] float32");
    bp = bc.data_ptr<float>();
  }
  const int64_t chunks = (M + M_CHUNK - 1) / M_CHUNK;
  // Tasks are (row chunk, panel), chunk-major: a thread walks panels while its
  // rows stay in cache; each panel is read once per chunk.
  at::parallel_for(0, chunks * P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t c = t / P, p = t % P;
      const int64_t m0 = c * M_CHUNK, rows = std::min(M_CHUNK, M - m0);
      const int64_t col0 = p * NR, cols = std::min(NR, N - col0);
      rows_times_panel(xp + m0 * K, K, rows, wp + p * K * NR, K, bp, col0, cols, yp + m0 * N, N);
    }
  });
  return y.view(sizes);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, "pack a [N, K] float32 weight into [N/16, K, 16] panels");
  m.def("packed_linear", &packed_linear, "x @ W.T (+ bias) with a packed weight",
        pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none());
}
