// Float32 linear layers for CPUs with the weights packed once at load time.
//
// The BLAS behind torch repacks the weight matrix on every call, which costs
// as much as the multiply itself when the batch is a few decode rows: on two
// AVX2 cores a 2-row GEMM took 5x as long as a 1-row one.  Packing the weight
// into panels of 16 output columns lets each call stream every weight exactly
// once per block of rows, for any row count.  Three formats of a panel:
//
//   pack_weight(w [N, K])  -> float32 panels [ceil(N/16), K, 16]
//   q4 blocks (GGUF Q4_1, exact) [P, K/32, 384]; q8 blocks (Q8_0, exact) [P, K/32, 576]
//   packed_linear / q4_linear / q8_linear(x [M, K], panels, N, bias or None) -> y [M, N]
//   q4i8_linear / q8i8_linear: the same blocks times x quantized to int8 (decode_dtype=int8)
//
// The micro-kernels live in linear_isa.h, compiled once per instruction set
// (linear_isa_{scalar,avx2,avx512}.cpp); the set is picked at run time from
// the CPU (isa(), set_isa(), supported_isas()), and every set gives the same bits.
//
// Also the small float32 ops between the projections, fused (rms_norm,
// rope_and_store_kv, silu_and_mul).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "amx_tiles.h"
#include "bf16_round.h"
#include "parallel_claim.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <atomic>
#include <cstdlib>
#include <immintrin.h>
#include <limits>
#if defined(__x86_64__)
#include <cpuid.h>
#endif
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "linear_isa_api.h"
#include "linear_ops.h"

using namespace splitserve_linear;

void norm_row(const float* xr, float* rr, const float* w, int64_t H, float eps, float* o);

namespace {

constexpr int64_t M_CHUNK = 192; // rows of x kept hot while the panels stream past

// ---- which instruction set runs the projections ----
//
// Chosen once from the CPU (or SPLITSERVE_LINEAR_ISA=scalar|avx2|avx512);
// set_isa() switches it so tests can compare every path the machine has.
bool isa_supported(const std::string& name) {
  if (name == "scalar") return true;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (name == "avx2") return avx2;
  if (name == "avx512")
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
#endif
  return false;
}

const IsaKernels* isa_table(const std::string& name) {
  if (name == "avx512") return &kAvx512Kernels;
  if (name == "avx2") return &kAvx2Kernels;
  if (name == "scalar") return &kScalarKernels;
  return nullptr;
}

const IsaKernels* best_isa() {
  const char* env = std::getenv("SPLITSERVE_LINEAR_ISA");
  if (env && *env) {
    TORCH_CHECK(isa_table(env) && isa_supported(env), "SPLITSERVE_LINEAR_ISA=", env,
                ": not one of scalar, avx2, avx512 that this CPU runs");
    return isa_table(env);
  }
  for (const char* name : {"avx512", "avx2"})
    if (isa_supported(name)) return isa_table(name);
  return &kScalarKernels;
}

std::atomic<const IsaKernels*> g_isa{nullptr};

const IsaKernels& isa() {
  const IsaKernels* k = g_isa.load(std::memory_order_acquire);
  if (!k) {
    k = best_isa();
    g_isa.store(k, std::memory_order_release);
  }
  return *k;
}

// One weight format: its per-ISA kernel and where panel p's storage starts.
struct Panels {
  RowsTimesPanels kernel;
  const uint8_t* base;
  int64_t panel_bytes;
  bool block_sums = false;  // the kernel wants sums of x per block (q4)
  bool bf16_pairs = false;  // the kernel wants x as bfloat16 pairs (bf16 panels)
  bool bf16_rows = false;   // the kernel wants x as plain bfloat16 rows, padded to AMX_ROWS (AMX)
  // Set: the panels are a gate projection's then an up projection's (half
  // each), and the call's output silu(gate) * up (N / 2 outputs) through this
  // kernel in place of `kernel` (AMX or vdpbf16ps).
  SiluPanelRows silu = nullptr;
  // Set: the call's result is each row's argmax through this kernel in place
  // of `kernel` (vdpbf16ps), its outputs never written (run_linear's `best`).
  ArgmaxPanelRows argmax = nullptr;
};

using splitserve_bf16::round_bits;

// Rows of x [rows, K] -> bfloat16 pairs (x[2 kp] low, x[2 kp + 1] high), as
// the bf16 kernel reads them: in tiles of BF_TILE_ROWS rows, row r's pair kp
// at [kp * BF_TILE_ROWS + r] (rows past the last row are never read: the
// kernel runs as many rows as the tile has).
inline uint32_t bf16_pair(const float* x) { return round_bits(x[0]) | (uint32_t{round_bits(x[1])} << 16); }

// 16 floats' round_bits in the low halves of their lanes.
__attribute__((target("avx512f,avx512bw"))) inline __m512i round16(const float* x) {
  const __m512i u = _mm512_loadu_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
  const __mmask16 nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC0));
}

// A row of K floats as K / 2 pairs into out, 16 pairs at a time (CPUs with AVX512-BF16).
__attribute__((target("avx512f,avx512bw"))) void bf16_pair_row(const float* x, int64_t K, uint32_t* out) {
  int64_t kp = 0;
  for (; kp + 16 <= K / 2; kp += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + kp), _mm512_cvtepi32_epi16(round16(x + 2 * kp)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + kp + 8), _mm512_cvtepi32_epi16(round16(x + 2 * kp + 16)));
  }
  for (; kp < K / 2; ++kp) out[kp] = bf16_pair(x + 2 * kp);
}

// Each CPU with AVX512-BF16 has AVX-512 BW: 16 pairs of a row at a time, the
// two halves of each packed by vpmovdw and scattered to their rows of the
// tile.  A decode step of 32 rows (four projections in 30 layers) spent 3% of
// a Zen 5's time converting them a value at a time.
__attribute__((target("avx512f,avx512bw"))) void bf16_tile_pairs(const float* x, int64_t rows, int64_t K,
                                                                 uint32_t* tile) {
  const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi32(BF_TILE_ROWS));
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * K;
    int64_t kp = 0;
    for (; kp + 16 <= K / 2; kp += 16) {
      const __m256i lo = _mm512_cvtepi32_epi16(round16(xr + 2 * kp));  // pairs kp .. kp + 7
      const __m256i hi = _mm512_cvtepi32_epi16(round16(xr + 2 * kp + 16));
      _mm512_i32scatter_epi32(tile + kp * BF_TILE_ROWS + r, at,
                              _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), 4);
    }
    for (; kp < K / 2; ++kp) tile[kp * BF_TILE_ROWS + r] = bf16_pair(xr + 2 * kp);
  }
}

// s[i, b] = x[i, 32 b] + x[i, 32 b + 1] + ... in that order, for every row
// and block: fast-math off here, so the sums come out the same everywhere.
__attribute__((optimize("no-fast-math"))) void block_sums(const float* x, int64_t rows, int64_t K, float* s) {
  for (int64_t i = 0; i < rows * (K / QB); ++i) {
    const float* v = x + i * QB;
    float acc = v[0];
    for (int64_t k = 1; k < QB; ++k) acc += v[k];
    s[i] = acc;
  }
}

// A linear call's operands, checked: x as [M, K] rows, y [M, N] (`out` or
// new), the bias (or none), and the shape y takes back (x's, N features).
struct LinearCall {
  at::Tensor x2, y, bias;
  std::vector<int64_t> sizes;
  int64_t M;
  const float* bp() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
};

// width: x's features when they are not the weight's K (a prologue's input, 2 K for silu_mul).
// outputs: y's columns when they are not N (silu(gate) * up: N / 2).
// rows16: x may hold bfloat16 rows (AMX reads them as they are); y_type: y's dtype.
LinearCall linear_call(const char* name, const at::Tensor& x, int64_t P, int64_t K, int64_t N,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& out,
                       int64_t width = 0, int64_t outputs = 0, bool rows16 = false,
                       at::ScalarType y_type = at::kFloat) {
  if (width == 0) width = K;
  if (outputs == 0) outputs = N;
  TORCH_CHECK(x.scalar_type() == at::kFloat || (rows16 && x.scalar_type() == at::kBFloat16), name,
              rows16 ? ": float32 or bfloat16 activations only" : ": float32 activations only");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == width, name, ": x has ", x.dim() ? x.size(-1) : 0, " features, ",
              width == K ? "the weight " : "want ", width);
  TORCH_CHECK(P * NR >= N && (P - 1) * NR < N, name, ": N does not match the panels");
  LinearCall c;
  c.x2 = x.reshape({-1, width}).contiguous();
  c.M = c.x2.size(0);
  c.sizes = x.sizes().vec();
  c.sizes.back() = outputs;
  if (out.has_value() && out->defined()) {  // rows of a bigger output (a step's rows split between paths)
    c.y = *out;
    TORCH_CHECK(c.y.scalar_type() == at::kFloat && c.y.dim() == 2 && c.y.size(0) == c.M &&
                    c.y.size(1) == outputs && c.y.stride(1) == 1 && c.y.stride(0) == outputs,
                name, ": out must be a contiguous [", c.M, ", ", outputs, "] float32 tensor");
  } else {
    c.y = at::empty({c.M, outputs}, c.x2.options().dtype(y_type));
  }
  if (bias.has_value() && bias->defined()) {
    c.bias = bias->contiguous();
    TORCH_CHECK(c.bias.scalar_type() == at::kFloat && c.bias.numel() == N, name, ": bias must be [N] float32");
  }
  return c;
}

// fn(m0, rows, p, np, cols) for each task of a linear call of M rows and P
// panels (N outputs): a row chunk (M_CHUNK rows from m0) times a group of up to
// G panels (np from panel p, cols outputs), chunk-major, so a thread walks
// panels while its rows stay in cache and each panel is read once per chunk.
// claimed(): after each piece of tasks a thread claimed, on that thread.
template <typename Fn, typename Claimed = void (*)()>
void each_task(int64_t M, int64_t P, int64_t N, int64_t G, const Fn& fn, const Claimed& claimed = [] {}) {
  const int64_t chunks = (M + M_CHUNK - 1) / M_CHUNK, groups = (P + G - 1) / G;
  // About 16 claims per thread: small enough to even out a preempted thread,
  // large enough that claiming costs nothing.
  const int64_t grain = std::max<int64_t>(1, chunks * groups / (16 * at::get_num_threads()));
  parallel_claim(chunks * groups, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t c = t / groups, p = (t % groups) * G, np = std::min(G, P - p), m0 = c * M_CHUNK;
      fn(m0, std::min(M_CHUNK, M - m0), p, np, std::min(np * NR, N - p * NR));
    }
    claimed();
  });
}

// best[i] = max(best[i], key) for another thread's keys too (a lock-free max).
void raise_key(std::atomic<uint64_t>& best, uint64_t key) {
  uint64_t now = best.load(std::memory_order_relaxed);
  while (key > now && !best.compare_exchange_weak(now, key, std::memory_order_relaxed)) {
  }
}

// What a bfloat16 projection does to its rows before it rounds them to
// bfloat16, in place of a separate kernel call and the float32 copy between:
// rms_norm (with its residual add) ahead of the qkv and gate/up projections,
// silu(gate) * up ahead of the down projection.  Either gives the bits the
// separate call (rms_norm, silu_and_mul) would have.
struct RowPrologue {
  const float* norm_w = nullptr;  // rows normed with these weights (and eps)
  float eps = 0.f;
  float* residual = nullptr;  // with norm_w: residual += x first, the norm is of the sum
  bool silu_mul = false;  // x is [M, 2 K]: gate, then up
  bool any() const { return norm_w != nullptr || silu_mul; }
};

// A row of x after the prologue (row t of the call's rows, x's row at `row`):
// into `in` (K floats), or the row itself when there is none.
const float* prologue_row(const RowPrologue& pro, const float* row, int64_t t, int64_t K, float* in) {
  if (!pro.any()) return row;
  if (pro.silu_mul) isa().silu_mul(row, K, 1, in);
  else norm_row(row, pro.residual ? pro.residual + t * K : nullptr, pro.norm_w, K, pro.eps, in);
  return in;
}

// y = x @ W.T (+ bias) for W in P panels of K inputs, N outputs; checks done
// by the caller but for x and bias.
// A prologue (bfloat16 rows only) runs on each row before it is rounded.
// w.argmax: instead of y, each row's argmax_key into `best` (M of them), no bias.
at::Tensor run_linear(const char* name, const at::Tensor& x, const Panels& w, int64_t P, int64_t K, int64_t N,
                      const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& out,
                      const RowPrologue& pro = {}, std::atomic<uint64_t>* best = nullptr) {
  TORCH_CHECK(w.argmax == nullptr || (best != nullptr && w.bf16_pairs && w.silu == nullptr && !bias.has_value()),
              name, ": an argmax needs vdpbf16ps's bfloat16 pairs and no bias");
  TORCH_CHECK(!pro.any() || w.bf16_pairs || w.bf16_rows, name, ": a prologue needs bfloat16 rows");
  TORCH_CHECK(w.silu == nullptr || ((w.bf16_rows || w.bf16_pairs) && P % 2 == 0 && N == P * NR && !bias.has_value()),
              name, ": silu(gate) * up needs bfloat16 rows, whole panels for gate and for up, and no bias");
  const bool rows16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(!rows16 || (w.bf16_rows && !pro.any()), name, ": bfloat16 rows only on AMX tiles, without a prologue");
  // AMX's silu(gate) * up comes out as the bfloat16 rows the next projection's tiles read (rows16).
  // An argmax's y: one column per row, never written.
  const LinearCall call = linear_call(name, x, P, K, N, bias, out, pro.silu_mul ? 2 * K : K,
                                      w.silu ? N / 2 : w.argmax ? 1 : N, w.bf16_rows,
                                      w.silu && w.bf16_rows ? at::kBFloat16 : at::kFloat);
  const at::Tensor &x2 = call.x2, &y = call.y;
  const int64_t M = call.M;
  if (M == 0) return y.view(call.sizes);
  const float* bp = call.bp();
  const float* xp = reinterpret_cast<const float*>(x2.data_ptr());
  int64_t ldx = K;
  at::Tensor pairs;
  // Rows past `whole` come from `tail` (rows16: x's last partial tile of rows, zero-padded).
  int64_t whole = M;
  const float* tail = nullptr;
  if (rows16) {
    // bfloat16 rows, already rounded (the bits kAmxPlainRows would write): the
    // tiles read them in place, but for the last AMX_ROWS rows' worth past the
    // last whole tile, copied into a tile of their own after which zero rows.
    TORCH_CHECK(K % 2 == 0, name, ": K must be even");
    ldx = K / 2;
    whole = M / AMX_ROWS * AMX_ROWS;
    if (whole < M) {
      pairs = at::zeros({AMX_ROWS, K / 2}, x2.options().dtype(at::kInt));
      std::memcpy(pairs.data_ptr(), xp + whole * ldx, (M - whole) * K * 2);
      tail = reinterpret_cast<const float*>(pairs.data_ptr());
    }
  } else if (w.bf16_pairs || w.bf16_rows) {
    // The kernel reads uint32 pairs through the same pointer (4 bytes each), in
    // tiles of T rows: tile t at t * T * K / 2, so row m of a tile's start is
    // at m * K / 2, as for a row-major x of K / 2 a row.  vdpbf16ps's tiles
    // hold their pairs pair-major (bf16_tile_pairs), AMX's as plain rows, with
    // zero rows after the last up to a whole tile (AMX loads T rows at a time).
    TORCH_CHECK(K % 2 == 0, name, ": K must be even");
    static_assert(M_CHUNK % BF_TILE_ROWS == 0 && M_CHUNK % AMX_ROWS == 0, "row chunks start on a tile");
    const int64_t T = w.bf16_pairs ? BF_TILE_ROWS : AMX_ROWS, tiles = (M + T - 1) / T;
    const auto convert = w.bf16_pairs ? bf16_tile_pairs : kAmxPlainRows;  // AMX's plain rows
    pairs = at::empty({tiles * T, K / 2}, x2.options().dtype(at::kInt));
    uint32_t* pp = reinterpret_cast<uint32_t*>(pairs.data_ptr<int32_t>());
    std::memset(pp + M * (K / 2), 0, (tiles * T - M) * (K / 2) * sizeof(uint32_t));
    const int64_t width = x2.size(1);
    parallel_claim(tiles, 1, [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> in;  // a tile's rows after the prologue
      for (int64_t t = begin; t < end; ++t) {
        const int64_t rows = std::min(T, M - t * T);
        const float* tile = xp + t * T * width;
        if (pro.any()) {
          in.resize(static_cast<size_t>(T * K));
          for (int64_t r = 0; r < rows; ++r)
            prologue_row(pro, xp + (t * T + r) * width, t * T + r, K, in.data() + r * K);
          tile = in.data();
        }
        convert(tile, rows, K, pp + t * T * (K / 2));
      }
    });
    xp = reinterpret_cast<const float*>(pp);
    ldx = K / 2;
  }
  float* yp = w.silu && w.bf16_rows ? nullptr : y.data_ptr<float>();
  // fn(x of row m, m, rows) for rows [m0, m0 + rows): x in place up to `whole`, the tail after.
  auto by_rows = [&](int64_t m0, int64_t rows, auto&& fn) {
    const int64_t split = std::clamp(whole, m0, m0 + rows);
    if (split > m0) fn(xp + m0 * ldx, m0, split - m0);
    if (split < m0 + rows) fn(tail, split, m0 + rows - split);  // split == whole: the tail's first row
  };
  // The factored q4 format wants each row's sum of x per block of 32 inputs,
  // added in order (one fixed order for every row count and instruction set).
  const int64_t KB = K / QB;
  at::Tensor xs;
  const float* xsp = nullptr;
  if (w.block_sums) {
    xs = at::empty({M, KB}, x2.options());
    block_sums(xp, M, K, xs.data_ptr<float>());
    xsp = xs.data_ptr<float>();
  }
  // Few rows are bound by reading the weights.  With vdpbf16ps (up to 8
  // rows) or the AVX-512 set (up to 4) a task is then one panel, so that a
  // thread reads its share of the panels in memory order (parallel_claim.h):
  // on a Zen 4 (family 25 model 17) a float32 model's decode step of one
  // sequence 0.96-1.00x the time, of 4 0.95x; under bfloat16-weights 0.97x at
  // one and 4, 0.95x at 8.
  // Else up to 4 rows a task is 4 panels (the kernel interleaves as many as
  // its set's registers hold: the AVX2 set, whose step was no faster with one;
  // AMX).  More rows of a 4-bit layer take panels 2 at a time: past one row
  // tile (MR rows) the kernel decodes a pair once and reads it together in
  // every tile (AVX-512; one panel at a time elsewhere); up to MR rows it
  // reads each panel's blocks in turn.  Other formats: 1 panel.
  const bool one_panel = !w.bf16_rows && ((w.bf16_pairs && M <= 8) || (M <= 4 && &isa() == &kAvx512Kernels));
  const int64_t G = one_panel ? 1
                    : M <= 4 ? 4
                    : w.bf16_rows && M >= M_CHUNK && K <= AMX_HELD_K ? AMX_PANELS
                    : (w.block_sums || w.bf16_pairs || w.bf16_rows ? 2 : 1);
  if (w.silu) {  // gate's panels (the first half) as tasks, each with up's panels as far on
    const int64_t half = P / 2, I = N / 2, esize = y.element_size();
    char* out = static_cast<char*>(y.data_ptr());
    each_task(M, half, I, G, [&](int64_t m0, int64_t rows, int64_t p, int64_t np, int64_t cols) {
      w.silu(w.base + p * w.panel_bytes, w.panel_bytes, half * w.panel_bytes, np, K, xp + m0 * ldx, ldx, rows,
             p * NR, cols, out + m0 * I * esize, I);
    });
    return y.view(call.sizes);
  }
  if (w.argmax) {  // each thread's best keys over its pieces, raised into `best` after each piece
    // A thread's keys, of the call it last took a piece of (zeroed when it takes one of another).
    struct Mine {
      uint64_t call = 0;
      std::vector<uint64_t> best;
    };
    static std::atomic<uint64_t> calls{0};
    const uint64_t this_call = calls.fetch_add(1, std::memory_order_relaxed) + 1;
    thread_local Mine mine;
    each_task(
        M, P, N, G,
        [&](int64_t m0, int64_t rows, int64_t p, int64_t np, int64_t cols) {
          if (mine.call != this_call) {
            mine.call = this_call;
            mine.best.assign(static_cast<size_t>(M), 0);
          }
          w.argmax(w.base + p * w.panel_bytes, w.panel_bytes, np, K, xp + m0 * ldx, ldx, rows, p * NR, cols,
                   mine.best.data() + m0);
        },
        [&] {
          for (int64_t i = 0; i < M; ++i)
            if (mine.best[i] != 0) raise_key(best[i], std::exchange(mine.best[i], 0));
        });
    return y.view(call.sizes);
  }
  each_task(M, P, N, G, [&](int64_t m0, int64_t rows, int64_t p, int64_t np, int64_t cols) {
    by_rows(m0, rows, [&](const float* xm, int64_t m, int64_t r) {
      w.kernel(w.base + p * w.panel_bytes, w.panel_bytes, np, K, xm, ldx, xsp ? xsp + m * KB : nullptr, KB, r, bp,
               p * NR, cols, yp + m * N, N);
    });
  });
  return y.view(call.sizes);
}

}  // namespace

at::Tensor pack_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "pack_weight: want a 2-D float32 weight");
  const auto wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), P = (N + NR - 1) / NR;
  auto out = at::zeros({P, K, NR}, wc.options());
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  parallel_claim(P, 1, [&](int64_t begin, int64_t end) {
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
                         const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& out) {
  TORCH_CHECK(panels.scalar_type() == at::kFloat, "packed_linear: float32 only");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == NR, "packed_linear: panels must be [P, K, 16]");
  const int64_t K = panels.size(1);
  const Panels w{isa().f32, reinterpret_cast<const uint8_t*>(panels.data_ptr<float>()), K * NR * 4};
  return run_linear("packed_linear", x, w, panels.size(0), K, N, bias, out);
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
          const int qv = q4_value(q + kk / 8 * 64, static_cast<int>(kk % 8), static_cast<int>(j));
          volatile float prod = static_cast<float>(qv) * dm[j];  // no contraction: mul, round, add
          wp[(p * NR + j) * K + kb * QB + kk] = prod + dm[NR + j];
        }
    }
  return w.narrow(0, 0, N);
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const c10::optional<at::Tensor>& bias,
                     const c10::optional<at::Tensor>& out) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3 && blocks.size(2) == Q4_BLOCK_BYTES,
              "q4_linear: blocks must be uint8 [P, K/32, 384]");
  const int64_t K = blocks.size(1) * QB;
  const Panels w{isa().q4, blocks.data_ptr<uint8_t>(), (K / QB) * Q4_BLOCK_BYTES, true};
  return run_linear("q4_linear", x, w, blocks.size(0), K, N, bias, out);
}

// ---- int8 rows (decode_dtype=int8): generated tokens times 4- and 8-bit blocks ----

bool i8_vnni_supported() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return isa_supported("avx512") && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
#else
  return false;
#endif
}

// The kernels q4i8_linear and q8i8_linear run: the VNNI ones where the CPU has
// them and the projections run on AVX-512 (set_isa can turn them off to
// compare), else the set's own.
bool use_vnni() {
  static const bool vnni = i8_vnni_supported();
  return vnni && &isa() == &kAvx512Kernels;
}

// A linear call on weight blocks, 4-bit or (q8) 8-bit: the blocks checked,
// the call set up, and the bytes of one panel of them.
struct BlocksCall {
  LinearCall call;
  int64_t P, K, pbytes;
};

BlocksCall blocks_call(const char* name, const at::Tensor& x, const at::Tensor& blocks, bool q8, int64_t N,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& out,
                       int64_t widen = 1) {
  const int64_t block_bytes = q8 ? Q8_BLOCK_BYTES : Q4_BLOCK_BYTES;
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3 && blocks.size(2) == block_bytes, name,
              ": blocks must be uint8 [P, K/32, ", block_bytes, "]");
  const int64_t P = blocks.size(0), K = blocks.size(1) * QB;
  return {linear_call(name, x, P, K, N, bias, out, widen * K), P, K, blocks.size(1) * block_bytes};
}

// y = x @ W.T (+ bias) for W in 4-bit (q8 false) or 8-bit blocks, x quantized
// to int8 first (linear_isa_api.h), after the prologue's norm or silu_mul if
// any: each row as it is quantized, in the same pass over the rows.
at::Tensor int8_linear(const char* name, const at::Tensor& x, const at::Tensor& blocks, bool q8, int64_t N,
                       const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& out,
                       const RowPrologue& pro = {}) {
  const BlocksCall bc = blocks_call(name, x, blocks, q8, N, bias, out, pro.silu_mul ? 2 : 1);
  const LinearCall& call = bc.call;
  const int64_t P = bc.P, K = bc.K, KB = K / QB, pbytes = bc.pbytes;
  const at::Tensor &x2 = call.x2, &y = call.y;
  const int64_t M = call.M;
  if (M == 0) return y.view(call.sizes);
  const float* bp = call.bp();
  auto xq = at::empty({M, K}, x2.options().dtype(at::kChar));
  auto scales = at::empty({3, M, KB}, x2.options());  // dx, sx, and xc (int32) for 8-bit blocks
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* dxp = scales.data_ptr<float>();
  float* sxp = dxp + M * KB;
  int32_t* xcp = reinterpret_cast<int32_t*>(sxp + M * KB);
  const float* xp = x2.data_ptr<float>();
  const QuantizeI8 quantize = isa().quantize_i8;
  const int64_t width = x2.size(1);
  parallel_claim(M, 4, [&](int64_t begin, int64_t end) {
    if (pro.any()) {
      thread_local std::vector<float> in;  // a row after the prologue
      in.resize(static_cast<size_t>(K));
      for (int64_t t = begin; t < end; ++t)
        quantize(prologue_row(pro, xp + t * width, t, K, in.data()), KB, xqp + t * K, dxp + t * KB, sxp + t * KB);
    } else {
      quantize(xp + begin * K, (end - begin) * KB, xqp + begin * K, dxp + begin * KB, sxp + begin * KB);
    }
    if (q8)
      for (int64_t i = begin * KB; i < end * KB; ++i) {
        int32_t c = 0;
        for (int64_t k = 0; k < QB; ++k) c += xqp[i * QB + k];
        xcp[i] = c;
      }
  });
  const bool vnni = use_vnni();
  const Q4I8Rows k4 = vnni ? kQ4I8Vnni : isa().q4i8;
  const Q8I8Rows k8 = vnni ? kQ8I8Vnni : isa().q8i8;
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // Groups of panels as the VNNI kernels take them: up to 16 rows one at a
  // time, in memory order (linear_isa.h's i8_few_rows); more rows decode 2 at
  // a time, and tasks of 2 even out the two threads' shares of a small layer
  // (1.05-1.1x at 32 rows, Zen 4).  The other sets' int8 kernels: 4.
  const int64_t G = vnni && M > 16 ? 2 : 4;
  each_task(M, P, N, G, [&](int64_t m0, int64_t rows, int64_t p, int64_t np, int64_t cols) {
    if (q8)
      k8(wp + p * pbytes, pbytes, np, K, xqp + m0 * K, K, dxp + m0 * KB, xcp + m0 * KB, KB, rows, bp, p * NR, cols,
         yp + m0 * N, N);
    else
      k4(wp + p * pbytes, pbytes, np, K, xqp + m0 * K, K, dxp + m0 * KB, sxp + m0 * KB, KB, rows, bp, p * NR, cols,
         yp + m0 * N, N);
  });
  return y.view(call.sizes);
}

at::Tensor q4i8_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& out) {
  return int8_linear("q4i8_linear", x, blocks, false, N, bias, out);
}

at::Tensor q8i8_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& out) {
  return int8_linear("q8i8_linear", x, blocks, true, N, bias, out);
}

// The weights q8 blocks stand for, [N, K] float32 (for checking a packing).
at::Tensor q8_unpack(const at::Tensor& blocks, int64_t N) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3 && blocks.size(2) == Q8_BLOCK_BYTES,
              "q8_unpack: blocks must be uint8 [P, K/32, 576]");
  const int64_t P = blocks.size(0), K = blocks.size(1) * QB;
  auto w = at::empty({P * NR, K}, blocks.options().dtype(at::kFloat));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* wp = w.data_ptr<float>();
  for (int64_t p = 0; p < P; ++p)
    for (int64_t kb = 0; kb < K / QB; ++kb) {
      const uint8_t* blk = bp + (p * (K / QB) + kb) * Q8_BLOCK_BYTES;
      const float* d = reinterpret_cast<const float*>(blk);
      const int8_t* q = reinterpret_cast<const int8_t*>(blk + NR * 4);
      for (int64_t kk = 0; kk < QB; ++kk)
        for (int64_t j = 0; j < NR; ++j) wp[(p * NR + j) * K + kb * QB + kk] = d[j] * static_cast<float>(q[kk * NR + j]);
    }
  return w.narrow(0, 0, N);
}

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const c10::optional<at::Tensor>& bias,
                     const c10::optional<at::Tensor>& out) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3 && blocks.size(2) == Q8_BLOCK_BYTES,
              "q8_linear: blocks must be uint8 [P, K/32, 576]");
  const int64_t K = blocks.size(1) * QB;
  const Panels w{isa().q8, blocks.data_ptr<uint8_t>(), (K / QB) * Q8_BLOCK_BYTES};
  return run_linear("q8_linear", x, w, blocks.size(0), K, N, bias, out);
}

// ---- bfloat16 panels (AVX512-BF16): prompts' rows under prefill_dtype=bfloat16 ----

bool bf16_supported() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return isa_supported("avx512") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// AMX tiles (amx_tile, amx_bf16) for bf16_linear where K is a multiple of
// 32: the CPU has them, Linux lets this process use them (a process asks
// once, ARCH_REQ_XCOMP_PERM), and set_amx has not turned them off.
bool amx_cpu() {
#if defined(__x86_64__)
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!bf16_supported() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    return ((d >> 22) & 1) && ((d >> 24) & 1) && splitserve_amx::tiles_allowed();  // AMX-BF16, AMX-TILE
  }();
  return ok;
#else
  return false;
#endif
}

std::atomic<bool> g_amx{true};

// Tests compare the kernels: off, bf16_linear runs vdpbf16ps everywhere.
bool set_amx(bool on) {
  TORCH_CHECK(!on || amx_cpu(), "set_amx: this CPU (or this kernel) does not run AMX tiles");
  return g_amx.exchange(on);
}

bool use_amx() { return g_amx.load() && amx_cpu(); }

// w [N, K] float32 -> bfloat16 panels [P, K/2, 16, 2] (rounded to nearest even; columns past N zero).
at::Tensor pack_bf16(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.size(1) % 2 == 0,
              "pack_bf16: want a 2-D float32 weight with an even number of inputs");
  const int64_t N = w.size(0), K = w.size(1), P = (N + NR - 1) / NR;
  auto padded = at::zeros({P * NR, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.to(at::kBFloat16).view({P, NR, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// Up to this many rows bf16_q4_linear makes its tiles from the 4-bit blocks
// (bf16_q8_linear from the 8-bit ones):
// few rows are bound by reading the weights, and a block is 6 bits a weight
// against the panels' 16 (Intel Xeon family 6 model 207, 2 cores, the
// weights read from memory: the default model's 120 projections 8.6-9.2
// against 9.7-10.2 ms at 16 rows, 10.8-11.2 against 12.1-12.3 at 32).  Past
// them (a prompt's rows) the panels: a tile would be made again for every
// 32 rows, compute that reading the panels from cache does not need.  Both
// give the same bits.
constexpr int64_t AMX_Q4_MAX_ROWS = 2 * AMX_ROWS;

// Without AMX (vdpbf16ps with AVX512-VBMI: q4bf16_supported), up to this
// many rows (one tile of x) the panels' pairs are made from the blocks
// (kBf16Q4Rows, kBf16Q8Rows): the same bits.  Zen 4 (family 25 model 17, 2
// cores), the default model's 120 projections from memory, panels against
// blocks: 9.5 against 7.8 ms at one row, 10.3 against 8.5 at 4, 13.4
// against 13.1 at 12; past a tile the pairs would be made again for each
// (16 rows: 16.0 against 18.1).
constexpr int64_t BF16_BLOCKS_MAX_ROWS = BF_TILE_ROWS;

bool q4bf16_supported();

bool amx_q4_cpu() {
#if defined(__x86_64__)
  static const bool ok = amx_cpu() && __builtin_cpu_supports("avx512vbmi");
  return ok;
#else
  return false;
#endif
}

// The inputs K of bfloat16 panels [P, K/2, 16, 2], checked (and the CPU).
int64_t bf16_panels_k(const char* name, const at::Tensor& panels) {
  TORCH_CHECK(bf16_supported(), name, ": this CPU lacks AVX512-BF16");
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.dim() == 4 && panels.size(2) == NR &&
                  panels.size(3) == 2 && panels.is_contiguous(),
              name, ": panels must be bfloat16 [P, K/2, 16, 2]");
  return panels.size(1) * 2;
}

// rms_norm's prologue (RowPrologue) for rows of x of K inputs: its weight and
// eps, and the residual stream (like x) added first, if any; checked.
RowPrologue norm_prologue(const char* name, const at::Tensor& x, int64_t K, const at::Tensor& weight, double eps,
                          const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == K, name,
              ": weight must be a contiguous float32 [", K, "]");
  RowPrologue pro;
  pro.norm_w = weight.data_ptr<float>();
  pro.eps = static_cast<float>(eps);
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->is_contiguous() && residual->scalar_type() == at::kFloat &&
                    residual->numel() == x.numel() && x.dim() >= 1 && x.size(-1) == K,
                name, ": residual must be a contiguous float32 like x");
    pro.residual = residual->data_ptr<float>();
  }
  return pro;
}

// The 4- or 8-bit blocks bfloat16 panels [P, K/2, 16, 2] were rounded from,
// checked; -> whether they are 8-bit.
bool check_panels_blocks(const char* name, const at::Tensor& blocks, int64_t P, int64_t K) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3 && blocks.size(0) == P &&
                  blocks.size(1) * QB == K &&
                  (blocks.size(2) == Q4_BLOCK_BYTES || blocks.size(2) == Q8_BLOCK_BYTES) && blocks.is_contiguous(),
              name, ": blocks must be the panels' uint8 [P, K/32, 384] (4-bit) or [P, K/32, 576] (8-bit)");
  return blocks.size(2) == Q8_BLOCK_BYTES;
}

// Up to how many rows bf16_q4_linear and bf16_q8_linear read the blocks
// here and now (AMX as set_amx leaves it, or vdpbf16ps), 0 where they never do.
int64_t blocks_max_rows() {
  if (use_amx()) return amx_q4_cpu() ? AMX_Q4_MAX_ROWS : 0;
  return q4bf16_supported() ? BF16_BLOCKS_MAX_ROWS : 0;
}

// x (after the prologue, if any) times bfloat16 panels [P, K/2, 16, 2]:
// vdpbf16ps, or AMX tiles where they run and K is a multiple of 32.  Given
// the 4- or 8-bit blocks the panels were rounded from, where AMX runs (amx_q4_cpu,
// not turned off by set_amx) and x has up to AMX_Q4_MAX_ROWS rows, each tile
// is made from the blocks instead; without AMX, on vdpbf16ps with
// AVX512-VBMI and up to BF16_BLOCKS_MAX_ROWS rows, each block's pairs
// (blocks_max_rows).  The same bits every way.  gate: the panels are a
// gate's then an up's, and the result silu(gate) * up through the chosen
// kernel's SiluPanelRows (bf16_norm_silu_linear).  best: each row's argmax
// instead, through the kernel's ArgmaxPanelRows (vdpbf16ps only: not where
// AMX runs, bf16_argmax_supported).
at::Tensor bf16_weights_linear(const char* name, const at::Tensor& x, const at::Tensor& panels,
                               const at::Tensor* blocks, int64_t N, const c10::optional<at::Tensor>& bias,
                               const c10::optional<at::Tensor>& out, const RowPrologue& pro = {},
                               bool gate = false, std::atomic<uint64_t>* best = nullptr) {
  const int64_t K = bf16_panels_k(name, panels), P = panels.size(0);  // checked before it is read
  const bool amx = K % QB == 0 && use_amx();
  TORCH_CHECK(best == nullptr || !amx, name, ": no argmax on AMX tiles (bf16_argmax_supported)");
  // bfloat16 rows (bf16_norm_silu_linear's on AMX): read as they are on AMX
  // tiles; elsewhere widened to float32 first (exact), whose rounding gives them back.
  if (x.scalar_type() == at::kBFloat16 && (!amx || pro.any()))
    return bf16_weights_linear(name, x.to(at::kFloat), panels, blocks, N, bias, out, pro, gate, best);
  if (blocks != nullptr) {
    const bool q8 = check_panels_blocks(name, *blocks, P, K);
    const int64_t rows = x.dim() == 0 || x.size(-1) == 0 ? 0 : x.numel() / x.size(-1);
    const int64_t limit = blocks_max_rows();  // K is a multiple of 32 here: amx is use_amx()
    if (limit > 0 && rows <= limit) {
      const uint8_t* bp = blocks->data_ptr<uint8_t>();
      const int64_t pbytes = (K / QB) * blocks->size(2);
      Panels w = amx ? Panels{q8 ? kAmxQ8Rows : kAmxQ4Rows, bp, pbytes, false, false, true}
                     : Panels{q8 ? kBf16Q8Rows : kBf16Q4Rows, bp, pbytes, false, true, false};
      if (gate) w.silu = amx ? (q8 ? kAmxQ8SiluRows : kAmxQ4SiluRows) : (q8 ? kBf16Q8SiluRows : kBf16Q4SiluRows);
      if (best) w.argmax = q8 ? kBf16Q8ArgmaxRows : kBf16Q4ArgmaxRows;
      return run_linear(name, x, w, P, K, N, bias, out, pro, best);
    }
  }
  Panels w{amx ? kAmxBf16Rows : kBf16Rows, reinterpret_cast<const uint8_t*>(panels.data_ptr()), K * NR * 2,
           false, !amx, amx};
  if (gate) w.silu = amx ? kAmxBf16SiluRows : kBf16SiluRows;
  if (best) w.argmax = kBf16ArgmaxRows;
  return run_linear(name, x, w, P, K, N, bias, out, pro, best);
}

bool bf16_argmax_supported() { return bf16_supported() && !use_amx(); }

// torch.argmax(bf16_linear(x, panels, n), -1) (or bf16_q4_linear's or
// bf16_q8_linear's, blocks given: the same bits), without writing the
// outputs: each tile's sums go to their rows' argmax while in cache.  int64
// [rows of x].
at::Tensor bf16_linear_argmax(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                              const c10::optional<at::Tensor>& blocks) {
  const char* name = "bf16_linear_argmax";
  const int64_t M = x.dim() == 0 || x.size(-1) == 0 ? 0 : x.numel() / x.size(-1);
  std::vector<std::atomic<uint64_t>> best(static_cast<size_t>(M));
  for (auto& b : best) b.store(0, std::memory_order_relaxed);
  bf16_weights_linear(name, x, panels, blocks.has_value() ? &*blocks : nullptr, N, c10::nullopt, c10::nullopt, {},
                      false, best.data());
  at::Tensor idx = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; ++i) ip[i] = argmax_col(best[i].load(std::memory_order_relaxed));
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.pop_back();
  return idx.view(sizes);
}

at::Tensor silu_and_mul(const at::Tensor& gate_up);

// silu_and_mul(bf16_norm_linear(x, ...)) for a gate and up projection in one
// weight of N = 2 I outputs: where I is a multiple of 16, each tile of gate's
// and up's sums is gated in cache (SiluPanelRows), the same bits; elsewhere
// the two calls.  On AMX the result is bfloat16 rows, rounded as the down
// projection rounds its input (bf16_linear, bf16_q4_linear and
// bf16_q8_linear read them as they are: the same bits as from the float32
// rows); elsewhere float32.
at::Tensor bf16_norm_silu_linear(const at::Tensor& x, const at::Tensor& panels,
                                 const c10::optional<at::Tensor>& blocks, int64_t N, const at::Tensor& weight,
                                 double eps, const c10::optional<at::Tensor>& residual) {
  const char* name = "bf16_norm_silu_linear";
  const int64_t K = bf16_panels_k(name, panels), P = panels.size(0);
  const RowPrologue pro = norm_prologue(name, x, K, weight, eps, residual);
  TORCH_CHECK(N % 2 == 0, name, ": n must be even (gate's outputs, then up's)");
  const bool whole = N % (2 * NR) == 0 && P * NR == N;  // gate's and up's outputs in panels of their own
  const at::Tensor y = bf16_weights_linear(name, x, panels, blocks.has_value() ? &*blocks : nullptr, N,
                                           c10::nullopt, c10::nullopt, pro, whole);
  return whole ? y : silu_and_mul(y);
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& out) {
  return bf16_weights_linear("bf16_linear", x, panels, nullptr, N, bias, out);
}

// bf16_linear(x, panels), the tiles made from the 4-bit blocks (BITS 4) or
// the 8-bit ones (an 8-bit head: 9 bits a weight read, not 16) where that runs.
template <int BITS>
at::Tensor bf16_blocks_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& blocks, int64_t N,
                              const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& out) {
  const char* name = BITS == 4 ? "bf16_q4_linear" : "bf16_q8_linear";
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == (BITS == 4 ? Q4_BLOCK_BYTES : Q8_BLOCK_BYTES), name,
              ": blocks must be ", BITS, "-bit");
  return bf16_weights_linear(name, x, panels, &blocks, N, bias, out);
}
template at::Tensor bf16_blocks_linear<4>(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                        const OptTensor&, const OptTensor&);
template at::Tensor bf16_blocks_linear<8>(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                        const OptTensor&, const OptTensor&);

// bf16_q4_linear (blocks given) or bf16_linear of rms_norm(x, weight, eps,
// residual), or of silu_and_mul(gate_up): each row normed (or gated) as it is
// rounded, one call, the separate calls' bits.
at::Tensor bf16_norm_linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& blocks,
                            int64_t N, const at::Tensor& weight, double eps,
                            const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& bias) {
  const char* name = "bf16_norm_linear";
  const RowPrologue pro = norm_prologue(name, x, bf16_panels_k(name, panels), weight, eps, residual);
  return bf16_weights_linear(name, x, panels, blocks.has_value() ? &*blocks : nullptr, N, bias, c10::nullopt, pro);
}

at::Tensor bf16_silu_linear(const at::Tensor& gate_up, const at::Tensor& panels,
                            const c10::optional<at::Tensor>& blocks, int64_t N,
                            const c10::optional<at::Tensor>& bias) {
  RowPrologue pro;
  pro.silu_mul = true;
  return bf16_weights_linear("bf16_silu_linear", gate_up, panels, blocks.has_value() ? &*blocks : nullptr, N, bias,
                             c10::nullopt, pro);
}

// ---- 4-bit blocks times bfloat16 rows (AVX512-BF16 + VBMI): generated tokens under decode_dtype=bfloat16 ----

bool q4bf16_supported() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return bf16_supported() && __builtin_cpu_supports("avx512vbmi");
#else
  return false;
#endif
}

// s[i, b] = the sum of row i's block b of bfloat16 pairs as floats, in input
// order (one order for every row count).
__attribute__((optimize("no-fast-math"))) void bf16_block_sums(const uint32_t* x, int64_t rows, int64_t K, float* s) {
  for (int64_t i = 0; i < rows * (K / QB); ++i) {
    const uint32_t* v = x + i * (QB / 2);
    float acc = 0.0f;
    for (int64_t kp = 0; kp < QB / 2; ++kp) {
      const uint32_t lo = v[kp] << 16, hi = v[kp] & 0xFFFF0000u;
      float a, b;
      std::memcpy(&a, &lo, 4);
      std::memcpy(&b, &hi, 4);
      acc = kp == 0 ? a + b : acc + a + b;
    }
    s[i] = acc;
  }
}

// One row of rms_norm: o = w * (x * inv_rms(x)), after x += the row of the
// residual (in place) when there is one.  Out of line, so that rms_norm and
// the projections that norm their rows as they round them (RowPrologue) run
// the same instructions: one result, fused or not.
__attribute__((noinline)) void norm_row(const float* xr, float* rr, const float* w, int64_t H, float eps, float* o) {
  if (rr) {
    for (int64_t i = 0; i < H; ++i) rr[i] += xr[i];
    xr = rr;
  }
  float ss = 0.f;
  for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) o[i] = w[i] * (xr[i] * inv);
}

// y = x @ W.T (+ bias) for W in 4-bit (q8 false) or 8-bit blocks, x rounded to
// bfloat16 first (after the prologue's norm or silu_mul, if any).
at::Tensor bf16_rows_linear(const char* name, const at::Tensor& x, const at::Tensor& blocks, bool q8, int64_t N,
                            const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& out,
                            const RowPrologue& pro = {}) {
  TORCH_CHECK(q4bf16_supported(), name, ": this CPU lacks AVX512-BF16 or AVX512-VBMI");
  const BlocksCall bc = blocks_call(name, x, blocks, q8, N, bias, out, pro.silu_mul ? 2 : 1);
  const LinearCall& call = bc.call;
  const int64_t P = bc.P, K = bc.K, KB = K / QB, pbytes = bc.pbytes;
  const at::Tensor &x2 = call.x2, &y = call.y;
  const int64_t M = call.M;
  if (M == 0) return y.view(call.sizes);
  auto pairs = at::empty({M, K / 2}, x2.options().dtype(at::kInt));
  auto sums = at::empty({q8 ? 0 : M, KB}, x2.options());  // the 4-bit blocks' m term only
  uint32_t* pp = reinterpret_cast<uint32_t*>(pairs.data_ptr<int32_t>());
  float* sp = sums.data_ptr<float>();
  const float* xp = x2.data_ptr<float>();
  const int64_t width = x2.size(1);
  parallel_claim(M, 4, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> in;  // a row after the prologue
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * width;
      if (pro.any()) {
        in.resize(static_cast<size_t>(K));
        row = prologue_row(pro, row, t, K, in.data());
      }
      bf16_pair_row(row, K, pp + t * (K / 2));
    }
    if (!q8) bf16_block_sums(pp + begin * (K / 2), end - begin, K, sp + begin * KB);
  });
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  const float* bp = call.bp();
  float* yp = y.data_ptr<float>();
  const Q4Bf16Rows kernel = q8 ? kQ8Bf16 : kQ4Bf16;
  // The kernel reads a task's panels one at a time.  Up to 8 rows, where the
  // blocks' reads bound it, a task is one panel: a thread's pieces then run
  // through its share of the panels in memory order (parallel_claim.h), one
  // stream its prefetchers follow; 4 panels read together were 4 streams, and
  // on a Zen 4 (family 25 model 17) a bfloat16 model's decode step of one
  // sequence took 0.74-0.77x the time, of 4 0.87-0.90x, of 8 0.96-0.97x.  More
  // rows: tasks of 2 even out the threads better than 1 or 4 (a 576-output
  // projection is 18 tasks, not 9: 1 ms a 32-row step on a Zen 4).
  each_task(M, P, N, M <= 8 ? 1 : 2, [&](int64_t m0, int64_t rows, int64_t p, int64_t np, int64_t cols) {
    kernel(wp + p * pbytes, pbytes, np, K, pp + m0 * (K / 2), K / 2, sp + m0 * KB, KB, rows, bp, p * NR, cols,
           yp + m0 * N, N);
  });
  return y.view(call.sizes);
}

at::Tensor q4bf16_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t N,
                         const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& out) {
  return bf16_rows_linear("q4bf16_linear", x, blocks, false, N, bias, out);
}

at::Tensor q8bf16_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t N,
                         const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& out) {
  return bf16_rows_linear("q8bf16_linear", x, blocks, true, N, bias, out);
}

// Whether blocks are 8-bit (else 4-bit), for the calls that take either; their K.
std::pair<bool, int64_t> blocks_kind(const char* name, const at::Tensor& blocks) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 3 &&
                  (blocks.size(2) == Q4_BLOCK_BYTES || blocks.size(2) == Q8_BLOCK_BYTES),
              name, ": blocks must be uint8 [P, K/32, ", Q4_BLOCK_BYTES, "] (4-bit) or [P, K/32, ", Q8_BLOCK_BYTES,
              "] (8-bit)");
  return {blocks.size(2) == Q8_BLOCK_BYTES, blocks.size(1) * QB};
}

// The linear calls on 4- or 8-bit blocks that take a prologue (bf16_rows_linear, int8_linear).
using BlocksRowsLinear = at::Tensor (*)(const char*, const at::Tensor&, const at::Tensor&, bool, int64_t,
                                        const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&,
                                        const RowPrologue&);

// f of rms_norm(x, weight, eps, residual), the blocks 4- or 8-bit by their size:
// each row normed as f rounds or quantizes it, the same bits.
at::Tensor blocks_norm_linear(BlocksRowsLinear f, const char* name, const at::Tensor& x, const at::Tensor& blocks,
                              int64_t N, const at::Tensor& weight, double eps,
                              const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& bias) {
  const auto [q8, K] = blocks_kind(name, blocks);
  return f(name, x, blocks, q8, N, bias, c10::nullopt, norm_prologue(name, x, K, weight, eps, residual));
}

// f of silu_and_mul(gate_up): gate_up is [.., 2 K].
at::Tensor blocks_silu_linear(BlocksRowsLinear f, const char* name, const at::Tensor& gate_up,
                              const at::Tensor& blocks, int64_t N, const c10::optional<at::Tensor>& bias) {
  RowPrologue pro;
  pro.silu_mul = true;
  return f(name, gate_up, blocks, blocks_kind(name, blocks).first, N, bias, c10::nullopt, pro);
}

at::Tensor bf16_rows_norm_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const at::Tensor& weight,
                                 double eps, const c10::optional<at::Tensor>& residual,
                                 const c10::optional<at::Tensor>& bias) {
  return blocks_norm_linear(bf16_rows_linear, "bf16_rows_norm_linear", x, blocks, N, weight, eps, residual, bias);
}

at::Tensor bf16_rows_silu_linear(const at::Tensor& gate_up, const at::Tensor& blocks, int64_t N,
                                 const c10::optional<at::Tensor>& bias) {
  return blocks_silu_linear(bf16_rows_linear, "bf16_rows_silu_linear", gate_up, blocks, N, bias);
}

at::Tensor int8_norm_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const at::Tensor& weight,
                            double eps, const c10::optional<at::Tensor>& residual,
                            const c10::optional<at::Tensor>& bias) {
  return blocks_norm_linear(int8_linear, "int8_norm_linear", x, blocks, N, weight, eps, residual, bias);
}

at::Tensor int8_silu_linear(const at::Tensor& gate_up, const at::Tensor& blocks, int64_t N,
                            const c10::optional<at::Tensor>& bias) {
  return blocks_silu_linear(int8_linear, "int8_silu_linear", gate_up, blocks, N, bias);
}

std::string isa_name() { return isa().name; }

void set_isa(const std::string& name) {
  TORCH_CHECK(isa_table(name), "set_isa: ", name, " is not one of scalar, avx2, avx512");
  TORCH_CHECK(isa_supported(name), "set_isa: this CPU lacks the instructions of ", name);
  g_isa.store(isa_table(name), std::memory_order_release);
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (const char* name : {"scalar", "avx2", "avx512"})
    if (isa_supported(name)) out.emplace_back(name);
  return out;
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
  parallel_claim(T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(xp + t * H, res ? res + t * H : nullptr, wp, H, feps, op + t * H);
  });
  return out;
}

// A float32 rounded to the nearest float16, ties to even, as torch's
// .to(float16) rounds: past 65504 (from 65520 up) infinity, NaN a quiet NaN,
// below 2**-14 a subnormal.  In integers: c10's portable conversion scales by
// constants that -ffast-math may fold together, losing the overflow.
static inline uint16_t half_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;
  if (a >= 0x477FF000u) return sign | 0x7C00u;
  if (a >= 0x38800000u)  // a normal float16: rebias the exponent, round away 13 mantissa bits
    return sign | static_cast<uint16_t>((a - 0x38000000u + 0xFFFu + ((a >> 13) & 1u)) >> 13);
  const uint32_t e = a >> 23;  // below 2**-14: the multiple of 2**-24 nearest, ties to even
  if (e < 102) return sign;    // under 2**-25
  const uint32_t m = (a & 0x7FFFFFu) | 0x800000u, shift = 126 - e;
  const uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  return sign | static_cast<uint16_t>(q + (rem > half || (rem == half && (q & 1u))));
}

// The same, 8 at a time where the CPU has F16C (every AVX2 CPU): -> how many done.
__attribute__((target("avx,f16c"))) static int64_t halves_f16c(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  return i;
}

// fp8 bytes as c10 rounds floats saturated at the format's largest finite
// value (store_as), 16 (AVX-512) or 8 (AVX2) at a time, in integers but one
// float add: M mantissa bits, exponent bias BIAS.  |x| (x's sign apart) goes
// to at most the top's bits (a NaN stays a NaN: the byte 0x7f); a normal
// value is rebiased and rounded to nearest even at bit 23 - M; below the
// smallest normal (2^(1 - BIAS)) c10 adds the float32 kDenorm (2 to the
// 24 - M - BIAS), whose rounding leaves the subnormal's bits at the bottom,
// and subtracts its bits.  The decode step's cache store (32 rows, 30 layers
// of a 3-head model): c10's conversion value by value took 2% of a Zen 5's step.
template <int M, int BIAS>
struct Fp8Bits {
  static constexpr uint32_t kTop = M == 3 ? 0x43E00000u : 0x47600000u;  // 448, 57344
  static constexpr uint32_t kMinNormal = static_cast<uint32_t>(128 - BIAS) << 23;
  static constexpr uint32_t kDenorm = static_cast<uint32_t>(127 - BIAS + 23 - M + 1) << 23;
  static constexpr uint32_t kRebias = static_cast<uint32_t>(BIAS - 127) << 23;
  static constexpr int kShift = 23 - M;
};

template <typename F>
__attribute__((target("avx512f,avx512bw"))) static int64_t fp8_bytes_avx512(const float* src, uint8_t* dst,
                                                                            int64_t n) {
  const __m512i top = _mm512_set1_epi32(static_cast<int>(F::kTop)), inf = _mm512_set1_epi32(0x7F800000);
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), one = _mm512_set1_epi32(1);
  const __m512i denorm = _mm512_set1_epi32(static_cast<int>(F::kDenorm));
  const __m512i rebias = _mm512_set1_epi32(static_cast<int>(F::kRebias + (1u << (F::kShift - 1)) - 1));
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i u = _mm512_loadu_si512(src + i);
    __m512i a = _mm512_and_si512(u, magnitude);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, inf);
    a = _mm512_min_epu32(a, top);  // saturated (a NaN is replaced below)
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, F::kShift), one);
    const __m512i normal = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, rebias), odd), F::kShift);
    const __m512i sub = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(denorm))), denorm);
    __m512i r = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(F::kMinNormal)), normal, sub);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7F));
    r = _mm512_or_si512(r, _mm512_srli_epi32(_mm512_andnot_si512(magnitude, u), 24));  // the sign
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm512_cvtepi32_epi8(r));
  }
  return i;
}

template <typename F>
__attribute__((target("avx2"))) static int64_t fp8_bytes_avx2(const float* src, uint8_t* dst, int64_t n) {
  const __m256i top = _mm256_set1_epi32(static_cast<int>(F::kTop)), magnitude = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i one = _mm256_set1_epi32(1), denorm = _mm256_set1_epi32(static_cast<int>(F::kDenorm));
  const __m256i rebias = _mm256_set1_epi32(static_cast<int>(F::kRebias + (1u << (F::kShift - 1)) - 1));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m256i a = _mm256_and_si256(u, magnitude);
    // Signed compares are right here: a magnitude's bits are below 2^31.
    const __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000));
    a = _mm256_min_epu32(a, top);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, F::kShift), one);
    const __m256i normal = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, rebias), odd), F::kShift);
    const __m256i sub = _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(denorm))), denorm);
    __m256i r = _mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(F::kMinNormal), a));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F), nan);
    r = _mm256_or_si256(r, _mm256_srli_epi32(_mm256_andnot_si256(magnitude, u), 24));
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), _mm_packus_epi16(w, w));
  }
  return i;
}

// -> how many of n values fp8_bytes_avx512 or _avx2 stored, by the projections'
// instruction set (isa(): set_isa lets the tests run each here).
template <typename F>
int64_t fp8_bytes(const float* src, uint8_t* dst, int64_t n) {
  if (&isa() == &kAvx512Kernels) return fp8_bytes_avx512<F>(src, dst, n);
  if (&isa() == &kAvx2Kernels) return fp8_bytes_avx2<F>(src, dst, n);
  return 0;
}

// n floats into a cache of T: fp8 saturates at its largest finite value
// (a plain conversion makes NaN or inf past it), then every type rounds as c10 does.
template <typename T>
void store_as(const float* src, char* dst, int64_t n) {
  T* out = reinterpret_cast<T*>(dst);
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    for (int64_t i = 0; i < n; ++i) out[i] = T(src[i]);
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    static const bool f16c = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
    uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
    const int64_t done = f16c ? halves_f16c(src, bits, n) : 0;
    for (int64_t i = done; i < n; ++i) bits[i] = half_bits(src[i]);
  } else {
    using F = std::conditional_t<std::is_same_v<T, c10::Float8_e4m3fn>, Fp8Bits<3, 7>, Fp8Bits<2, 15>>;
    const float top = static_cast<float>(std::numeric_limits<T>::max());
    static_assert(sizeof(T) == 1, "an fp8 type");
    const int64_t done = fp8_bytes<F>(src, reinterpret_cast<uint8_t*>(dst), n);
    for (int64_t i = done; i < n; ++i)
      out[i] = T(std::isnan(src[i]) ? src[i] : std::min(std::max(src[i], -top), top));
  }
}

void store_row(at::ScalarType ct, const float* src, char* dst, int64_t n) {
  switch (ct) {
    case at::kBFloat16: return store_as<c10::BFloat16>(src, dst, n);
    case at::kHalf: return store_as<c10::Half>(src, dst, n);
    case at::kFloat8_e4m3fn: return store_as<c10::Float8_e4m3fn>(src, dst, n);
    case at::kFloat8_e5m2: return store_as<c10::Float8_e5m2>(src, dst, n);
    default: std::memcpy(dst, src, n * sizeof(float));  // float32 (checked by the caller)
  }
}

// The attention block's input side for T new tokens: rotate q and k (rotate-half
// rope with cos/sin [T, D/2]), store k and v in the paged cache at
// slot_mapping[t]; return the rotated q [T, Hq, D] and k [T, Hkv, D] (float32).
//   qkv: [T, (Hq + 2 Hkv) D]   kv_cache: [blocks, layers, 2, block_size, Hkv, D], float32, bfloat16, float16
//   or fp8
std::tuple<at::Tensor, at::Tensor> rope_and_store_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                             at::Tensor& kv_cache, int64_t layer, const at::Tensor& slot_mapping,
                             int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rope_and_store_kv: float32 only");
  // A bfloat16, float16 or fp8 cache (--kv-cache-dtype) stores k and v as
  // engine/layers/kv_quant.py's quantize does: rounded to nearest even by
  // c10's conversion (torch's .to), fp8 first clamped to its largest finite
  // value (the cache's scale is 1).
  const auto ct = kv_cache.scalar_type();
  TORCH_CHECK(ct == at::kFloat || ct == at::kBFloat16 || ct == at::kHalf || ct == at::kFloat8_e4m3fn ||
                  ct == at::kFloat8_e5m2,
              "rope_and_store_kv: a float32, bfloat16, float16 or fp8 cache only");
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
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const int64_t esize = kv_cache.element_size();
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
  parallel_claim(T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = src + t * W;
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      for (int64_t h = 0; h < num_heads; ++h) rotate(row + h * D, c, s, qp + (t * num_heads + h) * D);
      const int64_t blk = slot[t] / bs, off = slot[t] % bs;
      char* kdst = cache + (blk * s_blk + layer * s_lyr + off * s_tok) * esize;
      char* vdst = kdst + s_kv * esize;
      const float* k = row + num_heads * D;
      const float* v = k + num_kv_heads * D;
      float* kr = kp + t * num_kv_heads * D;
      for (int64_t h = 0; h < num_kv_heads; ++h) rotate(k + h * D, c, s, kr + h * D);
      store_row(ct, kr, kdst, num_kv_heads * D);
      store_row(ct, v, vdst, num_kv_heads * D);
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
  const SiluRows rows = isa().silu_mul;
  parallel_claim(T, 4, [&](int64_t begin, int64_t end) { rows(gp + begin * 2 * I, I, end - begin, op + begin * I); });
  return out;
}

// Faults in the pages of t's bytes [begin, end) for writing, their contents
// kept: a locked add of zero to one byte a 4 KiB page, so another thread's
// store to that byte lands before or after it, never lost.  The OS fills a
// page of the KV cache (huge_pages.kv_cache_zeros) on its first write; this
// is how engine/layers/huge_pages.py's Prefault fills them ahead of the
// blocks a step writes next, on a thread that runs when a core is idle.
void touch_pages(const at::Tensor& t, int64_t begin, int64_t end) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "touch_pages: a contiguous CPU tensor only");
  const int64_t n = t.numel() * t.element_size();
  TORCH_CHECK(0 <= begin && begin <= end && end <= n, "touch_pages: bytes [", begin, ", ", end, ") are not in [0, ", n,
              ")");
  constexpr uintptr_t kPage = 4096;
  const uintptr_t base = reinterpret_cast<uintptr_t>(t.data_ptr());
  // The first byte, then each page's first byte: every page the range overlaps, once.
  for (uintptr_t at = base + begin; at < base + end; at = (at / kPage + 1) * kPage)
    __atomic_fetch_add(reinterpret_cast<uint8_t*>(at), 0, __ATOMIC_RELAXED);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The compute kernels run without the GIL: the worker's event loop (gRPC
  // sends, new requests) runs its Python while the engine thread computes.
  using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;
  // The linear kernels' common signature: (x, weights, n, bias=None, out=None), without the GIL.
  using LinearFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, int64_t, const c10::optional<at::Tensor>&,
                                  const c10::optional<at::Tensor>&);
  auto def_linear = [&m](const char* name, LinearFn fn, const char* weights, const char* doc) {
    m.def(name, fn, nogil(), doc, pybind11::arg("x"), pybind11::arg(weights), pybind11::arg("n"),
          pybind11::arg("bias") = pybind11::none(), pybind11::arg("out") = pybind11::none());
  };
  m.def("pool_stolen", [] { return claim_pool::stolen().load(); },
        "pieces the kernels' threads took from another thread's share (parallel_claim.h)");
  m.def("use_pool", [](bool on) { claim_pool::enabled() = on; },
        "run the kernels on their own thread pool (only where OpenMP's idle threads sleep)");
  m.def("pack_weight", &pack_weight, "pack a [N, K] float32 weight into [N/16, K, 16] panels");
  def_linear("packed_linear", &packed_linear, "panels", "x @ W.T (+ bias) with a packed weight");
  def_linear("q4_linear", &q4_linear, "blocks",
        "x @ W.T (+ bias) with W held as exact 4-bit blocks (sums factored per block)");
  m.def("q4_unpack", &q4_unpack, "the float32 weights q4 blocks stand for");
  def_linear("q4i8_linear", &q4i8_linear, "blocks",
        "x @ W.T (+ bias) with W as exact 4-bit blocks and x quantized to int8 per block of 32 inputs");
  def_linear("q8i8_linear", &q8i8_linear, "blocks",
        "x @ W.T (+ bias) with W as exact 8-bit blocks and x quantized to int8 per block of 32 inputs");
  m.def("i8_vnni_supported", &i8_vnni_supported,
        "whether q4i8_linear and q8i8_linear run their AVX512-VNNI kernels here (else the AVX2 ones, or "
        "portable code without AVX2: the same bits)");
  def_linear("q8_linear", &q8_linear, "blocks", "x @ W.T (+ bias) with W held as exact 8-bit blocks");
  m.def("q8_unpack", &q8_unpack, "the float32 weights q8 blocks stand for");
  m.def("bf16_supported", &bf16_supported, "whether this CPU runs bf16_linear (AVX512-BF16)");
  m.def("bf16_argmax_supported", &bf16_argmax_supported,
        "whether bf16_linear_argmax runs here (AVX512-BF16's vdpbf16ps: not where AMX runs bf16_linear)");
  m.def("bf16_linear_argmax", &bf16_linear_argmax, nogil(),
        "torch.argmax(bf16_linear(x, panels, n), -1) (bf16_q4_linear's or bf16_q8_linear's with blocks: the same "
        "bits) without writing the outputs", pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("n"),
        pybind11::arg("blocks") = pybind11::none());
  m.def("pack_bf16", &pack_bf16, "pack a [N, K] float32 weight into bfloat16 [N/16, K/2, 16, 2] panels");
  def_linear("bf16_linear", &bf16_linear, "panels",
        "x @ W.T (+ bias) in bfloat16 (x, float32 or bfloat16, and W rounded to nearest even, float32 sums), "
        "AVX512-BF16 only");
  m.def("bf16_q4_linear", &bf16_blocks_linear<4>, nogil(),
        "bf16_linear(x, panels)'s result from the 4-bit blocks the panels were rounded from, each tile made as "
        "needed (AMX, few rows), else bf16_linear", pybind11::arg("x"), pybind11::arg("panels"),
        pybind11::arg("blocks"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("out") = pybind11::none());
  m.def("bf16_q8_linear", &bf16_blocks_linear<8>, nogil(),
        "bf16_linear(x, panels)'s result from the 8-bit blocks the panels were rounded from, each tile made as "
        "needed (AMX, few rows), else bf16_linear", pybind11::arg("x"), pybind11::arg("panels"),
        pybind11::arg("blocks"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("out") = pybind11::none());
  m.def("bf16_norm_linear", &bf16_norm_linear, nogil(),
        "bf16_q4_linear or bf16_q8_linear (blocks given) or bf16_linear of rms_norm(x, weight, eps, residual), "
        "normed as rounded",
        pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("blocks"), pybind11::arg("n"),
        pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("residual") = pybind11::none(),
        pybind11::arg("bias") = pybind11::none());
  m.def("bf16_norm_silu_linear", &bf16_norm_silu_linear, nogil(),
        "silu_and_mul(bf16_norm_linear(x, ...)) for a gate and up weight, each tile of sums gated in cache; "
        "bfloat16 rows on AMX (bf16_linear, bf16_q4_linear and bf16_q8_linear take them), float32 elsewhere",
        pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("blocks"), pybind11::arg("n"),
        pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("residual") = pybind11::none());
  m.def("bf16_silu_linear", &bf16_silu_linear, nogil(),
        "bf16_q4_linear or bf16_q8_linear (blocks given) or bf16_linear of silu_and_mul(gate_up)",
        pybind11::arg("gate_up"),
        pybind11::arg("panels"), pybind11::arg("blocks"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none());
  m.def("amx_q4_supported", &amx_q4_cpu,
        "whether bf16_q4_linear and bf16_q8_linear make their tiles from the blocks here");
  m.def("blocks_max_rows", &blocks_max_rows,
        "up to how many rows bf16_q4_linear and bf16_q8_linear read the blocks (AMX tiles or vdpbf16ps pairs "
        "made from them) here and now; 0: never");
  m.def("amx_supported", &amx_cpu,
        "whether bf16_linear runs on AMX tiles here (K a multiple of 32)");
  m.def("set_amx", &set_amx,
        "bf16_linear on AMX tiles (True, the default where supported) or vdpbf16ps; returns the previous");
  m.def("q4bf16_supported", &q4bf16_supported,
        "whether this CPU runs q4bf16_linear (AVX512-BF16 and AVX512-VBMI)");
  def_linear("q4bf16_linear", &q4bf16_linear, "blocks",
        "x @ W.T (+ bias) with W as exact 4-bit blocks and x rounded to bfloat16 (float32 sums)");
  def_linear("q8bf16_linear", &q8bf16_linear, "blocks",
        "x @ W.T (+ bias) with W as exact 8-bit blocks and x rounded to bfloat16 (float32 sums)");
  m.def("bf16_rows_norm_linear", &bf16_rows_norm_linear, nogil(),
        "q4bf16_linear / q8bf16_linear (by the blocks) of rms_norm(x, weight, eps, residual), normed as rounded",
        pybind11::arg("x"), pybind11::arg("blocks"), pybind11::arg("n"), pybind11::arg("weight"), pybind11::arg("eps"),
        pybind11::arg("residual") = pybind11::none(), pybind11::arg("bias") = pybind11::none());
  m.def("bf16_rows_silu_linear", &bf16_rows_silu_linear, nogil(),
        "q4bf16_linear / q8bf16_linear (by the blocks) of silu_and_mul(gate_up)", pybind11::arg("gate_up"),
        pybind11::arg("blocks"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none());
  m.def("int8_norm_linear", &int8_norm_linear, nogil(),
        "q4i8_linear / q8i8_linear (by the blocks) of rms_norm(x, weight, eps, residual), normed as quantized",
        pybind11::arg("x"), pybind11::arg("blocks"), pybind11::arg("n"), pybind11::arg("weight"), pybind11::arg("eps"),
        pybind11::arg("residual") = pybind11::none(), pybind11::arg("bias") = pybind11::none());
  m.def("int8_silu_linear", &int8_silu_linear, nogil(),
        "q4i8_linear / q8i8_linear (by the blocks) of silu_and_mul(gate_up)", pybind11::arg("gate_up"),
        pybind11::arg("blocks"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none());
  m.def("isa", &isa_name, "the instruction set the projections run on");
  m.def("set_isa", &set_isa, "run the projections on this instruction set (scalar, avx2, avx512)");
  m.def("supported_isas", &supported_isas, "the instruction sets this CPU runs");
  m.def("rms_norm", &rms_norm, nogil(),
        "RMSNorm of the rows (after residual += x when a residual is given)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("residual") = pybind11::none());
  m.def("rope_and_store_kv", &rope_and_store_kv, nogil(),
        "rope on q and k, k and v into the paged cache; returns q, k");
  m.def("silu_and_mul", &silu_and_mul, nogil(), "silu(gate) * up");
  m.def("touch_pages", &touch_pages, nogil(),
        "fault in the pages of t's bytes [begin, end) for writing, keeping what they hold", pybind11::arg("t"),
        pybind11::arg("begin"), pybind11::arg("end"));
  def_decode_stack(m);
}
