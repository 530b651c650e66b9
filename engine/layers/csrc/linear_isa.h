// The linear micro-kernels, written once over a 16-wide weight vector and
// compiled once per instruction set: a translation unit defines one of
// SPLITSERVE_ISA_AVX512 / SPLITSERVE_ISA_AVX2 (with a matching target
// pragma) or neither (portable scalar), and SPLITSERVE_ISA_TABLE, then
// includes this file.  Nothing here is inline outside an anonymous
// namespace: code built for AVX-512 must never be what the linker picks for
// a caller on an AVX2 machine.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "linear_isa_api.h"
#include "prefetch.h"

// The SiLU's exp (silu_mul_rows below): without -ffast-math or fused multiply-adds.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")
#include "exp_poly.h"
#pragma GCC pop_options

#if defined(SPLITSERVE_ISA_AVX512) || defined(SPLITSERVE_ISA_AVX2)
#include <immintrin.h>
#endif
#if defined(SPLITSERVE_ISA_AMX)
#include "amx_tiles.h"
#include "bf16_round.h"
#endif

namespace splitserve_linear {
namespace {

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
constexpr int q4_shift_of(int kk) { return kk < 4 ? 8 * kk : 8 * (kk - 4) + 4; }  // q4_shift, at compile time

#if defined(SPLITSERVE_ISA_AVX512)
constexpr int MR = 12;  // rows per micro-kernel call: 12 of the 32 vector registers
constexpr int MR_WIDE = 4, NP_WIDE = 4;  // up to 4 rows: 4 panels at once (16 accumulators)
constexpr int NP_WIDE_Q4 = 2;  // q4 keeps a block sum beside each accumulator
// Many rows against decoded 4-bit panels: 2 panels x 6 rows (24 of the
// registers), so each broadcast of x feeds two FMAs (one panel: one load per FMA).
constexpr int MR_Q4F = 6, NP_Q4F = 2;
struct W16 { __m512 v; };
inline W16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store16(float* p, W16 w) { _mm512_storeu_ps(p, w.v); }
inline W16 mul(W16 a, W16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline W16 add(W16 a, W16 b) { return {_mm512_add_ps(a.v, b.v)}; }
// A 64-byte chunk of q4 nibbles (linear_isa_api.h), loaded; row<KK>: input
// KK's 16 q values as floats (column j's 32-bit lane shifted by q4_shift(KK)).
struct Q4Chunk {
  __m512i v;
  Q4Chunk() = default;
  explicit Q4Chunk(const uint8_t* p) : v(_mm512_loadu_si512(p)) {}
  template <int KK>
  W16 row() const {
    return {_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, q4_shift(KK)), _mm512_set1_epi32(0x0F)))};
  }
};
inline W16 q8_row(const uint8_t* q) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))))};
}
template <int R>
struct Acc {
  __m512 a[R];
  Acc() { for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps(); }
  inline void fma(const float* __restrict__ x, int64_t ldx, int64_t k, W16 b) {
    for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), b.v, a[r]);
  }
  inline void store(float* tile) const { for (int r = 0; r < R; ++r) _mm512_storeu_ps(tile + r * NR, a[r]); }
  inline void load(const float* tile) { for (int r = 0; r < R; ++r) a[r] = _mm512_loadu_ps(tile + r * NR); }
  // a += d * s + m * xs[r]: a 4-bit block's sum folded in (see Q4).
  inline void fold(const Acc& s, W16 d, W16 m, const float* xs, int64_t ldxs) {
    for (int r = 0; r < R; ++r)
      a[r] = _mm512_fmadd_ps(_mm512_set1_ps(xs[r * ldxs]), m.v, _mm512_fmadd_ps(d.v, s.a[r], a[r]));
  }
};

#elif defined(SPLITSERVE_ISA_AVX2)
constexpr int MR = 6;  // 12 accumulators of the 16 registers
constexpr int MR_WIDE = 2, NP_WIDE = 2;  // up to 2 rows: 2 panels at once (8 accumulators)
// 4-bit, up to 2 rows: 2 panels at once.  One panel gave a row two chains of
// dependent FMAs, 8 a chunk at 4 cycles each, which bound it (perf: 32 cycles
// a chunk of 128 weights); two panels, 4 chains: Zen 3, a single-stream step
// 15.7-16.7 -> 13.7-14.2 ms (the 4-bit projections 7.8-8.3 -> 6.4-7.4 ms).
// Two rows spill a few registers at each block's fold and still gain (30
// layers' projections on one core: 8.4 -> 7.7-7.9 ms).
constexpr int NP_WIDE_Q4 = 2;
constexpr int MR_Q4F = MR, NP_Q4F = 1;
struct W16 { __m256 lo, hi; };
inline W16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store16(float* p, W16 w) { _mm256_storeu_ps(p, w.lo); _mm256_storeu_ps(p + 8, w.hi); }
inline W16 mul(W16 a, W16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline W16 add(W16 a, W16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
struct Q4Chunk {
  __m256i lo, hi;  // columns 0-7, 8-15
  Q4Chunk() = default;
  explicit Q4Chunk(const uint8_t* p)
      : lo(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
        hi(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))) {}
  template <int KK>
  W16 row() const {
    const __m256i mask = _mm256_set1_epi32(0x0F);
    return {_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(lo, q4_shift(KK)), mask)),
            _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(hi, q4_shift(KK)), mask))};
  }
  // row<KK>() times 2^q4_shift(KK), one instruction fewer a half: the nibble
  // masked in place (its float is exact: at most 4 significant bits below
  // bit 28).  The top nibble (KK 7, bit 31 the sign) is shifted down as in
  // row(): q4_row_scale gives its x a scale of 1.
  template <int KK>
  W16 row_scaled() const {
    if constexpr (KK == 7) {
      return {_mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 28)), _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 28))};
    } else {
      const __m256i mask = _mm256_set1_epi32(0x0F << q4_shift_of(KK));
      return {_mm256_cvtepi32_ps(_mm256_and_si256(lo, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(hi, mask))};
    }
  }
};
#define SPLITSERVE_Q4_SCALED_X 1
inline W16 q8_row(const uint8_t* q) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))};
}
template <int R>
struct Acc {
  __m256 lo[R], hi[R];
  Acc() { for (int r = 0; r < R; ++r) { lo[r] = _mm256_setzero_ps(); hi[r] = _mm256_setzero_ps(); } }
  inline void fma(const float* __restrict__ x, int64_t ldx, int64_t k, W16 b) {
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
      lo[r] = _mm256_fmadd_ps(a, b.lo, lo[r]);
      hi[r] = _mm256_fmadd_ps(a, b.hi, hi[r]);
    }
  }
  inline void store(float* tile) const {
    for (int r = 0; r < R; ++r) { _mm256_storeu_ps(tile + r * NR, lo[r]); _mm256_storeu_ps(tile + r * NR + 8, hi[r]); }
  }
  inline void load(const float* tile) {
    for (int r = 0; r < R; ++r) { lo[r] = _mm256_loadu_ps(tile + r * NR); hi[r] = _mm256_loadu_ps(tile + r * NR + 8); }
  }
  inline void fold(const Acc& s, W16 d, W16 m, const float* xs, int64_t ldxs) {
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(xs + r * ldxs);
      lo[r] = _mm256_fmadd_ps(a, m.lo, _mm256_fmadd_ps(d.lo, s.lo[r], lo[r]));
      hi[r] = _mm256_fmadd_ps(a, m.hi, _mm256_fmadd_ps(d.hi, s.hi[r], hi[r]));
    }
  }
};

#else  // portable: the same arithmetic one lane at a time (fmaf: one rounding, as the vector FMA)
constexpr int MR = 4;
constexpr int MR_WIDE = 1, NP_WIDE = 1, NP_WIDE_Q4 = 1;
constexpr int MR_Q4F = MR, NP_Q4F = 1;
struct W16 { float v[NR]; };
inline W16 load16(const float* p) { W16 w; std::memcpy(w.v, p, sizeof(w.v)); return w; }
inline void store16(float* p, const W16& w) { std::memcpy(p, w.v, sizeof(w.v)); }
inline W16 mul(W16 a, W16 b) { for (int j = 0; j < NR; ++j) a.v[j] = a.v[j] * b.v[j]; return a; }
inline W16 add(W16 a, W16 b) { for (int j = 0; j < NR; ++j) a.v[j] = a.v[j] + b.v[j]; return a; }
struct Q4Chunk {
  const uint8_t* p = nullptr;
  Q4Chunk() = default;
  explicit Q4Chunk(const uint8_t* chunk) : p(chunk) {}
  template <int KK>
  W16 row() const {
    W16 w;
    for (int j = 0; j < NR; ++j) w.v[j] = static_cast<float>(q4_value(p, KK, j));
    return w;
  }
};
inline W16 q8_row(const uint8_t* q) {
  W16 w;
  for (int j = 0; j < NR; ++j) w.v[j] = static_cast<float>(static_cast<int8_t>(q[j]));
  return w;
}
template <int R>
struct Acc {
  float a[R][NR];
  Acc() { std::memset(a, 0, sizeof(a)); }
  inline void fma(const float* __restrict__ x, int64_t ldx, int64_t k, const W16& b) {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NR; ++j) a[r][j] = __builtin_fmaf(x[r * ldx + k], b.v[j], a[r][j]);
  }
  inline void store(float* tile) const { std::memcpy(tile, a, sizeof(a)); }
  inline void load(const float* tile) { std::memcpy(a, tile, sizeof(a)); }
  inline void fold(const Acc& s, const W16& d, const W16& m, const float* xs, int64_t ldxs) {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NR; ++j)
        a[r][j] = __builtin_fmaf(xs[r * ldxs], m.v[j], __builtin_fmaf(d.v[j], s.a[r][j], a[r][j]));
  }
};
#endif

// f(integral_constant KK) for KK = 0..7, unrolled: a chunk's 8 inputs in order.
template <typename F, int... KK>
inline void each_input(F f, std::integer_sequence<int, KK...>) {
  (f(std::integral_constant<int, KK>{}), ...);
}
template <typename F>
inline void each_of_8(F f) { each_input(f, std::make_integer_sequence<int, 8>{}); }

// The formats: R rows of x times NP consecutive panels (pbytes apart), into
// NP tiles of R x 16.  Several panels at once give the FMA units independent
// chains: one row against one panel is a single chain of K dependent FMAs,
// bound by their latency (4 cycles per 16 weights), not by their throughput.
// Each output is still one chain over k in order, so the result is the same.
//
// `ahead`, where its p is not null, is the panel a later call reads: a
// float32 panel's row k is one cache line, so asking for lines of it beside
// the k of this one brings it into L2 while this panel's rows compute (the
// weights of a model stream from memory every step; alone, the first row
// tile of each panel waited on them).
//
// Which lines: k = first, first + every, ... (Ahead).  A panel's row tiles
// share its successor's lines (tile t of T: t, t + T, ...; ahead_of), so the
// requests come at the pace of the whole panel's compute.  All in its first
// row tile, they came T times as fast as the memory served them: on a Zen 5
// (family 26 model 2), the 30 layers' bfloat16 projections of 32 rows over
// weights that do not fit in cache 10.4 against 9.7 ms spread (24 rows 9.1
// against 8.3, 64 rows 19.1 against 18.3; 128 rows alike); float32 panels
// on the AVX2 kernel 3% faster, on the AVX-512 one alike.
struct Ahead {
  const uint8_t* p = nullptr;
  int64_t first = 0, every = 1;
};

// Row tile t of `tiles`' share of the lines of `next` (none for a single tile:
// few rows, where the panel's own loads are the stream).
inline Ahead ahead_of(const uint8_t* next, int64_t t, int64_t tiles) {
  return tiles > 1 ? Ahead{next, t, tiles} : Ahead{};
}

struct F32 {
  static constexpr int NP_MAX = NP_WIDE;
  template <int R, int NP>
  static void run(const uint8_t* p, int64_t pbytes, int64_t K, const float* x, int64_t ldx, const float*, int64_t,
                  float* tile, Ahead ahead) {
    if (ahead.p != nullptr) return rows<R, NP, true>(p, pbytes, K, x, ldx, tile, ahead);
    rows<R, NP, false>(p, pbytes, K, x, ldx, tile, ahead);
  }
  template <int R, int NP, bool PREFETCH>
  static void rows(const uint8_t* p, int64_t pbytes, int64_t K, const float* x, int64_t ldx, float* tile,
                   Ahead ahead) {
    Acc<R> acc[NP];
    int64_t line = ahead.first;
    for (int64_t k = 0; k < K; ++k) {
      if constexpr (PREFETCH)
        if (k == line) {
          __builtin_prefetch(ahead.p + k * NR * 4, 0, 2);
          line += ahead.every;
        }
      for (int n = 0; n < NP; ++n)
        acc[n].fma(x, ldx, k, load16(reinterpret_cast<const float*>(p + n * pbytes) + k * NR));
    }
    for (int n = 0; n < NP; ++n) acc[n].store(tile + n * R * NR);
  }
};

// The quantized formats stream their panels from memory once a step (a
// model's weights do not fit in cache); the hardware prefetcher alone kept
// the 4-bit kernel at half the memory's rate, so each block asks for the one
// Q4_AHEAD blocks further along its panel (past a panel's end, the panels
// after it: the next call's).  A prefetch never faults and changes no result.
constexpr int64_t Q4_AHEAD = 4;
// LOCALITY: __builtin_prefetch's (0: read once, soon; 2: kept in L2 until read).
template <int LOCALITY = 0>
inline void prefetch_block(const uint8_t* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, LOCALITY);
}

// 4-bit blocks, factored: w = d * q + m, so a block of 32 inputs adds
// d * sum(x q) + m * sum(x) to each output.  The sum over x q runs on the
// small integers q as floats (no per-weight rebuild), sum(x) once per row and
// block (xs, computed by the caller).  Every row count runs this same
// arithmetic, so a row's result never depends on the batch around it.
//
// SCALED (AVX2, up to MR_WIDE rows): x comes pre-scaled by q4_prescale, and
// each input's q values are read as q * 2^q4_shift(KK) (Q4Chunk::row_scaled,
// one instruction fewer per 8 weights).  x 2^-s times q 2^s is x q exactly,
// so each FMA, and the result, is the unscaled one's bit for bit.
template <bool SCALED>
struct Q4T {
  static constexpr int NP_MAX = NP_WIDE_Q4;
  template <int R, int NP>
  static void run(const uint8_t* p, int64_t pbytes, int64_t K, const float* x, int64_t ldx, const float* xs,
                  int64_t ldxs, float* tile, Ahead) {
    Acc<R> acc[NP];
    for (int64_t kb = 0; kb < K / QB; ++kb) {
      // Near a panel's end, the start of the panels the next call reads (they follow these in memory).
      const int64_t ahead = kb + Q4_AHEAD < K / QB ? kb + Q4_AHEAD : kb + Q4_AHEAD - K / QB + NP * (K / QB);
      for (int n = 0; n < NP; ++n) prefetch_block(p + n * pbytes + ahead * Q4_BLOCK_BYTES, Q4_BLOCK_BYTES);
      Acc<R> s[NP];
      for (int64_t c = 0; c < QB / 8; ++c) {
        const uint8_t* nib = p + kb * Q4_BLOCK_BYTES + 2 * NR * 4 + c * 64;
        Q4Chunk chunk[NP];
        for (int n = 0; n < NP; ++n) chunk[n] = Q4Chunk(nib + n * pbytes);
        each_of_8([&](auto kk) {
          for (int n = 0; n < NP; ++n) {
            if constexpr (SCALED)
              s[n].fma(x, ldx, kb * QB + c * 8 + kk, chunk[n].template row_scaled<kk>());
            else
              s[n].fma(x, ldx, kb * QB + c * 8 + kk, chunk[n].template row<kk>());
          }
        });
      }
      for (int n = 0; n < NP; ++n) {
        const float* dm = reinterpret_cast<const float*>(p + n * pbytes + kb * Q4_BLOCK_BYTES);
        acc[n].fold(s[n], load16(dm), load16(dm + NR), xs + kb, ldxs);
      }
    }
    for (int n = 0; n < NP; ++n) acc[n].store(tile + n * R * NR);
  }
};
using Q4 = Q4T<false>;

#if defined(SPLITSERVE_Q4_SCALED_X)
// x's `rows` rows (ldx apart), K inputs each, into `out` (K a row) with input k
// scaled by 2^-q4_shift(k % 8) (1 for the top nibble, k % 8 == 7), as
// Q4T<true> reads them.  False where a nonzero value would scale below the
// normal range (it would lose bits): the caller keeps the unscaled path.
inline bool q4_prescale(const float* x, int64_t ldx, int64_t K, int64_t rows, std::vector<float>& out) {
  out.resize(static_cast<size_t>(rows * K));
  alignas(32) float scale[8];
  for (int kk = 0; kk < 8; ++kk) scale[kk] = kk == 7 ? 1.0f : 1.0f / static_cast<float>(1 << q4_shift_of(kk));
  const __m256 sv = _mm256_load_ps(scale);
  const __m256 tiny = _mm256_set1_ps(0x1p-102f), zero = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 bad = zero;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; k += 8) {  // K is a multiple of 32
      const __m256 v = _mm256_loadu_ps(x + r * ldx + k);
      const __m256 a = _mm256_and_ps(v, abs_mask);
      bad = _mm256_or_ps(bad, _mm256_and_ps(_mm256_cmp_ps(a, tiny, _CMP_LT_OQ), _mm256_cmp_ps(a, zero, _CMP_NEQ_OQ)));
      _mm256_storeu_ps(out.data() + r * K + k, _mm256_mul_ps(v, sv));
    }
  return _mm256_movemask_ps(bad) == 0;
}
#endif

// Many rows against a 4-bit panel: the panel decoded once (the q values as
// floats, exact; d and m as stored) into a buffer each row tile then reads,
// instead of every row tile decoding the nibbles again.  Q4F runs Q4's
// arithmetic in Q4's order on the decoded values, so its bits are Q4's.
//
// Up to Q4F_SPAN_ROWS rows (decode steps) the panels are decoded a span of
// Q4F_SPAN blocks at a time, which every row tile reads while it is in L1 (a
// whole decoded panel of 576 inputs is 37 KB, more than a Zen 3's L1), and the
// next span's blocks are asked for while the tiles compute (so few rows'
// work no longer waits on the weights streaming from memory).  A tile's sums
// wait in memory between spans (Q4F starts from them), float32 stored and
// loaded, so the bits are one pass's.  More rows (prompts) decode whole
// panels: there a tile's rows of x would leave L1 between spans.  The decoded
// values go out with vector stores (store16; copied out with memcpy, GCC took
// them apart through the stack, a quarter of the path's time at 32 rows).
// Zen 3 (avx2 fma), 30 layers' projections on distinct weights, best of runs
// (benchmarks.projection_formats; benchmarks/README.md has the history):
// 49.6-65.7 ms at 32 rows (float32 panels 50.9-59.9), 20.9-22.8 at 8 (panels
// 30.4-33.5).
constexpr int64_t Q4F_BLOCK_FLOATS = (2 + QB) * NR;  // d, m, then QB rows of 16 q values
constexpr int64_t Q4F_SPAN = 8 / NP_Q4F;  // blocks: 17 KB of decoded panels
constexpr int64_t Q4F_SPAN_ROWS = 64;

inline void q4_decode_panel(const uint8_t* p, int64_t K, float* out) {
  for (int64_t kb = 0; kb < K / QB; ++kb) {
    const uint8_t* blk = p + kb * Q4_BLOCK_BYTES;
    prefetch_block(blk + Q4_AHEAD * Q4_BLOCK_BYTES, Q4_BLOCK_BYTES);
    float* o = out + kb * Q4F_BLOCK_FLOATS;
    std::memcpy(o, blk, 2 * NR * sizeof(float));
    for (int64_t c = 0; c < QB / 8; ++c) {
      const Q4Chunk chunk(blk + 2 * NR * 4 + c * 64);
      each_of_8([&](auto kk) {
        store16(o + (2 + c * 8 + kk) * NR, chunk.template row<kk>());
      });
    }
  }
}

struct Q4F {
  static constexpr int NP_MAX = NP_Q4F;
  // p: NP decoded panels, pbytes apart; K: their inputs.  Adds to the sums in tile.
  template <int R, int NP>
  static void run(const uint8_t* p, int64_t pbytes, int64_t K, const float* x, int64_t ldx, const float* xs,
                  int64_t ldxs, float* tile, Ahead) {
    Acc<R> acc[NP];
    for (int n = 0; n < NP; ++n) acc[n].load(tile + n * R * NR);
    for (int64_t kb = 0; kb < K / QB; ++kb) {
      const float* blk[NP];
      for (int n = 0; n < NP; ++n) blk[n] = reinterpret_cast<const float*>(p + n * pbytes) + kb * Q4F_BLOCK_FLOATS;
      Acc<R> s[NP];
      for (int64_t kk = 0; kk < QB; ++kk)
        for (int n = 0; n < NP; ++n) s[n].fma(x, ldx, kb * QB + kk, load16(blk[n] + (2 + kk) * NR));
      for (int n = 0; n < NP; ++n) acc[n].fold(s[n], load16(blk[n]), load16(blk[n] + NR), xs + kb, ldxs);
    }
    for (int n = 0; n < NP; ++n) acc[n].store(tile + n * R * NR);
  }
};

struct Q8 {
  static constexpr int NP_MAX = NP_WIDE;
  template <int R, int NP>
  static void run(const uint8_t* p, int64_t pbytes, int64_t K, const float* x, int64_t ldx, const float*, int64_t,
                  float* tile, Ahead) {
    Acc<R> acc[NP];
    for (int64_t kb = 0; kb < K / QB; ++kb) {
      W16 d[NP];
      for (int n = 0; n < NP; ++n) d[n] = load16(reinterpret_cast<const float*>(p + n * pbytes + kb * Q8_BLOCK_BYTES));
      for (int64_t kk = 0; kk < QB; ++kk)
        for (int n = 0; n < NP; ++n)
          acc[n].fma(x, ldx, kb * QB + kk, mul(q8_row(p + n * pbytes + kb * Q8_BLOCK_BYTES + NR * 4 + kk * NR), d[n]));
    }
    for (int n = 0; n < NP; ++n) acc[n].store(tile + n * R * NR);
  }
};

#if defined(SPLITSERVE_ISA_BF16)
// bfloat16 panels (AVX512-BF16), for the rows of prompts under
// prefill_dtype=bfloat16: per pair of inputs (k, k + 1), the panel's 16
// columns as (w[k] low, w[k + 1] high) bfloat16 pairs, 64 bytes.  x arrives
// as pairs the same way, in tiles of BF_TILE_ROWS rows: pair kp of the tile's
// row r at [kp * BF_TILE_ROWS + r] (linear_cpu.cpp packs them), so one
// pointer reaches every row.  One vdpbf16ps adds both products of a pair to
// each column's float32 sum, pairs in k order: one fixed order for every row
// count (batch invariance), not the float32 kernels' bits.  12 rows x 2
// panels: 24 accumulators and the 2 panels' vectors; x is broadcast from
// memory inside the instruction (written out: the compiler otherwise keeps
// 12 broadcasts in registers and spills accumulators).
constexpr int NP_BF = 2;
constexpr int64_t BF_PAIR_BYTES = NR * 4;  // 16 columns x 2 bfloat16
static_assert(BF_TILE_ROWS == MR, "a tile of x is one row tile of the kernel");
inline __m512 dot_pair(__m512 acc, __m512i w, const uint32_t* x) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
}

// Adds kps pairs of NP panels (panel n's first at w + n * wbytes) times x's
// pairs from xk (a tile's, as above) to R rows' sums, pairs in k order: the
// one loop of BF16 and BF16Blocks, so both give the same bits.  PREFETCH:
// beside the pairs kp that `ahead` names, ask for pair kp of the NP panels a
// later call reads (the first at ahead.p, laid out as these), so that they
// come into L2 while this panel computes.  The first row tile of a panel
// otherwise waited on memory: a model's weights stream from it every step.
// Zen 4, 32 rows, the two alternating in one process: the 576 x 49,152 head
// 5.0-5.1 against 5.7-5.9 ms, a 576 x 3,072 projection 7-10% faster.
template <int R, int NP, bool PREFETCH = false>
inline void dot_pairs(__m512 (&a)[NP][R], const uint8_t* w, int64_t wbytes, const uint32_t* xk, int64_t kps,
                      Ahead ahead = {}) {
  int64_t line = ahead.first;
  for (int64_t kp = 0; kp < kps; ++kp) {
    if constexpr (PREFETCH)
      if (kp == line) {
        for (int n = 0; n < NP; ++n) __builtin_prefetch(ahead.p + n * wbytes + kp * BF_PAIR_BYTES, 0, 2);
        line += ahead.every;
      }
    __m512i wk[NP];
    for (int n = 0; n < NP; ++n) wk[n] = _mm512_loadu_si512(w + n * wbytes + kp * BF_PAIR_BYTES);
    for (int r = 0; r < R; ++r)
      for (int n = 0; n < NP; ++n) a[n][r] = dot_pair(a[n][r], wk[n], xk + kp * BF_TILE_ROWS + r);
  }
}

struct BF16 {
  static constexpr int NP_MAX = NP_BF;
  // x: a tile of pairs as above, R <= BF_TILE_ROWS of its rows used.
  template <int R, int NP>
  static void run(const uint8_t* p, int64_t pbytes, int64_t K, const float* x, int64_t, const float*, int64_t,
                  float* tile, Ahead ahead) {
    __m512 a[NP][R];
    for (int n = 0; n < NP; ++n)
      for (int r = 0; r < R; ++r) a[n][r] = _mm512_setzero_ps();
    if (ahead.p != nullptr)
      dot_pairs<R, NP, true>(a, p, pbytes, reinterpret_cast<const uint32_t*>(x), K / 2, ahead);
    else
      dot_pairs(a, p, pbytes, reinterpret_cast<const uint32_t*>(x), K / 2);
    for (int n = 0; n < NP; ++n)
      for (int r = 0; r < R; ++r) _mm512_storeu_ps(tile + (n * R + r) * NR, a[n][r]);
  }
};
#endif

// Whether a format reads x as BF16's tiles of bfloat16 pairs (rows_times_panels runs it as BF16).
template <typename Format>
constexpr bool kReadsPairs = false;
#if defined(SPLITSERVE_ISA_BF16)
template <>
constexpr bool kReadsPairs<BF16> = true;
#endif

template <typename Format, int R, int NP>
inline void run_rows(const uint8_t* panel, int64_t pbytes, int64_t K, const float* x, int64_t ldx, const float* xs,
                     int64_t ldxs, int64_t rows, float* tile, Ahead ahead = {}) {
  if constexpr (R > 1) {
    if (rows < R) return run_rows<Format, R - 1, NP>(panel, pbytes, K, x, ldx, xs, ldxs, rows, tile, ahead);
  }
  Format::template run<R, NP>(panel, pbytes, K, x, ldx, xs, ldxs, tile, ahead);
}

// Row tile t of `tiles` over `rows` rows, as even as they divide: {first row, rows in it}.
inline std::pair<int64_t, int64_t> row_tile(int64_t rows, int64_t t, int64_t tiles) {
  const int64_t m = rows * t / tiles;
  return {m, rows * (t + 1) / tiles - m};
}

// Copies R rows x 16 of a tile out to y (plus bias), cols of them valid.
inline void store_tile(const float* t, int64_t r, const float* bias, int64_t col0, int64_t cols, float* y,
                       int64_t ldy) {
  for (int64_t i = 0; i < r; ++i) {
    float* out = y + i * ldy + col0;
    const float* ti = t + i * NR;
    if (bias) {
      for (int64_t j = 0; j < cols; ++j) out[j] = ti[j] + bias[col0 + j];
    } else if (cols == NR) {  // a whole panel: a fixed-size copy the compiler inlines (no libc call a row)
      std::memcpy(out, ti, NR * sizeof(float));
    } else {
      std::memcpy(out, ti, cols * sizeof(float));
    }
  }
}

#if defined(SPLITSERVE_ISA_AMX) || defined(SPLITSERVE_ISA_BF16Q4)
// A 4-bit block (q4's layout: d[16] and m[16] float32, then 4 chunks of 64
// bytes, chunk c's byte 4j + i holding q(8c + i, j) low and q(8c + 4 + i, j)
// high) as the B tile its bfloat16 panels hold: row r the pairs (2r, 2r + 1)
// of the block's 32 inputs, column j's pair in bytes 4j .. 4j + 3.  Each
// weight is d q + m with the exact product and one rounding (q4_unpack's
// float32 weight), rounded to nearest even bfloat16 as pack_bf16 rounds it:
// the same bits.  (vcvtne2ps2bf16 flushes subnormals, but such a weight is a
// multiple of 2^-24, d and m being float16 values: zero or normal.)  Column
// j's pair of inputs (2t, 2t + 1) of a chunk half sits in its bytes 4j + 2t
// and 4j + 2t + 1; kQ4TileIdx.v[t][g] moves those of columns 8g .. 8g + 7 to
// the low bytes of lanes 0 .. 15 (lane 2j' + e: column 8g + j', input 2t + e).
struct Q4TileIdx {
  alignas(64) uint8_t v[2][2][64];
  constexpr Q4TileIdx() : v{} {
    for (int t = 0; t < 2; ++t)
      for (int g = 0; g < 2; ++g)
        for (int lane = 0; lane < 16; ++lane)
          v[t][g][4 * lane] = static_cast<uint8_t>(4 * (8 * g + lane / 2) + 2 * t + lane % 2);
  }
};
constexpr Q4TileIdx kQ4TileIdx{};

inline void q4_bf16_tile(const uint8_t* blk, uint8_t* out) {
  const float* dm = reinterpret_cast<const float*>(blk);
  const __m512i pairs_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i pairs_hi = _mm512_add_epi32(pairs_lo, _mm512_set1_epi32(8));
  const __m512 d = _mm512_loadu_ps(dm), m = _mm512_loadu_ps(dm + NR);
  const __m512 dg[2] = {_mm512_permutexvar_ps(pairs_lo, d), _mm512_permutexvar_ps(pairs_hi, d)};
  const __m512 mg[2] = {_mm512_permutexvar_ps(pairs_lo, m), _mm512_permutexvar_ps(pairs_hi, m)};
  const __m512i idx[2][2] = {{_mm512_load_si512(kQ4TileIdx.v[0][0]), _mm512_load_si512(kQ4TileIdx.v[0][1])},
                             {_mm512_load_si512(kQ4TileIdx.v[1][0]), _mm512_load_si512(kQ4TileIdx.v[1][1])}};
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512 q_values = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  constexpr __mmask64 lane_low_bytes = 0x1111111111111111ull;
  const uint8_t* q = blk + 2 * NR * 4;
  for (int c = 0; c < QB / 8; ++c) {
    const __m512i raw = _mm512_loadu_si512(q + c * 64);
    const __m512i half[2] = {_mm512_and_si512(raw, low4), _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4)};
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < 2; ++t) {
        __m512 w[2];
        for (int g = 0; g < 2; ++g) {
          const __m512i qv = _mm512_maskz_permutexvar_epi8(lane_low_bytes, idx[t][g], half[h]);
          // q as a float: converted in one half, looked up (vpermps) in the
          // other, to share the work between the vector ports
          const __m512 qf = g == 0 ? _mm512_cvtepi32_ps(qv) : _mm512_permutexvar_ps(qv, q_values);
          w[g] = _mm512_fmadd_ps(qf, dg[g], mg[g]);
        }
        const __m512i row = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w[1], w[0]));
        _mm512_store_si512(out + (4 * c + 2 * h + t) * 64, row);
      }
  }
}

// An 8-bit block (q8's layout: d[16] float32, then 32 rows of 16 int8,
// input k's row k) as the B tile its bfloat16 panels hold (q4_bf16_tile's
// tile): each weight d q, exact in float32, rounded to nearest even as
// pack_bf16 rounds it, the same bits.  A chunk of 64 bytes is inputs 4c ..
// 4c + 3; kQ8TileIdx.v[t][g] moves the q of pair t (inputs 4c + 2t and 4c +
// 2t + 1) of columns 8g .. 8g + 7 to the low bytes of lanes 0 .. 15 (lane
// 2j' + e: column 8g + j', input 4c + 2t + e), over the float 2^23: with
// the q's sign bit flipped first, each lane is then the float 2^23 + 128 +
// q, and q itself one subtraction away (no conversion; both exact).
struct Q8TileIdx {
  alignas(64) uint8_t v[2][2][64];
  constexpr Q8TileIdx() : v{} {
    for (int t = 0; t < 2; ++t)
      for (int g = 0; g < 2; ++g)
        for (int lane = 0; lane < 16; ++lane)
          v[t][g][4 * lane] = static_cast<uint8_t>((2 * t + lane % 2) * NR + 8 * g + lane / 2);
  }
};
constexpr Q8TileIdx kQ8TileIdx{};

inline void q8_bf16_tile(const uint8_t* blk, uint8_t* out) {
  const __m512i pairs_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i pairs_hi = _mm512_add_epi32(pairs_lo, _mm512_set1_epi32(8));
  const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(blk));
  const __m512 dg[2] = {_mm512_permutexvar_ps(pairs_lo, d), _mm512_permutexvar_ps(pairs_hi, d)};
  const __m512i idx[2][2] = {{_mm512_load_si512(kQ8TileIdx.v[0][0]), _mm512_load_si512(kQ8TileIdx.v[0][1])},
                             {_mm512_load_si512(kQ8TileIdx.v[1][0]), _mm512_load_si512(kQ8TileIdx.v[1][1])}};
  constexpr __mmask64 lane_low_bytes = 0x1111111111111111ull;
  const __m512i two23 = _mm512_set1_epi32(0x4B000000);  // the float 2^23: its low byte is an integer's
  const __m512 offset = _mm512_set1_ps(8388608.f + 128.f);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const uint8_t* q = blk + NR * 4;
  for (int c = 0; c < QB / 4; ++c) {
    const __m512i raw = _mm512_xor_si512(_mm512_loadu_si512(q + c * 64), sign);  // q + 128, unsigned
    for (int t = 0; t < 2; ++t) {
      __m512 w[2];
      for (int g = 0; g < 2; ++g) {
        const __m512i biased = _mm512_mask_permutexvar_epi8(two23, lane_low_bytes, idx[t][g], raw);
        w[g] = _mm512_mul_ps(_mm512_sub_ps(_mm512_castsi512_ps(biased), offset), dg[g]);
      }
      const __m512i row = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(w[1], w[0]));
      _mm512_store_si512(out + (2 * c + t) * 64, row);
    }
  }
}

// Where amx_block's B tiles come from: the bfloat16 panels as stored, or
// each made from a block of 4 or 8 bits (q4_bf16_tile, q8_bf16_tile).
enum class BTiles { kPanels, kQ4, kQ8 };

template <BTiles B>
constexpr int64_t block_bytes() {
  return B == BTiles::kQ4 ? Q4_BLOCK_BYTES : Q8_BLOCK_BYTES;
}

template <BTiles B>
inline void make_tile(const uint8_t* blk, uint8_t* out) {
  if constexpr (B == BTiles::kQ4) q4_bf16_tile(blk, out);
  else q8_bf16_tile(blk, out);
}
#endif

#if defined(SPLITSERVE_ISA_BF16Q4)
// decode_dtype=bfloat16-weights without AMX, few rows: BF16's panels made a
// block at a time from the 4- or 8-bit blocks they were rounded from
// (make_tile writes the panels' bytes: an AMX B tile is a panel's 16 pairs
// of a block) into L1, then read as BF16 reads them (dot_pairs): the same
// pairs, in the same order, into the same sums, so kBf16Rows's bits.  A step of few rows
// is bound by reading its weights, and a block is 6 or 9 bits a weight
// against the panels' 16.  p: NP panels of blocks, pbytes apart.
template <BTiles B>
struct BF16Blocks {
  static constexpr int NP_MAX = NP_BF;
  template <int R, int NP>
  static void run(const uint8_t* p, int64_t pbytes, int64_t K, const float* x, int64_t, const float*, int64_t,
                  float* tile, Ahead) {
    constexpr int64_t bytes = block_bytes<B>();
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
    alignas(64) uint8_t pairs[NP][QB / 2 * BF_PAIR_BYTES];
    __m512 a[NP][R];
    for (int n = 0; n < NP; ++n)
      for (int r = 0; r < R; ++r) a[n][r] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < K / QB; ++kb) {
      for (int n = 0; n < NP; ++n) {
        const uint8_t* blk = p + n * pbytes + kb * bytes;
        prefetch_block(blk + Q4_AHEAD * bytes, bytes);
        make_tile<B>(blk, pairs[n]);
      }
      dot_pairs(a, pairs[0], sizeof(pairs[0]), xp + kb * (QB / 2) * BF_TILE_ROWS, QB / 2);
    }
    for (int n = 0; n < NP; ++n)
      for (int r = 0; r < R; ++r) _mm512_storeu_ps(tile + (n * R + r) * NR, a[n][r]);
  }
};
template <BTiles B>
constexpr bool kReadsPairs<BF16Blocks<B>> = true;
#endif

#if defined(SPLITSERVE_ISA_AMX)

// The same bfloat16 panels on AMX tiles (Sapphire Rapids and later), for
// prompts' rows under prefill_dtype=bfloat16 where K is a multiple of 32: a
// panel's 16 pairs (k, k + 1) of a block of 32 inputs are, as stored, the 16
// rows of 64 bytes an AMX B tile wants, so the panels need no other copy.  x
// arrives as plain bfloat16 rows (ldx pairs a row), zero rows after the last
// up to a multiple of AMX_ROWS (linear_cpu.cpp pads them): every tile loads
// 16 rows.  tdpbf16ps adds each pair's two exact products to a float32 sum,
// pairs in k order, one row's sums never touching another's, so a row's result
// does not depend on its batch; the sums are not vdpbf16ps's bits (the two
// instructions round differently), so a machine runs one or the other for a
// weight, whatever its rows.  Tiles: 0-3 sums (2 row tiles x 2 panels),
// 4-5 rows of x, 6-7 panels; sum tile t stored at c[t], c_stride bytes a row.
// The second panel starts `second` bytes after the first (the next panel's,
// or up's for gate's: amx_silu_rows).  Blocks kb0 to kb1 of K's: from kb0 = 0
// the sums start at zero, after it from c (a pass's sums, as the last stored
// them: float32 stored and loaded back exactly, so the same bits as one pass).
// B other than kPanels: p holds 4- or 8-bit blocks (pbytes a panel), each
// block made into its tile (make_tile) as it is needed: a step of few rows
// reads 6 or 9 bits a weight instead of the panels' 16, for the panels' bits.
template <bool TWO_ROWS, bool TWO_PANELS, BTiles B>
inline void amx_block(const uint8_t* x, int64_t xstride, const uint8_t* p, int64_t second, int64_t kb0, int64_t kb1,
                      float* const (&c)[4], const int64_t (&c_stride)[4]) {
  [[maybe_unused]] alignas(64) uint8_t made[2][16 * 64];  // blocks: a block's tile for each panel
  if (kb0 == 0) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {  // the sums so far, as the last pass stored them
    _tile_loadd(0, c[0], c_stride[0]);
    if constexpr (TWO_PANELS) _tile_loadd(1, c[1], c_stride[1]);
    if constexpr (TWO_ROWS) _tile_loadd(2, c[2], c_stride[2]);
    if constexpr (TWO_ROWS && TWO_PANELS) _tile_loadd(3, c[3], c_stride[3]);
  }
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    _tile_loadd(4, x + kb * 64, xstride);
    if constexpr (B != BTiles::kPanels) {
      make_tile<B>(p + kb * block_bytes<B>(), made[0]);
      if constexpr (TWO_PANELS) make_tile<B>(p + second + kb * block_bytes<B>(), made[1]);
      splitserve_amx::rows_written();
      _tile_loadd(6, made[0], 64);
      if constexpr (TWO_PANELS) _tile_loadd(7, made[1], 64);
    } else {
      _tile_loadd(6, p + kb * 16 * 64, 64);
      if constexpr (TWO_PANELS) _tile_loadd(7, p + second + kb * 16 * 64, 64);
    }
    if constexpr (TWO_ROWS) _tile_loadd(5, x + AMX_ROWS * xstride + kb * 64, xstride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (TWO_PANELS) _tile_dpbf16ps(1, 4, 7);
    if constexpr (TWO_ROWS) _tile_dpbf16ps(2, 5, 6);
    if constexpr (TWO_ROWS && TWO_PANELS) _tile_dpbf16ps(3, 5, 7);
  }
  // c: [row tile][panel] tiles of AMX_ROWS x 16 sums
  _tile_stored(0, c[0], c_stride[0]);
  if constexpr (TWO_PANELS) _tile_stored(1, c[1], c_stride[1]);
  if constexpr (TWO_ROWS) _tile_stored(2, c[2], c_stride[2]);
  if constexpr (TWO_ROWS && TWO_PANELS) _tile_stored(3, c[3], c_stride[3]);
}

// Rows of x [rows, K] -> plain bfloat16 rows (x[2 kp] low, x[2 kp + 1] high
// in each uint32): linear_cpu.cpp's rounding (round_bits), compiled here so
// that it runs AVX-512 wide.
void amx_plain_rows(const float* x, int64_t rows, int64_t K, uint32_t* out) {
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  for (int64_t i = 0; i < rows * K; ++i) o[i] = splitserve_bf16::round_bits(x[i]);
}

// The thread's tiles of sums that are not summed in y in place, for
// AMX_PASS_TILES row tiles of `panels` panels, on a cache line.
inline float* amx_sums(int64_t panels) {
  thread_local std::vector<float> buf;
  buf.resize(static_cast<size_t>(AMX_PASS_TILES * panels * AMX_ROWS * NR + 16));
  const auto at = reinterpret_cast<uintptr_t>(buf.data());
  return buf.data() + (64 - at % 64) % 64 / sizeof(float);
}

// K's passes for a task of `rows` rows and `pairs` panel pairs: more than one
// only where a row pair's share of x serves several pairs (AMX_PASS_BLOCKS).
inline int64_t amx_passes(int64_t rows, int64_t pairs, int64_t KB) {
  return rows > 2 * AMX_ROWS && pairs > 2 ? (KB + AMX_PASS_BLOCKS - 1) / AMX_PASS_BLOCKS : 1;
}

// fn(m, two_r, kb0, kb1, n) for each pair of row tiles from row m of a pass's
// pass_rows rows (two_r: the second tile has rows), each of K's passes
// (blocks kb0 to kb1), each panel n of np, n_step at a time: in that order,
// so that the rows' share of x stays in L1 while the panels' streams past.
template <typename Fn>
inline void amx_each_block(int64_t pass_rows, int64_t KB, int64_t passes, int64_t np, int64_t n_step, const Fn& fn) {
  for (int64_t m = 0; m < pass_rows; m += 2 * AMX_ROWS)
    for (int64_t pass = 0; pass < passes; ++pass)
      for (int64_t n = 0; n < np; n += n_step)
        fn(m, m + AMX_ROWS < pass_rows, KB * pass / passes, KB * (pass + 1) / passes, n);
}

template <BTiles B>
void amx_rows(const void* panels, int64_t pbytes, int64_t np, int64_t K, const float* x, int64_t ldx, const float*,
              int64_t, int64_t rows, const float* bias, int64_t col0, int64_t cols, float* y, int64_t ldy) {
  static_assert(AMX_ROWS == splitserve_amx::ROWS, "tiles of AMX_ROWS rows");
  const splitserve_amx::Config cfg;
  _tile_loadconfig(&cfg);  // per call: the thread may have run other tile code in between
  const uint8_t* p = static_cast<const uint8_t*>(panels);
  const uint8_t* xb = reinterpret_cast<const uint8_t*>(x);
  const int64_t xstride = ldx * 4, KB = K / QB, passes = amx_passes(rows, (np + 1) / 2, KB);
  float* const buf = amx_sums(np);  // [row tile][panel]
  auto tile = [&](int64_t rt, int64_t n) { return buf + (rt * np + n) * AMX_ROWS * NR; };
  for (int64_t r0 = 0; r0 < rows; r0 += AMX_PASS_TILES * AMX_ROWS) {
    const int64_t pass_rows = min64(AMX_PASS_TILES * AMX_ROWS, rows - r0);
    // A whole tile of y without a bias is summed in place; others in buf
    // (rows or columns past y's), the bias added as copied at the end.
    auto direct = [&](int64_t rt, int64_t n) {  // row tile rt of the pass, panel n
      return bias == nullptr && r0 + (rt + 1) * AMX_ROWS <= rows && (n + 1) * NR <= cols;
    };
    amx_each_block(pass_rows, KB, passes, np, 2, [&](int64_t m, bool two_r, int64_t kb0, int64_t kb1, int64_t n) {
      const bool two_p = n + 1 < np;
      const uint8_t* xm = xb + (r0 + m) * xstride;
      float* c[4];
      int64_t c_stride[4];
      for (int64_t t = 0; t < 4; ++t) {
        const int64_t rt = m / AMX_ROWS + (two_r ? t / 2 : 0), pn = n + (two_p ? t % 2 : 0);
        const bool in_y = direct(rt, pn);
        c[t] = in_y ? y + (r0 + rt * AMX_ROWS) * ldy + col0 + pn * NR : tile(rt, pn);
        c_stride[t] = in_y ? ldy * 4 : NR * 4;
      }
      const uint8_t* pn = p + n * pbytes;
      if (two_r && two_p) amx_block<true, true, B>(xm, xstride, pn, pbytes, kb0, kb1, c, c_stride);
      else if (two_r) amx_block<true, false, B>(xm, xstride, pn, pbytes, kb0, kb1, c, c_stride);
      else if (two_p) amx_block<false, true, B>(xm, xstride, pn, pbytes, kb0, kb1, c, c_stride);
      else amx_block<false, false, B>(xm, xstride, pn, pbytes, kb0, kb1, c, c_stride);
    });
    for (int64_t rt = 0; rt * AMX_ROWS < pass_rows; ++rt)
      for (int64_t n = 0; n < np; ++n) {
        const int64_t m0 = r0 + rt * AMX_ROWS;
        if (!direct(rt, n))
          store_tile(tile(rt, n), min64(AMX_ROWS, rows - m0), bias, col0 + n * NR, min64(NR, cols - n * NR),
                     y + m0 * ldy, ldy);
      }
  }
  _tile_release();
}
#endif

#if defined(SPLITSERVE_ISA_BF16)
// The sums of a format that reads x as pairs (kReadsPairs), 2 panels at a
// time, x's tiles of MR rows (ldx pairs a row): done(tile, n, pn, m, r) with
// panels n .. n + pn times rows m .. m + r, panel j's r rows at tile + j r NR.
template <typename Format, typename Done>
inline void pair_tiles(const uint8_t* p, int64_t pbytes, int64_t np, int64_t K, const float* x, int64_t ldx,
                       int64_t rows, const Done& done) {
  alignas(64) float tile[MR * NR * NP_BF];
  const int64_t tiles = (rows + MR - 1) / MR;
  for (int64_t n = 0; n < np; n += NP_BF) {
    const int64_t pn = min64(NP_BF, np - n);
    for (int64_t m = 0; m < rows; m += MR) {
      const int64_t r = min64(MR, rows - m);
      // The row tiles of several ask for the next two panels between them
      // (past the last: the next call's, which follow in memory; a prefetch
      // never faults).
      if (pn == NP_BF)
        run_rows<Format, MR, NP_BF>(p + n * pbytes, pbytes, K, x + m * ldx, ldx, nullptr, 0, r, tile,
                                    ahead_of(p + (n + NP_BF) * pbytes, m / MR, tiles));
      else
        run_rows<Format, MR, 1>(p + n * pbytes, pbytes, K, x + m * ldx, ldx, nullptr, 0, r, tile);
      done(tile, n, pn, m, r);
    }
  }
}
#endif

#if defined(SPLITSERVE_ISA_BF16) && !defined(SPLITSERVE_ISA_AMX)
// The largest argmax_key of a panel's first `width` sums (at s), the first at
// column col: the largest value and the first lane holding it, unless a lane
// is a NaN (its bits: -ffast-math may drop a NaN test on floats).
inline uint64_t panel_argmax(const float* s, int64_t width, int64_t col) {
  const __mmask16 valid = width >= NR ? 0xffff : static_cast<__mmask16>((1u << width) - 1);
  const __m512i bits = _mm512_loadu_si512(s);
  const __mmask16 nan = _mm512_mask_cmpgt_epu32_mask(
      valid, _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  if (nan) return argmax_key(s[__builtin_ctz(nan)], col + __builtin_ctz(nan));
  // Lanes past `width` as -inf, which no valid lane's value is below.
  const __m512 v = _mm512_mask_mov_ps(_mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0xff800000u))), valid,
                                      _mm512_castsi512_ps(bits));
  __m512 m = _mm512_max_ps(v, _mm512_shuffle_f32x4(v, v, 0x4e));
  m = _mm512_max_ps(m, _mm512_shuffle_f32x4(m, m, 0xb1));
  m = _mm512_max_ps(m, _mm512_permute_ps(m, 0x4e));
  m = _mm512_max_ps(m, _mm512_permute_ps(m, 0xb1));  // every lane the largest
  const __mmask16 at = _mm512_mask_cmp_ps_mask(valid, v, m, _CMP_EQ_OQ);
  const int j = at ? __builtin_ctz(at) : 0;
  return argmax_key(s[j], col + j);
}

// linear_isa_api.h's ArgmaxPanelRows: rows_times_panels<Format>'s tiles (its
// sums), each row's best key taken while the tile is in cache.  Format: BF16
// (the panels) or BF16Blocks (the blocks they were rounded from).
template <typename Format>
void bf16_argmax_rows(const void* panels, int64_t pbytes, int64_t np, int64_t K, const float* x, int64_t ldx,
                      int64_t rows, int64_t col0, int64_t cols, uint64_t* best) {
  pair_tiles<Format>(static_cast<const uint8_t*>(panels), pbytes, np, K, x, ldx, rows,
                     [&](const float* t, int64_t n, int64_t pn, int64_t m, int64_t r) {
                       for (int64_t j = 0; j < pn; ++j) {
                         const int64_t c = (n + j) * NR, width = min64(NR, cols - c);
                         for (int64_t i = 0; i < r; ++i)
                           best[m + i] = std::max(best[m + i], panel_argmax(t + (j * r + i) * NR, width, col0 + c));
                       }
                     });
}
#endif

template <typename Format>
void rows_times_panels(const void* panels, int64_t pbytes, int64_t np, int64_t K, const float* x, int64_t ldx,
                       const float* xs, int64_t ldxs, int64_t rows, const float* bias, int64_t col0, int64_t cols,
                       float* y, int64_t ldy) {
  constexpr int NPW = Format::NP_MAX;
  const uint8_t* p = static_cast<const uint8_t*>(panels);
  alignas(64) float tile[MR * NR * NP_WIDE];
  int64_t n = 0;
  // Rows in tiles of at most MR, as even as they divide (32 rows: 5 and 6, not
  // five of 6 and one of 2, whose few accumulators leave the FMA units idle).
  // A row's sums never depend on the tile it is in.
  const int64_t tiles = (rows + MR - 1) / MR;
#if defined(SPLITSERVE_ISA_BF16)
  if constexpr (kReadsPairs<Format>) {
    pair_tiles<Format>(p, pbytes, np, K, x, ldx, rows, [&](const float* t, int64_t n, int64_t pn, int64_t m, int64_t r) {
      for (int64_t j = 0; j < pn; ++j)
        store_tile(t + j * r * NR, r, bias, col0 + (n + j) * NR, min64(NR, cols - (n + j) * NR), y + m * ldy, ldy);
    });
    return;
  }
#endif
  if (rows <= MR_WIDE) {  // few rows: several panels at a time
#if defined(SPLITSERVE_Q4_SCALED_X)
    if constexpr (std::is_same_v<Format, Q4>) {
      thread_local std::vector<float> scaled;
      if (q4_prescale(x, ldx, K, rows, scaled))
        for (; n + NPW <= np; n += NPW) {
          run_rows<Q4T<true>, MR_WIDE, NPW>(p + n * pbytes, pbytes, K, scaled.data(), K, xs, ldxs, rows, tile);
          for (int64_t j = 0; j < NPW; ++j)
            store_tile(tile + j * rows * NR, rows, bias, col0 + (n + j) * NR, min64(NR, cols - (n + j) * NR), y,
                       ldy);
        }
    }
#endif
    for (; n + NPW <= np; n += NPW) {
      run_rows<Format, MR_WIDE, NPW>(p + n * pbytes, pbytes, K, x, ldx, xs, ldxs, rows, tile);
      for (int64_t j = 0; j < NPW; ++j)
        store_tile(tile + j * rows * NR, rows, bias, col0 + (n + j) * NR, min64(NR, cols - (n + j) * NR), y, ldy);
    }
  }
  if constexpr (std::is_same_v<Format, Q4>) {
    if (rows > MR) {  // more than one row tile: decode each panel once (Q4F), in spans for few rows
      const int64_t KB = K / QB, span_blocks = rows <= Q4F_SPAN_ROWS ? Q4F_SPAN : KB;
      const int64_t span_floats = span_blocks * Q4F_BLOCK_FLOATS;
      thread_local std::vector<float> dec, sums;
      dec.resize(static_cast<size_t>(NP_Q4F * span_floats));
      sums.resize(static_cast<size_t>(rows * NP_Q4F * NR));
      const uint8_t* d = reinterpret_cast<const uint8_t*>(dec.data());
      while (n < np) {  // NP_Q4F panels at a time in row tiles of MR_Q4F, a panel left over in tiles of MR
        const int64_t pn = np - n >= NP_Q4F ? NP_Q4F : 1, ft = pn == NP_Q4F ? (rows + MR_Q4F - 1) / MR_Q4F : tiles;
        std::fill_n(sums.data(), rows * pn * NR, 0.0f);
        for (int64_t kb = 0; kb < KB; kb += span_blocks) {
          const int64_t span = min64(span_blocks, KB - kb);
          for (int64_t j = 0; j < pn; ++j)
            q4_decode_panel(p + (n + j) * pbytes + kb * Q4_BLOCK_BYTES, span * QB, dec.data() + j * span_floats);
          if (span_blocks < KB) {  // the next span of these panels or, after the last, the panels that follow
            const uint8_t* next =
                kb + span < KB ? p + n * pbytes + (kb + span) * Q4_BLOCK_BYTES : p + (n + pn) * pbytes;
            for (int64_t j = 0; j < pn; ++j) prefetch_block<2>(next + j * pbytes, span_blocks * Q4_BLOCK_BYTES);
          }
          for (int64_t t = 0; t < ft; ++t) {
            const auto [m, r] = row_tile(rows, t, ft);
            const float* xt = x + m * ldx + kb * QB;
            const float* xst = xs + m * ldxs + kb;
            float* acc = sums.data() + m * pn * NR;
            if (pn == NP_Q4F)
              run_rows<Q4F, MR_Q4F, NP_Q4F>(d, span_floats * 4, span * QB, xt, ldx, xst, ldxs, r, acc);
            else
              run_rows<Q4F, MR, 1>(d, span_floats * 4, span * QB, xt, ldx, xst, ldxs, r, acc);
          }
        }
        for (int64_t t = 0; t < ft; ++t) {
          const auto [m, r] = row_tile(rows, t, ft);
          for (int64_t j = 0; j < pn; ++j)
            store_tile(sums.data() + m * pn * NR + j * r * NR, r, bias, col0 + (n + j) * NR,
                       min64(NR, cols - (n + j) * NR), y + m * ldy, ldy);
        }
        n += pn;
      }
      return;
    }
  }
  for (; n < np; ++n)
    for (int64_t t = 0; t < tiles; ++t) {
      const auto [m, r] = row_tile(rows, t, tiles);
      // A panel's row tiles ask for the next panel between them (past the
      // last: the panels that follow in memory, a prefetch never faults).
      run_rows<Format, MR, 1>(p + n * pbytes, pbytes, K, x + m * ldx, ldx, xs + m * ldxs, ldxs, r, tile,
                              ahead_of(p + (n + 1) * pbytes, t, tiles));
      store_tile(tile, r, bias, col0 + n * NR, min64(NR, cols - n * NR), y + m * ldy, ldy);
    }
}

// decode_dtype=int8 (linear_isa_api.h): 4-bit (Q8 false) or 8-bit blocks
// times int8 rows.  The portable form, one panel and row at a time; the
// integer sums are exact and the fold is the VNNI kernels', so all give the
// same bits.  `sx`: 4-bit blocks' float32 sums of x (8-bit blocks need none).
template <bool Q8>
void int8_rows(const void* panels, int64_t pbytes, int64_t np, int64_t K, const int8_t* xq, int64_t ldx,
               const float* dx, const float* sx, int64_t ldxs, int64_t rows, const float* bias, int64_t col0,
               int64_t cols, float* y, int64_t ldy) {
  const uint8_t* base = static_cast<const uint8_t*>(panels);
  constexpr int64_t BB = Q8 ? Q8_BLOCK_BYTES : Q4_BLOCK_BYTES;
  for (int64_t n = 0; n < np; ++n) {
    const int64_t nc = min64(NR, cols - n * NR);
    for (int64_t i = 0; i < rows; ++i) {
      float acc[NR] = {};
      for (int64_t kb = 0; kb < K / QB; ++kb) {
        const uint8_t* blk = base + n * pbytes + kb * BB;
        const float* d = reinterpret_cast<const float*>(blk);
        const int8_t* x = xq + i * ldx + kb * QB;
        int32_t s[NR] = {};
        const float xd = dx[i * ldxs + kb];
        if constexpr (Q8) {
          const int8_t* q = reinterpret_cast<const int8_t*>(blk + NR * 4);
          for (int64_t kk = 0; kk < QB; ++kk)
            for (int64_t j = 0; j < NR; ++j) s[j] += q[kk * NR + j] * x[kk];
          for (int64_t j = 0; j < NR; ++j) acc[j] = __builtin_fmaf(d[j] * xd, static_cast<float>(s[j]), acc[j]);
        } else {
          const uint8_t* nib = blk + 2 * NR * 4;
          for (int64_t kk = 0; kk < QB; ++kk)
            for (int64_t j = 0; j < NR; ++j) s[j] += q4_value(nib + kk / 8 * 64, static_cast<int>(kk % 8), j) * x[kk];
          const float xsum = sx[i * ldxs + kb];
          for (int64_t j = 0; j < NR; ++j)
            acc[j] = __builtin_fmaf(xsum, d[NR + j], __builtin_fmaf(d[j] * xd, static_cast<float>(s[j]), acc[j]));
        }
      }
      float* out = y + i * ldy + col0 + n * NR;
      for (int64_t j = 0; j < nc; ++j) out[j] = bias ? acc[j] + bias[col0 + n * NR + j] : acc[j];
    }
  }
}

void q8i8_rows(const void* panels, int64_t pbytes, int64_t np, int64_t K, const int8_t* xq, int64_t ldx,
               const float* dx, const int32_t*, int64_t ldxs, int64_t rows, const float* bias, int64_t col0,
               int64_t cols, float* y, int64_t ldy) {
  int8_rows<true>(panels, pbytes, np, K, xq, ldx, dx, nullptr, ldxs, rows, bias, col0, cols, y, ldy);
}

// Every one of R x NP sums set to z.
template <typename V, int R, int NP>
inline void set_all(V (&a)[R][NP], V z) {
  for (int r = 0; r < R; ++r)
    for (int n = 0; n < NP; ++n) a[r][n] = z;
}

// A 4-bit block decoded for the integer kernels: d, m as stored, then 8 groups
// of 4 inputs, each 16 columns x 4 bytes (column j's q values of the group's
// inputs at bytes 4j..4j+3).
constexpr int64_t I8D_BLOCK_BYTES = 2 * NR * 4 + QB * NR;

// A 4-bit panel's blocks -> the decoded layout: d, m as stored, the nibbles
// through groups(the block's nibbles, its 8 groups out).
template <typename Groups>
inline void decode_q4_panel(const uint8_t* p, int64_t K, uint8_t* out, Groups groups) {
  for (int64_t kb = 0; kb < K / QB; ++kb) {
    const uint8_t* blk = p + kb * Q4_BLOCK_BYTES;
    prefetch_block(blk + Q4_AHEAD * Q4_BLOCK_BYTES, Q4_BLOCK_BYTES);
    uint8_t* o = out + kb * I8D_BLOCK_BYTES;
    std::memcpy(o, blk, 2 * NR * 4);
    groups(blk + 2 * NR * 4, o + 2 * NR * 4);
  }
}

#if defined(SPLITSERVE_ISA_AVX2) || defined(SPLITSERVE_ISA_AVX512)
// The int8 kernel on AVX2 (also AVX-512 without VNNI): each panel's nibbles
// split once per call into the groups (low nibbles, high nibbles), then
// vpmaddubsw (unsigned q times signed xq, pairs summed to 16 bits: at most
// 2 * 15 * 127) added in 16 bits over a block (8 of them: at most 30,480, no
// overflow) and widened once a block by vpmaddwd: exact integers, folded as
// the others fold them.
constexpr int MR_I8A = 4;

inline void i8_decode_panel_avx2(const uint8_t* p, int64_t K, uint8_t* out) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  decode_q4_panel(p, K, out, [&](const uint8_t* nib, uint8_t* o) {
    for (int c = 0; c < QB / 8; ++c)  // chunk c: groups 2c (low nibbles) and 2c + 1 (high)
      for (int h = 0; h < 2; ++h) {   // columns 0-7, 8-15
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nib + c * 64 + h * 32));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c * 128 + h * 32), _mm256_and_si256(v, mask));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c * 128 + 64 + h * 32),
                            _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
      }
  });
}



// 8-bit blocks (the head) on AVX2: each panel decoded once per call to the
// same groups (4 inputs x 16 columns, column j's 4 bytes together), d as
// stored; vpmaddubsw of |q| and xq with q's sign (pairs at most 2 * 127 * 127
// in 16 bits), widened at once by vpmaddwd.
constexpr int64_t Q8D_BLOCK_BYTES = NR * 4 + QB * NR;

inline void q8_decode_panel_avx2(const uint8_t* p, int64_t K, uint8_t* out) {
  // (row 0, 2), (row 1, 3) pairs of 4 columns -> each column's 4 bytes
  const __m256i quads = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15, 0, 8, 1, 9, 2, 10, 3,
                                         11, 4, 12, 5, 13, 6, 14, 7, 15);
  for (int64_t kb = 0; kb < K / QB; ++kb) {
    const uint8_t* blk = p + kb * Q8_BLOCK_BYTES;
    prefetch_block(blk + Q4_AHEAD * Q8_BLOCK_BYTES, Q8_BLOCK_BYTES);
    uint8_t* o = out + kb * Q8D_BLOCK_BYTES;
    std::memcpy(o, blk, NR * 4);
    for (int g = 0; g < QB / 4; ++g) {
      const uint8_t* q = blk + NR * 4 + g * 4 * NR;
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));       // inputs 0, 1
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32));  // inputs 2, 3
      const __m256i half[2] = {_mm256_unpacklo_epi8(a, b), _mm256_unpackhi_epi8(a, b)};  // columns 0-7, 8-15
      for (int h = 0; h < 2; ++h)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + NR * 4 + g * 64 + h * 32),
                            _mm256_shuffle_epi8(_mm256_permute4x64_epi64(half[h], 0xD8), quads));
    }
  }
}

// R rows of a decoded panel (4-bit: I8D blocks, with sx; 8-bit: Q8D blocks).
template <bool Q8, int R>
void int8_tile_avx2(const uint8_t* dec, int64_t K, const int8_t* xq, int64_t ldx, const float* dx, const float* sx,
                    int64_t ldxs, float* tile) {
  const __m256i ones = _mm256_set1_epi16(1);
  constexpr int64_t BB = Q8 ? Q8D_BLOCK_BYTES : I8D_BLOCK_BYTES, DM = Q8 ? NR * 4 : 2 * NR * 4;
  __m256 acc[R][2];
  set_all(acc, _mm256_setzero_ps());
  for (int64_t kb = 0; kb < K / QB; ++kb) {
    const uint8_t* b = dec + kb * BB;
    __m256i s[R][2];
    set_all(s, _mm256_setzero_si256());
    for (int g = 0; g < QB / 4; ++g) {
      __m256i w[2], wa[2];
      for (int h = 0; h < 2; ++h) {
        w[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + DM + g * 64 + h * 32));
        if constexpr (Q8) wa[h] = _mm256_abs_epi8(w[h]);
      }
      for (int r = 0; r < R; ++r) {
        int32_t xv;
        std::memcpy(&xv, xq + r * ldx + kb * QB + g * 4, 4);
        const __m256i xb = _mm256_set1_epi32(xv);
        for (int h = 0; h < 2; ++h) {
          if constexpr (Q8)  // 32-bit sums each group: 8-bit pairs reach 32,258
            s[r][h] = _mm256_add_epi32(
                s[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(wa[h], _mm256_sign_epi8(xb, w[h])), ones));
          else  // 16-bit sums over the block, widened below
            s[r][h] = _mm256_add_epi16(s[r][h], _mm256_maddubs_epi16(w[h], xb));
        }
      }
    }
    const float* dm = reinterpret_cast<const float*>(b);
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_loadu_ps(dm + 8 * h);
      for (int r = 0; r < R; ++r) {
        const __m256 si = _mm256_cvtepi32_ps(Q8 ? s[r][h] : _mm256_madd_epi16(s[r][h], ones));
        const __m256 t = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(dx[r * ldxs + kb])), si, acc[r][h]);
        acc[r][h] = Q8 ? t : _mm256_fmadd_ps(_mm256_set1_ps(sx[r * ldxs + kb]), _mm256_loadu_ps(dm + NR + 8 * h), t);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(tile + r * NR, acc[r][0]);
    _mm256_storeu_ps(tile + r * NR + 8, acc[r][1]);
  }
}


// f(integral_constant R') for R' = min(rows, R): the tile of the rows left.
template <int R, typename F>
inline void tile_of(int64_t rows, F f) {
  if constexpr (R > 1) {
    if (rows < R) return tile_of<R - 1>(rows, f);
  }
  f(std::integral_constant<int, R>{});
}

// The AVX2 kernels' loop: each panel decoded once per call into a buffer of
// dec_bytes (decode(panel, buffer)), then rows in tiles of MR_I8A
// (run(R as an integral_constant, buffer, first row, tile)), stored into y.
template <typename Decode, typename Run>
void avx2_panels(const uint8_t* p, int64_t pbytes, int64_t np, int64_t dec_bytes, int64_t rows, const float* bias,
                 int64_t col0, int64_t cols, float* y, int64_t ldy, Decode decode, Run run) {
  thread_local std::vector<uint8_t> dec;
  dec.resize(static_cast<size_t>(dec_bytes));
  alignas(32) float tile[MR_I8A * NR];
  const int64_t ft = (rows + MR_I8A - 1) / MR_I8A;
  for (int64_t n = 0; n < np; ++n) {
    decode(p + n * pbytes, dec.data());
    // The next panel asked for while the tiles compute, as in i8_decoded_rows
    // (Zen 4 on this AVX2 code, 32 rows, 30 layers: 28.2-28.3 -> 26.1-26.7 ms).
    // Not for one tile: one row took 1.04-1.16x as long with it.
    const uint8_t* next = p + (n + 1) * pbytes;
    for (int64_t m = 0, t = 0; m < rows; m += MR_I8A, ++t) {
      if (ft > 1) splitserve_prefetch::prefetch_share(next, pbytes, t, ft);
      const int64_t r = min64(MR_I8A, rows - m);
      tile_of<MR_I8A>(r, [&](auto rc) { run(rc, dec.data(), m, tile); });
      store_tile(tile, r, bias, col0 + n * NR, min64(NR, cols - n * NR), y + m * ldy, ldy);
    }
  }
}

void q4i8_rows_avx2(const void* panels, int64_t pbytes, int64_t np, int64_t K, const int8_t* xq, int64_t ldx,
                    const float* dx, const float* sx, int64_t ldxs, int64_t rows, const float* bias, int64_t col0,
                    int64_t cols, float* y, int64_t ldy) {
  avx2_panels(
      static_cast<const uint8_t*>(panels), pbytes, np, K / QB * I8D_BLOCK_BYTES, rows, bias, col0, cols, y, ldy,
      [&](const uint8_t* p, uint8_t* dec) { i8_decode_panel_avx2(p, K, dec); },
      [&](auto rc, const uint8_t* dec, int64_t m, float* tile) {
        int8_tile_avx2<false, decltype(rc)::value>(dec, K, xq + m * ldx, ldx, dx + m * ldxs, sx + m * ldxs, ldxs,
                                                   tile);
      });
}

void q8i8_rows_avx2(const void* panels, int64_t pbytes, int64_t np, int64_t K, const int8_t* xq, int64_t ldx,
                    const float* dx, const int32_t*, int64_t ldxs, int64_t rows, const float* bias, int64_t col0,
                    int64_t cols, float* y, int64_t ldy) {
  avx2_panels(
      static_cast<const uint8_t*>(panels), pbytes, np, K / QB * Q8D_BLOCK_BYTES, rows, bias, col0, cols, y, ldy,
      [&](const uint8_t* p, uint8_t* dec) { q8_decode_panel_avx2(p, K, dec); },
      [&](auto rc, const uint8_t* dec, int64_t m, float* tile) {
        int8_tile_avx2<true, decltype(rc)::value>(dec, K, xq + m * ldx, ldx, dx + m * ldxs, nullptr, ldxs, tile);
      });
}
#endif

#if defined(SPLITSERVE_ISA_VNNI)
// The same with vpdpbusd: a 64-byte vector of the panel holds, per column j
// (32-bit lane j), its q values of 4 consecutive inputs, and one x broadcast
// (those 4 inputs' int8 values) adds all 16 columns' 4 products to their
// int32 sums.  A 64-byte chunk of nibbles is two such vectors: its low
// nibbles and its high ones (linear_isa_api.h).  Few rows split the nibbles
// as they go; more rows split NP_I8D panels once per call into a buffer
// every row tile reads (the 8-bit head alike: its bytes reordered).
constexpr int MR_I8 = 4;               // few rows: 4 rows of int32 sums a tile, one panel
constexpr int MR_I8D = 6, NP_I8D = 2;  // decoded panels: 6 x 2 (+ 12 outputs)

// 8 inputs' nibbles (a 64-byte chunk) -> their two groups of 4 inputs.
inline void i8_groups(const uint8_t* nib, __m512i& g0, __m512i& g1) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const __m512i v = _mm512_loadu_si512(nib);
  g0 = _mm512_and_si512(v, mask);
  g1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
}

inline __m512i x4(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}

// acc += d * dx * s + m * sx for one block (the portable kernel's order).
inline __m512 i8_fold(__m512 acc, __m512i s, __m512 d, __m512 m, float xd, float xsum) {
  return _mm512_fmadd_ps(_mm512_set1_ps(xsum), m, _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xd)),
                                                                   _mm512_cvtepi32_ps(s), acc));
}

// Asks for block kb + Q4_AHEAD of each of np panels (pbytes apart, KB blocks
// of `bytes`); past a panel's end, the panels after them (the next call's).
inline void prefetch_ahead(const uint8_t* p, int64_t pbytes, int np, int64_t kb, int64_t KB, int64_t bytes) {
  const int64_t ahead = kb + Q4_AHEAD < KB ? kb + Q4_AHEAD : kb + Q4_AHEAD - KB + np * KB;
  for (int n = 0; n < np; ++n) prefetch_block(p + n * pbytes + ahead * bytes, bytes);
}

// R rows x NP panels read from their nibbles (dec == false: p the blocks,
// pbytes apart) or from decoded panels (dec: p the buffer, pbytes apart).
template <bool DEC, int R, int NP>
void i8_tile(const uint8_t* p, int64_t pbytes, int64_t K, const int8_t* xq, int64_t ldx, const float* dx,
             const float* sx, int64_t ldxs, float* tile) {
  constexpr int64_t BB = DEC ? I8D_BLOCK_BYTES : Q4_BLOCK_BYTES;
  __m512 acc[R][NP];
  set_all(acc, _mm512_setzero_ps());
  for (int64_t kb = 0; kb < K / QB; ++kb) {
    if constexpr (!DEC) prefetch_ahead(p, pbytes, NP, kb, K / QB, Q4_BLOCK_BYTES);
    __m512i s[R][NP];
    set_all(s, _mm512_setzero_si512());
    for (int h = 0; h < QB / 8; ++h) {
      __m512i w[NP][2];
      for (int n = 0; n < NP; ++n) {
        const uint8_t* b = p + n * pbytes + kb * BB + 2 * NR * 4;
        if constexpr (DEC) {
          w[n][0] = _mm512_loadu_si512(b + h * 128);
          w[n][1] = _mm512_loadu_si512(b + h * 128 + 64);
        } else {
          i8_groups(b + h * 64, w[n][0], w[n][1]);
        }
      }
      for (int g = 0; g < 2; ++g)
        for (int r = 0; r < R; ++r) {
          const __m512i xb = x4(xq + r * ldx + kb * QB + h * 8 + g * 4);
          for (int n = 0; n < NP; ++n) s[r][n] = _mm512_dpbusd_epi32(s[r][n], w[n][g], xb);
        }
    }
    for (int n = 0; n < NP; ++n) {
      const float* dm = reinterpret_cast<const float*>(p + n * pbytes + kb * BB);
      const __m512 d = _mm512_loadu_ps(dm), m = _mm512_loadu_ps(dm + NR);
      for (int r = 0; r < R; ++r) acc[r][n] = i8_fold(acc[r][n], s[r][n], d, m, dx[r * ldxs + kb], sx[r * ldxs + kb]);
    }
  }
  for (int n = 0; n < NP; ++n)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(tile + (n * R + r) * NR, acc[r][n]);
}

template <bool DEC, int R, int NP>
void i8_rows(const uint8_t* p, int64_t pbytes, int64_t K, const int8_t* xq, int64_t ldx, const float* dx,
             const float* sx, int64_t ldxs, int64_t rows, float* tile) {
  if constexpr (R > 1) {
    if (rows < R) return i8_rows<DEC, R - 1, NP>(p, pbytes, K, xq, ldx, dx, sx, ldxs, rows, tile);
  }
  i8_tile<DEC, R, NP>(p, pbytes, K, xq, ldx, dx, sx, ldxs, tile);
}

// A panel's blocks -> the decoded layout (d, m as stored; the nibbles as groups).
inline void i8_decode_panel(const uint8_t* p, int64_t K, uint8_t* out) {
  decode_q4_panel(p, K, out, [&](const uint8_t* nib, uint8_t* o) {
    for (int h = 0; h < QB / 8; ++h) {
      __m512i g0, g1;
      i8_groups(nib + h * 64, g0, g1);
      _mm512_storeu_si512(o + h * 128, g0);
      _mm512_storeu_si512(o + h * 128 + 64, g1);
    }
  });
}

// Few rows: one panel after another, in memory order (their blocks' reads
// bound them: one stream a thread; 4 panels read together were 4, and on a
// Zen 4, family 25 model 17, a float32 model's int8 decode step of one
// sequence took 0.85-0.91x the time this way, of 4 0.88x, of 16 0.97x), in
// tiles of MR_I8 rows; run(NP as an integral_constant, the panel, first row,
// rows, tile) computes a tile, stored here into y.
template <typename Run>
void i8_few_rows(const uint8_t* p, int64_t pbytes, int64_t np, int64_t rows, const float* bias, int64_t col0,
                 int64_t cols, float* y, int64_t ldy, Run run) {
  alignas(64) float tile[MR_I8 * NR];
  for (int64_t n = 0; n < np; ++n)
    for (int64_t m = 0; m < rows; m += MR_I8) {
      const int64_t r = min64(MR_I8, rows - m);
      run(std::integral_constant<int, 1>{}, p + n * pbytes, m, r, tile);
      store_tile(tile, r, bias, col0 + n * NR, min64(NR, cols - n * NR), y + m * ldy, ldy);
    }
}

// More rows: NP_I8D panels at a time decoded once (decode(panel, out): dec_bytes
// a panel) into a buffer that every tile of up to MR_I8D rows reads; run(NP
// as an integral_constant, the buffer, first row, rows, tile) computes a tile,
// stored here into y.
template <typename Decode, typename Run>
void i8_decoded_rows(const uint8_t* p, int64_t pbytes, int64_t np, int64_t dec_bytes, int64_t rows, const float* bias,
                     int64_t col0, int64_t cols, float* y, int64_t ldy, Decode decode, Run run) {
  alignas(64) float tile[MR_I8D * NR * NP_I8D];
  thread_local std::vector<uint8_t> dec;
  dec.resize(static_cast<size_t>(NP_I8D * dec_bytes));
  const int64_t ft = (rows + MR_I8D - 1) / MR_I8D;
  for (int64_t n = 0; n < np; n += NP_I8D) {
    const int64_t pn = min64(NP_I8D, np - n);
    for (int64_t j = 0; j < pn; ++j) decode(p + (n + j) * pbytes, dec.data() + j * dec_bytes);
    // The NP_I8D panels after these (the next task's, in this thread's share)
    // asked for into L2, a tile's part at a time, while the tiles compute:
    // decoded right after, they no longer wait on memory (a model's weights
    // stream from it every step).  Zen 4, family 25 model 17, 32 rows, 30
    // layers' projections on distinct weights: 16.5-17.2 -> 15.5-15.8 ms
    // (locality 0 and 3: no gain).
    const uint8_t* next = p + (n + pn) * pbytes;
    for (int64_t t = 0; t < ft; ++t) {  // row tiles as even as they divide
      splitserve_prefetch::prefetch_share(next, NP_I8D * pbytes, t, ft);
      const auto [m, r] = row_tile(rows, t, ft);
      if (pn == NP_I8D)
        run(std::integral_constant<int, NP_I8D>{}, dec.data(), m, r, tile);
      else
        run(std::integral_constant<int, 1>{}, dec.data(), m, r, tile);
      for (int64_t j = 0; j < pn; ++j)
        store_tile(tile + j * r * NR, r, bias, col0 + (n + j) * NR, min64(NR, cols - (n + j) * NR), y + m * ldy, ldy);
    }
  }
}

// Few rows (up to 4 * MR_I8) read the panels as they go; more decode them
// first (i8_decoded_rows).  tile(DEC and NP as integral constants, the
// panels or the buffer, bytes a panel, first row, rows, tile) computes a tile.
template <typename Decode, typename Tile>
void i8_rows_any(const uint8_t* p, int64_t pbytes, int64_t np, int64_t dec_bytes, int64_t rows, const float* bias,
                 int64_t col0, int64_t cols, float* y, int64_t ldy, Decode decode, Tile tile) {
  if (rows <= 4 * MR_I8) {
    i8_few_rows(p, pbytes, np, rows, bias, col0, cols, y, ldy,
                [&](auto np_c, const uint8_t* pp, int64_t m, int64_t r, float* t) {
                  tile(std::false_type{}, np_c, pp, pbytes, m, r, t);
                });
    return;
  }
  i8_decoded_rows(p, pbytes, np, dec_bytes, rows, bias, col0, cols, y, ldy, decode,
                  [&](auto np_c, const uint8_t* dec, int64_t m, int64_t r, float* t) {
                    tile(std::true_type{}, np_c, dec, dec_bytes, m, r, t);
                  });
}

void q4i8_rows_vnni(const void* panels, int64_t pbytes, int64_t np, int64_t K, const int8_t* xq, int64_t ldx,
                    const float* dx, const float* sx, int64_t ldxs, int64_t rows, const float* bias, int64_t col0,
                    int64_t cols, float* y, int64_t ldy) {
  i8_rows_any(static_cast<const uint8_t*>(panels), pbytes, np, K / QB * I8D_BLOCK_BYTES, rows, bias, col0, cols, y,
              ldy, [&](const uint8_t* panel, uint8_t* out) { i8_decode_panel(panel, K, out); },
              [&](auto dec_c, auto np_c, const uint8_t* pp, int64_t bytes, int64_t m, int64_t r, float* t) {
                constexpr bool DEC = decltype(dec_c)::value;
                i8_rows<DEC, DEC ? MR_I8D : MR_I8, decltype(np_c)::value>(pp, bytes, K, xq + m * ldx, ldx,
                                                                          dx + m * ldxs, sx + m * ldxs, ldxs, r, t);
              });
}

// 8-bit blocks: 4 inputs' rows of 16 columns (64 bytes) reordered by one vpermb
// to column j's 4 bytes at lane j, made unsigned (+128: the sign bit flipped)
// for vpdpbusd, whose sums then exceed the signed ones by 128 * sum(xq).
inline __m512i q8_index() {
  alignas(64) uint8_t idx[64];
  for (int j = 0; j < NR; ++j)
    for (int i = 0; i < 4; ++i) idx[4 * j + i] = static_cast<uint8_t>(NR * i + j);
  return _mm512_load_si512(idx);
}

// DEC: the panels were decoded first (q8_decode_panel_vnni: the bytes already
// reordered and made unsigned), so a chunk is used as loaded.
template <bool DEC, int R, int NP>
void q8i8_tile(const uint8_t* p, int64_t pbytes, int64_t K, const int8_t* xq, int64_t ldx, const float* dx,
               const int32_t* xc, int64_t ldxs, float* tile) {
  const __m512i idx = q8_index(), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R][NP];
  set_all(acc, _mm512_setzero_ps());
  for (int64_t kb = 0; kb < K / QB; ++kb) {
    if constexpr (!DEC) prefetch_ahead(p, pbytes, NP, kb, K / QB, Q8_BLOCK_BYTES);
    __m512i s[R][NP];
    set_all(s, _mm512_setzero_si512());
    for (int g = 0; g < QB / 4; ++g) {
      __m512i w[NP];
      for (int n = 0; n < NP; ++n) {
        const __m512i chunk = _mm512_loadu_si512(p + n * pbytes + kb * Q8_BLOCK_BYTES + NR * 4 + g * 64);
        w[n] = DEC ? chunk : _mm512_xor_si512(_mm512_permutexvar_epi8(idx, chunk), flip);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i xb = x4(xq + r * ldx + kb * QB + g * 4);
        for (int n = 0; n < NP; ++n) s[r][n] = _mm512_dpbusd_epi32(s[r][n], w[n], xb);
      }
    }
    for (int n = 0; n < NP; ++n) {
      const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(p + n * pbytes + kb * Q8_BLOCK_BYTES));
      for (int r = 0; r < R; ++r) {
        const __m512i exact = _mm512_sub_epi32(s[r][n], _mm512_set1_epi32(128 * xc[r * ldxs + kb]));
        acc[r][n] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[r * ldxs + kb])), _mm512_cvtepi32_ps(exact),
                                    acc[r][n]);
      }
    }
  }
  for (int n = 0; n < NP; ++n)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(tile + (n * R + r) * NR, acc[r][n]);
}

template <bool DEC, int R, int NP>
void q8i8_tile_rows(const uint8_t* p, int64_t pbytes, int64_t K, const int8_t* xq, int64_t ldx, const float* dx,
                    const int32_t* xc, int64_t ldxs, int64_t rows, float* tile) {
  if constexpr (R > 1) {
    if (rows < R) return q8i8_tile_rows<DEC, R - 1, NP>(p, pbytes, K, xq, ldx, dx, xc, ldxs, rows, tile);
  }
  q8i8_tile<DEC, R, NP>(p, pbytes, K, xq, ldx, dx, xc, ldxs, tile);
}

// An 8-bit panel's blocks with every 64-byte chunk reordered and made
// unsigned as q8i8_tile does it (d as stored): the same size and offsets.
inline void q8_decode_panel_vnni(const uint8_t* p, int64_t K, uint8_t* out) {
  const __m512i idx = q8_index(), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t kb = 0; kb < K / QB; ++kb) {
    const uint8_t* blk = p + kb * Q8_BLOCK_BYTES;
    prefetch_block(blk + Q4_AHEAD * Q8_BLOCK_BYTES, Q8_BLOCK_BYTES);
    uint8_t* o = out + kb * Q8_BLOCK_BYTES;
    std::memcpy(o, blk, NR * 4);
    for (int g = 0; g < QB / 4; ++g)
      _mm512_storeu_si512(o + NR * 4 + g * 64,
                          _mm512_xor_si512(_mm512_permutexvar_epi8(idx, _mm512_loadu_si512(blk + NR * 4 + g * 64)),
                                           flip));
  }
}

void q8i8_rows_vnni(const void* panels, int64_t pbytes, int64_t np, int64_t K, const int8_t* xq, int64_t ldx,
                    const float* dx, const int32_t* xc, int64_t ldxs, int64_t rows, const float* bias, int64_t col0,
                    int64_t cols, float* y, int64_t ldy) {
  // Reordering the bytes once for more rows: 1.1-1.15x at 32 rows (Zen 4).
  i8_rows_any(static_cast<const uint8_t*>(panels), pbytes, np, pbytes, rows, bias, col0, cols, y, ldy,
              [&](const uint8_t* panel, uint8_t* out) { q8_decode_panel_vnni(panel, K, out); },
              [&](auto dec_c, auto np_c, const uint8_t* pp, int64_t bytes, int64_t m, int64_t r, float* t) {
                constexpr bool DEC = decltype(dec_c)::value;
                q8i8_tile_rows<DEC, DEC ? MR_I8D : MR_I8, decltype(np_c)::value>(
                    pp, bytes, K, xq + m * ldx, ldx, dx + m * ldxs, xc + m * ldxs, ldxs, r, t);
              });
}
#endif

// silu(g) * u, SW lanes at a time.  silu(g) = g * sigmoid(g), with sigmoid
// through e = exp(-|g|), which never overflows (exp(-g) did, below g = -88:
// inf, then NaN under -ffast-math): 1 / (1 + e) for g >= 0, e / (1 + e)
// below (exp: exp_poly.h, as the attention kernel's).  Each lane's
// operations are the same, in the same order, at every width, so every set
// gives the same bits.
#if defined(SPLITSERVE_ISA_AVX512)
constexpr int SW = 16;
#elif defined(SPLITSERVE_ISA_AVX2)
constexpr int SW = 8;
#else
constexpr int SW = 4;  // SSE2, which every x86-64 CPU has
#endif
typedef float sv __attribute__((vector_size(SW * 4)));
typedef int32_t si __attribute__((vector_size(SW * 4)));
typedef float sv_u __attribute__((vector_size(SW * 4), aligned(4)));
// Without -ffast-math (its vector division is a reciprocal estimate and a
// Newton step, which differs between CPU makers) and without fused
// multiply-adds (which the wider sets have and SSE2 has not); on every helper,
// so that they inline.
#define SILU_MATH __attribute__((optimize("no-fast-math", "fp-contract=off")))

SILU_MATH inline sv bits_to_float(si b) { sv f; std::memcpy(&f, &b, sizeof(f)); return f; }
SILU_MATH inline si float_bits(sv f) { si b; std::memcpy(&b, &f, sizeof(b)); return b; }

SILU_MATH inline void silu_mul_lanes(const float* g, const float* u, float* o) {
  const sv x = *reinterpret_cast<const sv_u*>(g);
  const si xb = float_bits(x);
  const si negative = xb >> 31;  // all ones where the sign is set
  const sv e = splitserve_exp::exp_nonpositive<sv, si>(bits_to_float(xb | (1 << 31)));  // exp(-|x|)
  const sv f = bits_to_float((negative & float_bits(e)) | (~negative & float_bits(sv{} + 1.f)));  // e or 1
  *reinterpret_cast<sv_u*>(o) = x * f / (e + 1.f) * *reinterpret_cast<const sv_u*>(u);
}

SILU_MATH void silu_mul_rows(const float* gate_up, int64_t I, int64_t rows, float* out) {
  for (int64_t t = 0; t < rows; ++t) {
    const float* g = gate_up + t * 2 * I;
    const float* u = g + I;
    float* o = out + t * I;
    int64_t i = 0;
    for (; i + SW <= I; i += SW) silu_mul_lanes(g + i, u + i, o + i);
    if (i < I) {  // the tail through the same lanes: an element's bits do not depend on where it sits
      float gt[SW] = {}, ut[SW] = {}, ot[SW];
      std::memcpy(gt, g + i, (I - i) * sizeof(float));
      std::memcpy(ut, u + i, (I - i) * sizeof(float));
      silu_mul_lanes(gt, ut, ot);
      std::memcpy(o + i, ot, (I - i) * sizeof(float));
    }
  }
}

// decode_dtype=int8's quantization of x (linear_isa_api.h), 16 lanes of
// GCC's vector extension (one AVX-512 register, two AVX2, four SSE2), no
// fused or reordered arithmetic.  Rounding to nearest even by adding and
// subtracting 1.5 * 2^23 (|x| <= 127 here), as the FPU rounds every set alike.
typedef float qv __attribute__((vector_size(64)));
typedef int32_t qi __attribute__((vector_size(64)));
typedef float qv_u __attribute__((vector_size(64), aligned(4)));

SILU_MATH inline qv qv_abs(qv v) {
  qi b;
  std::memcpy(&b, &v, sizeof(b));
  b &= 0x7fffffff;
  std::memcpy(&v, &b, sizeof(v));
  return v;
}

typedef float qv8 __attribute__((vector_size(32)));
typedef float qv4 __attribute__((vector_size(16)));
typedef int8_t qb16 __attribute__((vector_size(16)));

SILU_MATH void quantize_i8(const float* x, int64_t blocks, int8_t* xq, float* dx, float* sx) {
  const qv magic = qv{} + 12582912.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const qv lo = *reinterpret_cast<const qv_u*>(x + b * QB), hi = *reinterpret_cast<const qv_u*>(x + b * QB + 16);
    const qv a = qv_abs(lo), c = qv_abs(hi);
    qv m = a > c ? a : c;
    m = m > 0.f ? m : qv{};  // NaN lanes as 0: the maxima pass over NaN (a NaN makes the sum NaN below)
    // The lanes' maximum, halving: no NaN is left, so the order does not matter.
    const qv8 m8 = __builtin_shufflevector(m, m, 0, 1, 2, 3, 4, 5, 6, 7),
              n8 = __builtin_shufflevector(m, m, 8, 9, 10, 11, 12, 13, 14, 15);
    const qv8 h8 = m8 > n8 ? m8 : n8;
    const qv4 m4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3), n4 = __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
    const qv4 h4 = m4 > n4 ? m4 : n4;
    const float m2a = h4[0] > h4[2] ? h4[0] : h4[2], m2b = h4[1] > h4[3] ? h4[1] : h4[3];
    const float amax = m2a > m2b ? m2a : m2b;
    // The sum in one fixed order: lanes j and j + 8, then j and j + 4, then (0 + 2) + (1 + 3).
    const qv s = lo + hi;
    const qv8 s8 = __builtin_shufflevector(s, s, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(s, s, 8, 9, 10, 11, 12, 13, 14, 15);
    const qv4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
    const float sum = (s4[0] + s4[2]) + (s4[1] + s4[3]);
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    const qv rl = (lo * inv + magic) - magic, rh = (hi * inv + magic) - magic;
    const qb16 bl = __builtin_convertvector(__builtin_convertvector(rl, qi), qb16),
               bh = __builtin_convertvector(__builtin_convertvector(rh, qi), qb16);
    std::memcpy(xq + b * QB, &bl, 16);
    std::memcpy(xq + b * QB + 16, &bh, 16);
    dx[b] = amax / 127.f + (sum - sum);  // NaN where x holds a NaN or an infinity (the maxima pass over NaN)
    sx[b] = sum;
  }
}

#if defined(SPLITSERVE_ISA_BF16Q4)
// decode_dtype=bfloat16 (linear_isa_api.h): 4-bit blocks times rows of x
// rounded to bfloat16, with AVX512-BF16 dot products and AVX512-VBMI byte
// shuffles.  A chunk's nibbles become four registers of bfloat16 pairs, one
// per pair of inputs (8c, 8c + 1), ..., (8c + 6, 8c + 7): column j's 32-bit
// lane holds (128 + q) of both inputs, the nibble as the mantissa of
// 0x43XX (exact: q < 128), so no weight is rebuilt.  One vdpbf16ps per pair
// adds x[k] (128 + q[k]) + x[k + 1] (128 + q[k + 1]) to each column's float32
// sum s; the block folds d * s + (m - 128 d) * sum(x), and sum(x) is of the
// rounded x, so the 128s cancel.  Pairs in k order, then the fold, for every
// row count: a row's result never depends on its batch.
constexpr int MR_BQ = 8;  // rows a tile: 8 sums and 8 accumulators
// Column j's bytes 4j..4j+3 -> words (0x43, byte 4j + a), (0x43, byte 4j + b):
// table [0] takes bytes 4j, 4j + 1, [1] bytes 4j + 2, 4j + 3; 64 picks the 0x43.
struct PairIdx {
  alignas(64) uint8_t v[2][64];
  constexpr PairIdx() : v{} {
    for (int j = 0; j < 16; ++j)
      for (int t = 0; t < 2; ++t)
        for (int h = 0; h < 2; ++h) {
          v[t][4 * j + 2 * h] = static_cast<uint8_t>(4 * j + 2 * t + h);
          v[t][4 * j + 2 * h + 1] = 64;
        }
  }
};
constexpr PairIdx kPairIdx{};
inline __m512i nibble_pairs(__m512i nibbles, __m512i idx, __m512i hi) {
  return _mm512_permutex2var_epi8(nibbles, idx, hi);
}

// R rows times one panel, its blocks in order.
template <int R>
void q4bf16_tile(const uint8_t* p, int64_t K, const uint32_t* x, int64_t ldx, const float* sx, int64_t ldxs,
                 float* tile) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), hi = _mm512_set1_epi8(0x43);
  const __m512i idx01 = _mm512_load_si512(kPairIdx.v[0]), idx23 = _mm512_load_si512(kPairIdx.v[1]);
  const __m512 minus128 = _mm512_set1_ps(-128.0f);
  const int64_t KB = K / QB;
  __m512 t[R];
  for (int r = 0; r < R; ++r) t[r] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* blk = p + kb * Q4_BLOCK_BYTES;
    __m512 s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_ps();
    prefetch_block(blk + Q4_AHEAD * Q4_BLOCK_BYTES, Q4_BLOCK_BYTES);  // past the panel's end, the next one's
    for (int c = 0; c < QB / 8; ++c) {
      const uint32_t* xc = x + kb * (QB / 2) + 4 * c;
      const __m512i raw = _mm512_loadu_si512(blk + 2 * NR * 4 + c * 64);
      const __m512i lo = _mm512_and_si512(raw, low4), up = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
      const __m512i w[4] = {nibble_pairs(lo, idx01, hi), nibble_pairs(lo, idx23, hi), nibble_pairs(up, idx01, hi),
                            nibble_pairs(up, idx23, hi)};
      for (int h = 0; h < 4; ++h)
        for (int r = 0; r < R; ++r) s[r] = dot_pair(s[r], w[h], xc + r * ldx + h);
    }
    const float* dm = reinterpret_cast<const float*>(blk);
    const __m512 d = _mm512_loadu_ps(dm), m = _mm512_fmadd_ps(minus128, d, _mm512_loadu_ps(dm + NR));
    for (int r = 0; r < R; ++r)
      t[r] = _mm512_fmadd_ps(_mm512_set1_ps(sx[r * ldxs + kb]), m, _mm512_fmadd_ps(s[r], d, t[r]));
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(tile + r * NR, t[r]);
}

// One panel after another, in memory order (the blocks' reads bound few
// rows: one stream; linear_cpu.cpp's bf16_rows_linear), each in tiles of up
// to MR_BQ rows, as even as they divide.
void q4bf16_rows(const void* panels, int64_t pbytes, int64_t np, int64_t K, const uint32_t* x, int64_t ldx,
                 const float* sx, int64_t ldxs, int64_t rows, const float* bias, int64_t col0, int64_t cols, float* y,
                 int64_t ldy) {
  const uint8_t* p = static_cast<const uint8_t*>(panels);
  alignas(64) float tile[MR_BQ * NR];
  const int64_t tiles = (rows + MR_BQ - 1) / MR_BQ;
  for (int64_t n = 0; n < np; ++n)
    for (int64_t t = 0; t < tiles; ++t) {
      const auto [m, r] = row_tile(rows, t, tiles);
      tile_of<MR_BQ>(r, [&](auto rc) {
        q4bf16_tile<decltype(rc)::value>(p + n * pbytes, K, x + m * ldx, ldx, sx + m * ldxs, ldxs, tile);
      });
      store_tile(tile, r, bias, col0 + n * NR, min64(NR, cols - n * NR), y + m * ldy, ldy);
    }
}

// decode_dtype=bfloat16's head: 8-bit blocks (as q8) times rows of x rounded
// to bfloat16.  Each panel is decoded once per call into bfloat16 pairs of
// the exact q values (|q| <= 127 fits bfloat16's 8 bits), 16 pairs of 16
// columns after the block's d as stored; each row tile reads it from L1.  Up
// to Q8BF_FEW_ROWS rows make the pairs in registers instead (q8bf16_few), a
// panel at a time in tiles of up to 16 rows (the 576 x 49,152 head on a Zen
// 4: 12 rows 2.4 against 3.4 ms, 16 rows 3.0 against 4.6, 24 rows 4.7
// against 5.2; 32 rows and more the same either way).
// Per block, one vdpbf16ps per pair of inputs into a float32 sum s, in k
// order, then t = fma(s, d, t): one arithmetic for every row count.
constexpr int64_t Q8BF_BLOCK_BYTES = NR * 4 + QB * NR * 2;  // d, then 16 pairs x 16 columns x 2 bfloat16
constexpr int MR_B8 = 12;  // rows a tile: 12 sums and 12 accumulators
constexpr int MR_B8_FEW = 16;  // rows a q8bf16_few tile of one panel: 16 sums, the totals in memory
constexpr int64_t Q8BF_FEW_ROWS = 32;

// Pair kp of an 8-bit block (inputs 2 kp, 2 kp + 1: its rows of 16 int8, one
// per input) as the 16 columns' bfloat16 pairs.
inline __m512i q8_bf16_pairs(const uint8_t* blk, int kp) {
  const uint8_t* q = blk + NR * 4 + 2 * kp * NR;
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + NR));
  // (a[j], b[j]) for columns 0-7, then 8-15; each pair one 32-bit lane once converted
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(a, b)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(a, b)));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
}

inline void q8bf16_decode_panel(const uint8_t* p, int64_t K, uint8_t* out) {
  for (int64_t kb = 0; kb < K / QB; ++kb) {
    const uint8_t* blk = p + kb * Q8_BLOCK_BYTES;
    prefetch_block(blk + Q4_AHEAD * Q8_BLOCK_BYTES, Q8_BLOCK_BYTES);
    uint8_t* o = out + kb * Q8BF_BLOCK_BYTES;
    std::memcpy(o, blk, NR * 4);
    for (int kp = 0; kp < QB / 2; ++kp) _mm512_storeu_si512(o + NR * 4 + kp * 64, q8_bf16_pairs(blk, kp));
  }
}

// Few rows, one panel: each pair made in registers as q8bf16_decode_panel
// makes it, into the same sums in the same order (the same bits).  The
// running totals wait in `tile` between blocks (float32 stored and loaded:
// the same bits), so 16 rows keep their sums in registers.  A row's 16 dot
// products a block are one dependent chain; the blocks' reads bound a step of
// one sequence all the same, read in memory order (q8bf16_rows).
template <int R>
void q8bf16_few(const uint8_t* p, int64_t K, const uint32_t* x, int64_t ldx, float* tile) {
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(tile + r * NR, _mm512_setzero_ps());
  for (int64_t kb = 0; kb < K / QB; ++kb) {
    const uint8_t* blk = p + kb * Q8_BLOCK_BYTES;
    __m512 s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_ps();
    prefetch_block(blk + Q4_AHEAD * Q8_BLOCK_BYTES, Q8_BLOCK_BYTES);  // past the panel's end, the next one's
    for (int kp = 0; kp < QB / 2; ++kp) {
      const __m512i w = q8_bf16_pairs(blk, kp);
      for (int r = 0; r < R; ++r) s[r] = dot_pair(s[r], w, x + r * ldx + kb * (QB / 2) + kp);
    }
    const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(blk));
    for (int r = 0; r < R; ++r) {
      float* t = tile + r * NR;
      _mm512_storeu_ps(t, _mm512_fmadd_ps(s[r], d, _mm512_loadu_ps(t)));
    }
  }
}

template <int R>
void q8bf16_tile(const uint8_t* dec, int64_t K, const uint32_t* x, int64_t ldx, float* tile) {
  __m512 t[R];
  for (int r = 0; r < R; ++r) t[r] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < K / QB; ++kb) {
    const uint8_t* b = dec + kb * Q8BF_BLOCK_BYTES;
    __m512 s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_ps();
    for (int kp = 0; kp < QB / 2; ++kp) {
      const __m512i w = _mm512_loadu_si512(b + NR * 4 + kp * 64);
      for (int r = 0; r < R; ++r) s[r] = dot_pair(s[r], w, x + r * ldx + kb * (QB / 2) + kp);
    }
    const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(b));
    for (int r = 0; r < R; ++r) t[r] = _mm512_fmadd_ps(s[r], d, t[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(tile + r * NR, t[r]);
}

void q8bf16_rows(const void* panels, int64_t pbytes, int64_t np, int64_t K, const uint32_t* x, int64_t ldx,
                 const float*, int64_t, int64_t rows, const float* bias, int64_t col0, int64_t cols, float* y,
                 int64_t ldy) {
  const uint8_t* p = static_cast<const uint8_t*>(panels);
  if (rows <= Q8BF_FEW_ROWS) {  // one panel after another, in tiles of rows as even as they divide
    alignas(64) float few[MR_B8_FEW * NR];
    const int64_t tiles = (rows + MR_B8_FEW - 1) / MR_B8_FEW;
    for (int64_t n = 0; n < np; ++n)
      for (int64_t t = 0; t < tiles; ++t) {
        const auto [m, r] = row_tile(rows, t, tiles);
        tile_of<MR_B8_FEW>(
            r, [&](auto rc) { q8bf16_few<decltype(rc)::value>(p + n * pbytes, K, x + m * ldx, ldx, few); });
        store_tile(few, r, bias, col0 + n * NR, min64(NR, cols - n * NR), y + m * ldy, ldy);
      }
    return;
  }
  thread_local std::vector<uint8_t> dec;
  dec.resize(static_cast<size_t>(K / QB * Q8BF_BLOCK_BYTES));
  alignas(64) float tile[MR_B8 * NR];
  const int64_t tiles = (rows + MR_B8 - 1) / MR_B8;
  for (int64_t n = 0; n < np; ++n) {
    q8bf16_decode_panel(p + n * pbytes, K, dec.data());
    for (int64_t t = 0; t < tiles; ++t) {
      const auto [m, r] = row_tile(rows, t, tiles);
      tile_of<MR_B8>(r, [&](auto rc) { q8bf16_tile<decltype(rc)::value>(dec.data(), K, x + m * ldx, ldx, tile); });
      store_tile(tile, r, bias, col0 + n * NR, min64(NR, cols - n * NR), y + m * ldy, ldy);
    }
  }
}
#endif

#if defined(SPLITSERVE_ISA_BF16)
// act = silu(g) * u for one panel's NR outputs, through silu_mul's lanes (its bits).
SILU_MATH inline void silu_mul_panel(const float* g, const float* u, float* act) {
  static_assert(NR % SW == 0, "silu_mul's lanes cover a panel's outputs");
  for (int64_t j = 0; j < NR; j += SW) silu_mul_lanes(g + j, u + j, act + j);
}
#endif

#if defined(SPLITSERVE_ISA_BF16) && !defined(SPLITSERVE_ISA_AMX)
// linear_isa_api.h's SiluPanelRows on vdpbf16ps (x as rows_times_panels<BF16>
// takes it): panel n's gate and up as the micro-kernel's two panels, up_bytes
// apart, MR rows at a time, then silu(gate) * up row by row into y.  Format:
// BF16 (the panels), or BF16Blocks (the blocks they were rounded from).
template <typename Format>
void bf16_silu_rows(const void* panels, int64_t pbytes, int64_t up_bytes, int64_t np, int64_t K, const float* x,
                    int64_t ldx, int64_t rows, int64_t col0, int64_t cols, void* out, int64_t ldy) {
  const uint8_t* p = static_cast<const uint8_t*>(panels);
  float* y = static_cast<float*>(out);
  alignas(64) float tile[MR * NR * 2];  // gate's r rows, then up's
  alignas(64) float act[NR];
  const int64_t tiles = (rows + MR - 1) / MR;
  for (int64_t n = 0; n < np; ++n) {
    const int64_t width = min64(NR, cols - n * NR);
    for (int64_t m = 0; m < rows; m += MR) {
      const int64_t r = min64(MR, rows - m);
      // The row tiles of several ask for the next panel's gate and up between them.
      run_rows<Format, MR, 2>(p + n * pbytes, up_bytes, K, x + m * ldx, ldx, nullptr, 0, r, tile,
                              ahead_of(p + (n + 1) * pbytes, m / MR, tiles));
      for (int64_t i = 0; i < r; ++i) {
        silu_mul_panel(tile + i * NR, tile + (r + i) * NR, act);
        std::memcpy(y + (m + i) * ldy + col0 + n * NR, act, width * sizeof(float));
      }
    }
  }
}
#endif

#if defined(SPLITSERVE_ISA_AMX)
// linear_isa_api.h's SiluPanelRows: panel n's gate and up tiles (amx_block's
// two panels, up_bytes apart) for two row tiles at a time, every panel (and
// K's passes: amx_passes) in turn, into buf; then silu(gate) * up row by row,
// rounded, into y.
template <BTiles B>
void amx_silu_rows(const void* panels, int64_t pbytes, int64_t up_bytes, int64_t np, int64_t K, const float* x,
                   int64_t ldx, int64_t rows, int64_t col0, int64_t cols, void* out, int64_t ldy) {
  uint16_t* y = static_cast<uint16_t*>(out);
  const splitserve_amx::Config cfg;
  _tile_loadconfig(&cfg);  // per call: the thread may have run other tile code in between
  const uint8_t* p = static_cast<const uint8_t*>(panels);
  const uint8_t* xb = reinterpret_cast<const uint8_t*>(x);
  const int64_t xstride = ldx * 4, KB = K / QB, passes = amx_passes(rows, np, KB);
  float* const buf = amx_sums(2 * np);  // [row tile][panel][gate, up]
  auto tile = [&](int64_t rt, int64_t n, int64_t up) { return buf + ((rt * np + n) * 2 + up) * AMX_ROWS * NR; };
  const int64_t c_stride[4] = {NR * 4, NR * 4, NR * 4, NR * 4};
  alignas(64) float act[NR];
  for (int64_t r0 = 0; r0 < rows; r0 += AMX_PASS_TILES * AMX_ROWS) {
    const int64_t pass_rows = min64(AMX_PASS_TILES * AMX_ROWS, rows - r0);
    amx_each_block(pass_rows, KB, passes, np, 1, [&](int64_t m, bool two_r, int64_t kb0, int64_t kb1, int64_t n) {
      const int64_t rt = m / AMX_ROWS, rt2 = two_r ? rt + 1 : rt;  // no second tile: never written
      const uint8_t* xm = xb + (r0 + m) * xstride;
      float* const c[4] = {tile(rt, n, 0), tile(rt, n, 1), tile(rt2, n, 0), tile(rt2, n, 1)};
      if (two_r) amx_block<true, true, B>(xm, xstride, p + n * pbytes, up_bytes, kb0, kb1, c, c_stride);
      else amx_block<false, true, B>(xm, xstride, p + n * pbytes, up_bytes, kb0, kb1, c, c_stride);
    });
    for (int64_t n = 0; n < np; ++n) {
      const int64_t width = min64(NR, cols - n * NR);
      for (int64_t i = 0; i < pass_rows; ++i) {
        const int64_t rt = i / AMX_ROWS, r = i % AMX_ROWS;
        silu_mul_panel(tile(rt, n, 0) + r * NR, tile(rt, n, 1) + r * NR, act);
        uint16_t* dst = y + (r0 + i) * ldy + col0 + n * NR;
        for (int64_t j = 0; j < width; ++j) dst[j] = splitserve_bf16::round_bits(act[j]);
      }
    }
  }
  _tile_release();
}
#endif

}  // namespace

#if defined(SPLITSERVE_ISA_AMX)
extern const SiluPanelRows kAmxBf16SiluRows = amx_silu_rows<BTiles::kPanels>;
extern const SiluPanelRows kAmxQ4SiluRows = amx_silu_rows<BTiles::kQ4>;
extern const SiluPanelRows kAmxQ8SiluRows = amx_silu_rows<BTiles::kQ8>;
extern const RowsTimesPanels kAmxBf16Rows = amx_rows<BTiles::kPanels>;
extern const RowsTimesPanels kAmxQ4Rows = amx_rows<BTiles::kQ4>;
extern const RowsTimesPanels kAmxQ8Rows = amx_rows<BTiles::kQ8>;
extern const PlainRows kAmxPlainRows = amx_plain_rows;
#elif defined(SPLITSERVE_ISA_BF16Q4)
extern const Q4Bf16Rows kQ4Bf16 = q4bf16_rows;
extern const Q4Bf16Rows kQ8Bf16 = q8bf16_rows;
extern const RowsTimesPanels kBf16Q4Rows = rows_times_panels<BF16Blocks<BTiles::kQ4>>;
extern const RowsTimesPanels kBf16Q8Rows = rows_times_panels<BF16Blocks<BTiles::kQ8>>;
extern const SiluPanelRows kBf16Q4SiluRows = bf16_silu_rows<BF16Blocks<BTiles::kQ4>>;
extern const SiluPanelRows kBf16Q8SiluRows = bf16_silu_rows<BF16Blocks<BTiles::kQ8>>;
extern const ArgmaxPanelRows kBf16Q4ArgmaxRows = bf16_argmax_rows<BF16Blocks<BTiles::kQ4>>;
extern const ArgmaxPanelRows kBf16Q8ArgmaxRows = bf16_argmax_rows<BF16Blocks<BTiles::kQ8>>;
#elif defined(SPLITSERVE_ISA_BF16)
extern const RowsTimesPanels kBf16Rows = rows_times_panels<BF16>;
extern const SiluPanelRows kBf16SiluRows = bf16_silu_rows<BF16>;
extern const ArgmaxPanelRows kBf16ArgmaxRows = bf16_argmax_rows<BF16>;
#elif defined(SPLITSERVE_ISA_VNNI)
extern const Q4I8Rows kQ4I8Vnni = q4i8_rows_vnni;
extern const Q8I8Rows kQ8I8Vnni = q8i8_rows_vnni;
#else
#if defined(SPLITSERVE_ISA_AVX2) || defined(SPLITSERVE_ISA_AVX512)
static constexpr Q4I8Rows kQ4I8 = q4i8_rows_avx2;
static constexpr Q8I8Rows kQ8I8 = q8i8_rows_avx2;
#else
static constexpr Q4I8Rows kQ4I8 = int8_rows<false>;
static constexpr Q8I8Rows kQ8I8 = q8i8_rows;
#endif
extern const IsaKernels SPLITSERVE_ISA_TABLE = {
    SPLITSERVE_ISA_NAME, rows_times_panels<F32>, rows_times_panels<Q4>, rows_times_panels<Q8>, silu_mul_rows,
    kQ4I8,               kQ8I8,                  quantize_i8};
#endif

}  // namespace splitserve_linear
