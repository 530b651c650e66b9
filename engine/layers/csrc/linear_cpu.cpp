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
//
// and the small float32 ops between the projections, fused (rms_norm,
// rope_and_store_kv, silu_and_mul).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "parallel_claim.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPLITSERVE_AVX2 1
#endif

namespace {

constexpr int64_t NR = 16;       // output columns per panel (two 8-float vectors)
constexpr int64_t MR = 6;        // rows per micro-kernel call (12 accumulators)
constexpr int64_t M_CHUNK = 192; // rows of x kept hot while the panels stream past

#ifdef SPLITSERVE_AVX2
// R rows x 16 columns of accumulators, the part every weight format shares:
// acc[r] += x[r, k] * b for each k, in the same order whatever the format.
template <int R>
struct Acc {
  __m256 lo[R], hi[R];
  Acc() {
    for (int r = 0; r < R; ++r) { lo[r] = _mm256_setzero_ps(); hi[r] = _mm256_setzero_ps(); }
  }
  inline void fma(const float* __restrict__ x, int64_t ldx, int64_t k, __m256 b0, __m256 b1) {
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
      lo[r] = _mm256_fmadd_ps(a, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(a, b1, hi[r]);
    }
  }
  inline void store(float* __restrict__ tile) const {
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(tile + r * NR, lo[r]);
      _mm256_storeu_ps(tile + r * NR + 8, hi[r]);
    }
  }
};
#endif

// y[0:R, 0:16] = x[0:R, :] @ panel, R <= MR.  x rows are ldx apart; the
// result goes to a 16-wide scratch tile.
template <int R>
inline void micro_kernel(const float* __restrict__ x, int64_t ldx, const float* __restrict__ panel,
                         int64_t K, float* __restrict__ tile) {
#ifdef SPLITSERVE_AVX2
  Acc<R> acc;
  for (int64_t k = 0; k < K; ++k)
    acc.fma(x, ldx, k, _mm256_loadu_ps(panel + k * NR), _mm256_loadu_ps(panel + k * NR + 8));
  acc.store(tile);
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

// ---- 4-bit weights, exactly ----
//
// A weight matrix dequantized from 4-bit blocks (GGUF Q4_1: w = d * q + m per
// 32 inputs, q in 0..15) holds at most 16 distinct values per block.  Stored
// as those blocks again, a one-row GEMV reads 4.5 bits per weight instead of
// 32: decoding a single sequence is memory-bound, so it runs several times
// faster, and since the kernel rebuilds each weight as fl(fl(d * q) + m), the
// very float the float32 matrix holds, and accumulates in the same order, it
// computes bit for bit what packed_linear computes.
//
// Layout, uint8 [P, K/32, 384]: per panel of 16 outputs and block of 32 inputs,
// d[16] and m[16] as float32, then 32 rows of 8 bytes: byte j of row k holds
// q(k, j) in its low nibble and q(k, j + 8) in its high one.
constexpr int64_t QB = 32;                    // inputs per block
constexpr int64_t Q4_BLOCK_BYTES = 2 * NR * 4 + QB * NR / 2;  // 384

template <int R>
inline void q4_micro_kernel(const float* __restrict__ x, int64_t ldx, const uint8_t* __restrict__ panel,
                            int64_t K, float* __restrict__ tile) {
#ifdef SPLITSERVE_AVX2
  Acc<R> acc;
  const __m128i mask = _mm_set1_epi8(0x0F);
  for (int64_t kb = 0; kb < K / QB; ++kb) {
    const uint8_t* blk = panel + kb * Q4_BLOCK_BYTES;
    const float* dm = reinterpret_cast<const float*>(blk);
    const __m256 d0 = _mm256_loadu_ps(dm), d1 = _mm256_loadu_ps(dm + 8);
    const __m256 m0 = _mm256_loadu_ps(dm + 16), m1 = _mm256_loadu_ps(dm + 24);
    const uint8_t* q = blk + 2 * NR * 4;
    for (int64_t kk = 0; kk < QB; ++kk) {
      const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + kk * 8));
      const __m128i lo = _mm_and_si128(v, mask);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
      // mul, then add: never fused, so each weight is rounded as its float32 copy was
      const __m256 b0 = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d0), m0);
      const __m256 b1 = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d1), m1);
      acc.fma(x, ldx, kb * QB + kk, b0, b1);
    }
  }
  acc.store(tile);
#else
  for (int r = 0; r < R; ++r) {
    float acc[NR] = {0};
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t* blk = panel + (k / QB) * Q4_BLOCK_BYTES;
      const float* dm = reinterpret_cast<const float*>(blk);
      const uint8_t* q = blk + 2 * NR * 4 + (k % QB) * 8;
      const float a = x[r * ldx + k];
      for (int64_t j = 0; j < NR; ++j) {
        volatile float prod = static_cast<float>(j < 8 ? (q[j] & 0x0F) : (q[j - 8] >> 4)) * dm[j];
        acc[j] += a * (prod + dm[NR + j]);
      }
    }
    std::memcpy(tile + r * NR, acc, sizeof(acc));
  }
#endif
}

// One micro-kernel family per weight format, over panel p's storage.
struct F32Panels {
  const float* base;
  int64_t K;
  template <int R>
  void run(int64_t p, const float* x, int64_t ldx, float* tile) const {
    micro_kernel<R>(x, ldx, base + p * K * NR, K, tile);
  }
};

struct Q4Panels {
  const uint8_t* base;
  int64_t K;
  template <int R>
  void run(int64_t p, const float* x, int64_t ldx, float* tile) const {
    q4_micro_kernel<R>(x, ldx, base + p * (K / QB) * Q4_BLOCK_BYTES, K, tile);
  }
};

template <typename Panels>
void rows_times_panel(const Panels& w, int64_t p, const float* x, int64_t ldx, int64_t rows,
                      const float* bias, int64_t col0, int64_t cols, float* y, int64_t ldy) {
  float tile[MR * NR];
  for (int64_t m = 0; m < rows; m += MR) {
    const int64_t r = std::min<int64_t>(MR, rows - m);
    const float* xm = x + m * ldx;
    switch (r) {
      case 6: w.template run<6>(p, xm, ldx, tile); break;
      case 5: w.template run<5>(p, xm, ldx, tile); break;
      case 4: w.template run<4>(p, xm, ldx, tile); break;
      case 3: w.template run<3>(p, xm, ldx, tile); break;
      case 2: w.template run<2>(p, xm, ldx, tile); break;
      default: w.template run<1>(p, xm, ldx, tile); break;
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

// y = x @ W.T (+ bias) for W in P panels of K inputs, N outputs; checks done
// by the caller but for x and bias.
template <typename Panels>
at::Tensor run_linear(const char* name, const at::Tensor& x, const Panels& w, int64_t P, int64_t K, int64_t N,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, ": float32 activations only");
  TORCH_CHECK(x.size(-1) == K, name, ": x has ", x.size(-1), " features, the weight ", K);
  TORCH_CHECK(P * NR >= N && (P - 1) * NR < N, name, ": N does not match the panels");
  const auto x2 = x.reshape({-1, K}).contiguous();
  const int64_t M = x2.size(0);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = at::empty({M, N}, x2.options());
  if (M == 0) return y.view(sizes);
  const float* bp = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kFloat && bc.numel() == N, name, ": bias must be [N] float32");
    bp = bc.data_ptr<float>();
  }
  const float* xp = x2.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t chunks = (M + M_CHUNK - 1) / M_CHUNK;
  // Tasks are (row chunk, panel), chunk-major: a thread walks panels while its
  // rows stay in cache; each panel is read once per chunk.
  // About 16 claims per thread: small enough to even out a preempted thread,
  // large enough that claiming costs nothing.
  const int64_t grain = std::max<int64_t>(1, chunks * P / (16 * at::get_num_threads()));
  parallel_claim(chunks * P, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t c = t / P, p = t % P;
      const int64_t m0 = c * M_CHUNK, rows = std::min(M_CHUNK, M - m0);
      const int64_t col0 = p * NR, cols = std::min(NR, N - col0);
      rows_times_panel(w, p, xp + m0 * K, K, rows, bp, col0, cols, yp + m0 * N, N);
    }
  });
  return y.view(sizes);
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
  TORCH_CHECK(panels.scalar_type() == at::kFloat, "packed_linear: float32 only");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == NR, "packed_linear: panels must be [P, K, 16]");
  const int64_t K = panels.size(1);
  return run_linear("packed_linear", x, F32Panels{panels.data_ptr<float>(), K}, panels.size(0), K, N, bias);
}

// The weights a q4 panel set stands for, [N, K] float32, rebuilt as the kernel
// rebuilds them (for checking a packing bit for bit).
at::Tensor q4_unpack(const at::Tensor& blocks, int64_t N) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3 && blocks.size(2) == Q4_BLOCK_BYTES,
              "q4_unpack: blocks must be uint8 [P, K/32, 384]");
  const int64_t P = blocks.size(0), K = blocks.size(1) * QB;
  auto w = at::empty({P * NR, K}, blocks.options().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* wp = w.data_ptr<float>();
  for (int64_t p = 0; p < P; ++p)
    for (int64_t kb = 0; kb < K / QB; ++kb) {
      const uint8_t* blk = bp + (p * (K / QB) + kb) * Q4_BLOCK_BYTES;
      const float* dm = reinterpret_cast<const float*>(blk);
      const uint8_t* q = blk + 2 * NR * 4;
      for (int64_t kk = 0; kk < QB; ++kk)
        for (int64_t j = 0; j < NR; ++j) {
          const uint8_t byte = q[kk * 8 + (j % 8)];
          const int qv = j < 8 ? (byte & 0x0F) : (byte >> 4);
          volatile float prod = static_cast<float>(qv) * dm[j];  // no contraction: mul, round, add
          wp[(p * NR + j) * K + kb * QB + kk] = prod + dm[NR + j];
        }
    }
  return w.narrow(0, 0, N);
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3 && blocks.size(2) == Q4_BLOCK_BYTES,
              "q4_linear: blocks must be uint8 [P, K/32, 384]");
  const int64_t K = blocks.size(1) * QB;
  return run_linear("q4_linear", x, Q4Panels{blocks.data_ptr<uint8_t>(), K}, blocks.size(0), K, N, bias);
}

// ---- the small ops around the projections, fused (float32, any row count) ----
//
// Per decode step a 30-layer model runs some 400 tiny torch ops (norms, rope,
// the KV write); at a few rows each costs more in dispatch than in arithmetic.

// out = rms_norm(x) * w, rows of x independent.  With `residual`: residual += x
// first (in place) and the norm is of the sum, as a pre-norm block's
// "x = x + f(x); h = norm(x)" does.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps,
                    const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "rms_norm: float32 only");
  const int64_t H = x.size(-1);
  TORCH_CHECK(w.numel() == H, "rms_norm: weight has ", w.numel(), " elements, rows ", H);
  const auto xc = x.contiguous();
  const auto wc = w.contiguous();
  const int64_t T = xc.numel() / H;
  float* res = nullptr;
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->is_contiguous() && residual->scalar_type() == at::kFloat &&
                residual->numel() == xc.numel(), "rms_norm: residual must be a contiguous float32 like x");
    res = residual->data_ptr<float>();
  }
  auto out = at::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * H;
      float* rr = res ? res + t * H : nullptr;
      if (rr) {
        for (int64_t i = 0; i < H; ++i) rr[i] += xr[i];
        xr = rr;
      }
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + feps);
      float* o = op + t * H;
      for (int64_t i = 0; i < H; ++i) o[i] = wp[i] * (xr[i] * inv);
    }
  });
  return out;
}

// The attention block's input side for T new tokens: rotate q and k (rotate-half
// rope with cos/sin [T, D/2]), store k and v in the paged cache at
// slot_mapping[t]; return the rotated q [T, Hq, D] and k [T, Hkv, D].
//   qkv: [T, (Hq + 2 Hkv) D]   kv_cache: [blocks, layers, 2, block_size, Hkv, D]
std::tuple<at::Tensor, at::Tensor> rope_and_store_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                             at::Tensor& kv_cache, int64_t layer, const at::Tensor& slot_mapping,
                             int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat &&
              cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rope_and_store_kv: float32 only");
  TORCH_CHECK(kv_cache.is_contiguous(), "rope_and_store_kv: the KV cache must be contiguous");
  const int64_t D = kv_cache.size(5), half = D / 2, bs = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == num_kv_heads, "rope_and_store_kv: KV heads do not match the cache");
  const auto qc = qkv.contiguous();
  const int64_t T = qc.size(0), W = (num_heads + 2 * num_kv_heads) * D;
  TORCH_CHECK(qc.dim() == 2 && qc.size(1) == W, "rope_and_store_kv: qkv must be [T, ", W, "]");
  const auto cc = cos.reshape({T, half}).contiguous();
  const auto sc = sin.reshape({T, half}).contiguous();
  const auto slots = slot_mapping.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == T, "rope_and_store_kv: one slot per token");
  auto q = at::empty({T, num_heads, D}, qc.options());
  auto k_out = at::empty({T, num_kv_heads, D}, qc.options());
  float* kp = k_out.data_ptr<float>();
  const float* src = qc.data_ptr<float>();
  const float* cp = cc.data_ptr<float>();
  const float* sp = sc.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  float* cache = kv_cache.data_ptr<float>();
  const int64_t s_blk = kv_cache.stride(0), s_lyr = kv_cache.stride(1), s_kv = kv_cache.stride(2),
                s_tok = kv_cache.stride(3);
  const int64_t num_slots = kv_cache.size(0) * bs;
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "rope_and_store_kv: slot ", slot[t], " out of range");
  auto rotate = [half](const float* x, const float* c, const float* s, float* out) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      out[i] = a * c[i] - b * s[i];
      out[i + half] = b * c[i] + a * s[i];
    }
  };
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = src + t * W;
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      for (int64_t h = 0; h < num_heads; ++h) rotate(row + h * D, c, s, qp + (t * num_heads + h) * D);
      const int64_t blk = slot[t] / bs, off = slot[t] % bs;
      float* kdst = cache + blk * s_blk + layer * s_lyr + off * s_tok;
      float* vdst = kdst + s_kv;
      const float* k = row + num_heads * D;
      const float* v = k + num_kv_heads * D;
      float* kr = kp + t * num_kv_heads * D;
      for (int64_t h = 0; h < num_kv_heads; ++h) rotate(k + h * D, c, s, kr + h * D);
      std::memcpy(kdst, kr, num_kv_heads * D * sizeof(float));
      std::memcpy(vdst, v, num_kv_heads * D * sizeof(float));
    }
  });
  return {q, k_out};
}

// silu(gate) * up for gate_up = [gate | up] along the last dimension.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat, "silu_and_mul: float32 only");
  const auto gc = gate_up.contiguous();
  const int64_t I = gc.size(-1) / 2, T = gc.numel() / (2 * I);
  auto sizes = gc.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, gc.options());
  const float* gp = gc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gp + t * 2 * I;
      const float* u = g + I;
      float* o = op + t * I;
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, "pack a [N, K] float32 weight into [N/16, K, 16] panels");
  m.def("packed_linear", &packed_linear, "x @ W.T (+ bias) with a packed weight",
        pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none());
  m.def("q4_linear", &q4_linear, "x @ W.T (+ bias) with W held as exact 4-bit blocks",
        pybind11::arg("x"), pybind11::arg("blocks"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none());
  m.def("q4_unpack", &q4_unpack, "the float32 weights q4 blocks stand for");
  m.def("rms_norm", &rms_norm, "RMSNorm of the rows (after residual += x when a residual is given)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("residual") = pybind11::none());
  m.def("rope_and_store_kv", &rope_and_store_kv, "rope on q and k, k and v into the paged cache; returns q, k");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
}
