// Paged attention for CPUs, keys and values read from the block-contiguous KV
// cache (no gather copy, no padding).  Decode: one query token per sequence
// (below); prefill: a prompt's query tokens (namespace prefill, further down).
//
//   q:            [B, Hq, D]
//   kv_cache:     [num_blocks, num_layers, 2, block_size, Hkv, D], q's dtype,
//                 bfloat16 or float16 (a float32 model's half-size cache) or fp8 (e4m3fn,
//                 e5m2); rows are widened to float32 as they are loaded (the
//                 cache's scale is 1, see engine/layers/kv_quant.py)
//   block_tables: [B, max_blocks] int32
//   seq_lens:     [B] int32
//   window:       > 0: a sequence of length L attends to its last `window`
//                 positions only, L - window .. L - 1 (sliding window); 0: all
//   bf16_dots:    scores and weighted values in bfloat16 pairs where the build
//                 has AVX512-BF16 and VBMI and the cache is e4m3fn or bfloat16
//                 (dot_rows_nh's and add_weighted_pairs_nh's BF); else float32
//   returns       [B, Hq, D]
//
// A task is one sequence's span of up to PART_TOKENS positions, all heads at
// once: a cache block's keys (and then its values) for one layer are one
// contiguous run of memory, read once, front to back.  Each task takes its
// span's scores, then one softmax per query head over them (max m, sum l),
// then the unnormalised output; a sequence longer than one span merges its
// spans' partial results.  Spans are cut at fixed positions, so the order of
// every sum depends on the sequence alone, never on the batch it runs in.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "bf16_round.h"
#include "exp_poly.h"
#include "parallel_claim.h"
#include "prefetch.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include "amx_tiles.h"
#endif

namespace {

constexpr int64_t PART_TOKENS = 128;

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// A cache row of D values as floats: float32 rows are read in place, others
// converted into buf.
template <typename scalar_t>
inline const float* as_floats(const scalar_t* row, float* buf, int64_t D) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return row;
  } else {
    for (int64_t d = 0; d < D; ++d) buf[d] = to_f(row[d]);
    return buf;
  }
}

// fp8 rows: AVX-512 with BW and VL, or AVX2 with F16C, widens them through
// float16 (below); elsewhere integer arithmetic the compiler vectorizes
// decodes them (a 256-entry table, one load per element, ran at half the
// speed of reading a float32 cache).  Every byte gives what c10's conversion
// gives, NaN's sign aside (tests/unit/test_kv_bf16.py compares all 256).  fp8 is
// sign | exponent | mantissa with bias 7 (e4m3fn) or 15 (e5m2), so a normal
// value is a float32 with the fields moved and the bias raised to 127; a
// subnormal (exponent 0) is its mantissa, an integer, times a power of two.
// e4m3fn: 0x7f and 0xff are NaN, there is no infinity; e5m2: exponent 31 is
// infinity (mantissa 0) or NaN, as in float16.
inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// 16 fp8 values through float16, the values the loop below gives: an e5m2
// byte is a float16's upper half.  An e4m3fn byte's sign, exponent and
// mantissa moved into a float16's fields (mantissa shifted up 7) read as the
// value times 2^-8, normal and subnormal alike (both formats' subnormals line
// up there), so times 256 (exact) it is the value; the magnitude 0x7f is NaN
// (unsigned here).  Decode attention widens rows with these in the register
// (RowLoad): 30 layers' decode attention of 32 sequences at context 125 on a
// Zen 5 (a cache larger than L3) took 2.4 ms (e4m3fn) and 2.0 ms (e5m2)
// against float16's 3.3 ms; widened into a buffer by the loop below, 4.4-4.9 ms.
inline __m512 e5m2x16(const void* r) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(static_cast<const __m128i*>(r)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
}
inline __m512 e4m3x16(const void* r) {
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(r));
  // Sign-extended and shifted up 7: the sign lands in bits 15 and 14, the
  // magnitude in 13..7; bit 14 cleared leaves the float16's fields.
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16(-0x4001));
  const __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
  const __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_and_si128(b, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f));
  return _mm512_mask_mov_ps(f, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}
#elif defined(__AVX2__) && defined(__F16C__)
// The same 8 at a time (F16C), for rows widened into a buffer: decode
// attention, 30 layers for 32 sequences at context 125 on a Zen 5 running
// the AVX2 build, 4.8 ms (e4m3fn) and 3.6 ms (e5m2) against 9.1-9.5 ms by
// the loop below and 3.9 ms over a float16 cache.
inline __m256 e5m2x8(const void* r) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(static_cast<const __m128i*>(r)));
  return _mm256_cvtph_ps(_mm_slli_epi16(w, 8));
}
inline __m256 e4m3x8(const void* r) {
  const __m128i s = _mm_cvtepi8_epi16(_mm_loadl_epi64(static_cast<const __m128i*>(r)));
  const __m128i h = _mm_and_si128(_mm_slli_epi16(s, 7), _mm_set1_epi16(-0x4001));
  const __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
  const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(s, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7f));
  return _mm256_blendv_ps(f, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                          _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan)));
}
#endif

// M mantissa bits, exponent bias BIAS; E4M3FN: only all-ones is NaN (no
// infinity), else (e5m2) the top exponent is infinity or NaN.
template <int M, int BIAS, bool E4M3FN>
inline const float* fp8_as_floats(const void* row, float* buf, int64_t D) {
  const uint8_t* bytes = static_cast<const uint8_t*>(row);
  uint32_t* out = reinterpret_cast<uint32_t*>(buf);
  int64_t d0 = 0;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  for (; d0 + 16 <= D; d0 += 16) _mm512_storeu_ps(buf + d0, E4M3FN ? e4m3x16(bytes + d0) : e5m2x16(bytes + d0));
#elif defined(__AVX2__) && defined(__F16C__)
  for (; d0 + 8 <= D; d0 += 8) _mm256_storeu_ps(buf + d0, E4M3FN ? e4m3x8(bytes + d0) : e5m2x8(bytes + d0));
#endif
  constexpr uint32_t top = E4M3FN ? 0x7fu : (0x7fu >> M) << M;  // the first special magnitude
  // A subnormal's mantissa step, 2^(1 - BIAS - M): a normal float32.
  const float sub_unit = bits_f32(static_cast<uint32_t>(127 + 1 - BIAS - M) << 23);
  for (int64_t d = d0; d < D; ++d) {
    const uint32_t b = bytes[d], sign = (b & 0x80u) << 24, mag = b & 0x7fu;
    const uint32_t normal = (mag << (23 - M)) + (static_cast<uint32_t>(127 - BIAS) << 23);
    const uint32_t sub = f32_bits(static_cast<float>(mag & ((1u << M) - 1)) * sub_unit);
    const uint32_t special = E4M3FN ? 0x7fc00000u : 0x7f800000u | ((mag & ((1u << M) - 1)) << (23 - M));
    out[d] = sign | (mag >= top ? special : (mag < (1u << M) ? sub : normal));
  }
  return buf;
}

inline const float* as_floats(const c10::Float8_e4m3fn* row, float* buf, int64_t D) {
  return fp8_as_floats<3, 7, true>(row, buf, D);
}

inline const float* as_floats(const c10::Float8_e5m2* row, float* buf, int64_t D) {
  return fp8_as_floats<2, 15, false>(row, buf, D);
}

// bfloat16 rows: a bfloat16 is a float32's upper half, so widening is a shift
// (exact), written so that the compiler vectorizes it.
inline const float* as_floats(const c10::BFloat16* row, float* buf, int64_t D) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
  uint32_t* out = reinterpret_cast<uint32_t*>(buf);
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<uint32_t>(bits[d]) << 16;
  return buf;
}

// float16 rows: F16C widens 8 at a time (exact: every float16 is a float32);
// without it, c10's conversion, value by value.
inline const float* as_floats(const c10::Half* row, float* buf, int64_t D) {
  int64_t d = 0;
#if defined(__AVX512F__)
  for (; d + 16 <= D; d += 16)
    _mm512_storeu_ps(buf + d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + d))));
#endif
#if defined(__F16C__)
  const __m128i* bits = reinterpret_cast<const __m128i*>(row);
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(buf + d, _mm256_cvtph_ps(_mm_loadu_si128(bits + d / 8)));
#endif
  for (; d < D; ++d) buf[d] = to_f(row[d]);
  return buf;
}

using splitserve_prefetch::prefetch_line;  // into L2 (prefetch.h)
using splitserve_prefetch::prefetch_share;

// The decode kernel's vector: one register of floats (16 on AVX-512, 8 on
// AVX2, where GCC splits wider vectors badly); _u: unaligned in memory.
#if defined(__AVX512F__)
constexpr int DW = 16;
#else
constexpr int DW = 8;
#endif
typedef float dvec __attribute__((vector_size(DW * 4)));
typedef float dvec_u __attribute__((vector_size(DW * 4), aligned(4)));
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef float f32x16_u __attribute__((vector_size(64), aligned(4)));

// a[0:D] += p[i] * rows[i * stride : + D] for i < n, in that order, with a in
// registers (D / DW vectors) throughout.
template <int D>
inline void add_weighted_rows(float* __restrict__ a, const float* __restrict__ p, const float* __restrict__ rows,
                              int64_t stride, int64_t n) {
  constexpr int C = D / DW;
  dvec acc[C];
  for (int c = 0; c < C; ++c) acc[c] = *reinterpret_cast<const dvec_u*>(a + DW * c);
  for (int64_t i = 0; i < n; ++i) {
    const float pi = p[i];
    const float* r = rows + i * stride;
    for (int c = 0; c < C; ++c) acc[c] += pi * *reinterpret_cast<const dvec_u*>(r + DW * c);
  }
  for (int c = 0; c < C; ++c) *reinterpret_cast<dvec_u*>(a + DW * c) = acc[c];
}

// 16 values of a cache row as floats, widened in the register (exact):
// float32 as stored, bfloat16 by a shift, float16 by F16C, fp8 through
// float16 (AVX-512 builds; fp8 with AVX512BW and VL).  Every type elsewhere
// has none: rows are widened into a buffer first (as_floats).
template <typename T>
struct RowLoad : std::false_type {};
#if defined(__AVX512F__)
template <>
struct RowLoad<float> : std::true_type {
  static f32x16 at(const float* r) { return *reinterpret_cast<const f32x16_u*>(r); }
};
template <>
struct RowLoad<c10::BFloat16> : std::true_type {
  static f32x16 at(const c10::BFloat16* r) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r)));
    return reinterpret_cast<f32x16>(_mm512_slli_epi32(w, 16));
  }
};
template <>
struct RowLoad<c10::Half> : std::true_type {
  static f32x16 at(const c10::Half* r) {
    return reinterpret_cast<f32x16>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r))));
  }
};
#if defined(__AVX512BW__) && defined(__AVX512VL__)
template <>
struct RowLoad<c10::Float8_e5m2> : std::true_type {
  static f32x16 at(const c10::Float8_e5m2* r) { return reinterpret_cast<f32x16>(e5m2x16(r)); }
};
template <>
struct RowLoad<c10::Float8_e4m3fn> : std::true_type {
  static f32x16 at(const c10::Float8_e4m3fn* r) { return reinterpret_cast<f32x16>(e4m3x16(r)); }
};
#endif

// A cache row's C vectors (16 values each) as floats: RowLoad's, one at a time.
template <int C, typename T>
inline void load_row(const T* r, f32x16 (&v)[C]) {
  for (int c = 0; c < C; ++c) v[c] = RowLoad<T>::at(r + 16 * c);
}

#if defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__)
// e4m3fn rows 64 bytes at a time through a table (VBMI): a byte's magnitude
// (its low 7 bits) picks the float16 of its value, high and low byte each
// from a 128-entry table (vpermi2b), the byte's sign goes on top, a second
// pair of byte permutes puts the halves together in order, and F16C widens
// them.  About a third of e4m3x16's instructions for the same floats (every
// e4m3fn value is a float16; 0x7f, NaN, is float16's NaN, its sign aside;
// tests/unit/test_kv_bf16.py widens all 256 bytes through it): 30 layers' decode
// attention of 32 sequences at context 125 on a Zen 5 (family 26 model 2),
// 2.57 ms through e4m3x16, 2.21 ms through this (e5m2: 1.97 ms).
//
// A magnitude m's bits in a 16-bit float with exponent bias B and M mantissa
// bits (float16: 15, 10; bfloat16: 127, 7; both hold every e4m3fn value),
// NaN as `nan`.
template <int B, int M, uint16_t NaN>
constexpr uint16_t e4m3_bits(int m) {
  const int e = m >> 3, f = m & 7;
  if (m == 0x7f) return NaN;
  if (e > 0) return static_cast<uint16_t>(((e - 7 + B) << M) | (f << (M - 3)));  // 2^(e - 7) (1 + f/8)
  if (f == 0) return 0;
  int top = 2;  // a subnormal, f 2^-9: a normal value with f's leading bit as its own
  while (!(f >> top)) --top;
  return static_cast<uint16_t>(((top - 9 + B) << M) | ((f << (M - top)) & ((1 << M) - 1)));
}

// A 16-bit pattern per byte magnitude (0-127), as its high and low bytes.
template <uint16_t (*Bits)(int)>
struct E4m3Table {
  alignas(64) uint8_t hi[128], lo[128];
  constexpr E4m3Table() : hi(), lo() {
    for (int m = 0; m < 128; ++m) {
      hi[m] = static_cast<uint8_t>(Bits(m) >> 8);
      lo[m] = static_cast<uint8_t>(Bits(m) & 0xff);
    }
  }
};
inline constexpr E4m3Table<e4m3_bits<15, 10, 0x7e00>> kE4m3Table{};  // float16
// bfloat16: the key rows of scores in bfloat16 pairs (dot_rows_nh's BF).
inline constexpr E4m3Table<e4m3_bits<127, 7, 0x7fc0>> kE4m3Bf16Table{};

// Byte indices into (lo, hi) that interleave them into the float16s of
// values 0-31 (kE4m3Pairs[0]) and 32-63 (kE4m3Pairs[1]).
struct E4m3Pairs {
  alignas(64) uint8_t idx[2][64];
  constexpr E4m3Pairs() : idx() {
    for (int half = 0; half < 2; ++half)
      for (int i = 0; i < 32; ++i) {
        idx[half][2 * i] = static_cast<uint8_t>(32 * half + i);            // lo's byte
        idx[half][2 * i + 1] = static_cast<uint8_t>(64 + 32 * half + i);   // hi's byte
      }
  }
};
inline constexpr E4m3Pairs kE4m3Pairs{};

// 64 e4m3fn bytes as `t`'s 16-bit words, in order: values 0-31 in w[0], 32-63 in w[1].
template <typename Table>
inline void e4m3_words(const void* r, const Table& t, __m512i (&w)[2]) {
  const __m512i b = _mm512_loadu_si512(r);
  const __m512i t_hi0 = _mm512_load_si512(t.hi), t_hi1 = _mm512_load_si512(t.hi + 64);
  const __m512i t_lo0 = _mm512_load_si512(t.lo), t_lo1 = _mm512_load_si512(t.lo + 64);
  // Bit 7 of an index is ignored, bit 6 picks the second register: entry b & 0x7f.
  const __m512i lo = _mm512_permutex2var_epi8(t_lo0, b, t_lo1);
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t_hi0, b, t_hi1), b,
                                               _mm512_set1_epi8(static_cast<char>(0x80)), 0xf8);  // | b & 0x80
  w[0] = _mm512_permutex2var_epi8(lo, _mm512_load_si512(kE4m3Pairs.idx[0]), hi);
  w[1] = _mm512_permutex2var_epi8(lo, _mm512_load_si512(kE4m3Pairs.idx[1]), hi);
}

inline void e4m3x64(const void* r, f32x16* v) {
  __m512i h[2];
  e4m3_words(r, kE4m3Table, h);
  v[0] = reinterpret_cast<f32x16>(_mm512_cvtph_ps(_mm512_castsi512_si256(h[0])));
  v[1] = reinterpret_cast<f32x16>(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h[0], 1)));
  v[2] = reinterpret_cast<f32x16>(_mm512_cvtph_ps(_mm512_castsi512_si256(h[1])));
  v[3] = reinterpret_cast<f32x16>(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h[1], 1)));
}

template <int C>
inline void load_row(const c10::Float8_e4m3fn* r, f32x16 (&v)[C]) {
  int c = 0;
  for (; c + 4 <= C; c += 4) e4m3x64(r + 16 * c, v + c);
  for (; c < C; ++c) v[c] = RowLoad<c10::Float8_e4m3fn>::at(r + 16 * c);
}
#endif

// add_weighted_rows for NH query heads that share a KV head (accumulators
// a + g * D, weights p + g * p_stride): each value row is read and widened
// once for all of them.  Per head the same additions in the same order as
// add_weighted_rows, so the same bits.
template <int D, int NH, typename T>
inline void add_weighted_rows_nh(float* __restrict__ a, const float* __restrict__ p, int64_t p_stride,
                                 const T* __restrict__ rows, int64_t stride, int64_t n) {
  constexpr int C = D / 16;
  f32x16 acc[NH][C];
  for (int g = 0; g < NH; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = *reinterpret_cast<const f32x16_u*>(a + g * D + 16 * c);
  for (int64_t i = 0; i < n; ++i) {
    f32x16 v[C];
    load_row<C>(rows + i * stride, v);
    for (int g = 0; g < NH; ++g) {
      const float pi = p[g * p_stride + i];
      for (int c = 0; c < C; ++c) acc[g][c] += pi * v[c];
    }
  }
  for (int g = 0; g < NH; ++g)
    for (int c = 0; c < C; ++c) *reinterpret_cast<f32x16_u*>(a + g * D + 16 * c) = acc[g][c];
}

// Up to this many heads at a time: their accumulators and a row in 20-24 of
// the 32 registers.
template <int D>
constexpr int64_t kRowHeads = D <= 64 ? 4 : 2;

#endif

// out[i] = op over the 16 lanes of v[i], i < 16: a tree of two-vector
// shuffles and ops (15 ops for 16 results, against 4 a result one vector at a
// time).  lane_sums: the same tree GCC's vectorized sum of one vector takes,
// so the same bits.  AVX-512 only (DW == 16).
template <typename Op>
inline f32x16 lane_reduce(const f32x16 (&v)[16], Op op) {
  f32x16 w[8], x[4], y[2];
  for (int j = 0; j < 8; ++j)  // halves: lanes 0-7 of v[2j]'s partial results, 8-15 v[2j + 1]'s
    w[j] = op(__builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
              __builtin_shufflevector(v[2 * j], v[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                      31));
  for (int j = 0; j < 4; ++j)  // quarters: 4 lanes each of v[4j .. 4j + 3]
    x[j] = op(__builtin_shufflevector(w[2 * j], w[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27),
              __builtin_shufflevector(w[2 * j], w[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31));
  for (int j = 0; j < 2; ++j)  // pairs: 2 lanes each of v[8j .. 8j + 7]
    y[j] = op(__builtin_shufflevector(x[2 * j], x[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29),
              __builtin_shufflevector(x[2 * j], x[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31));
  return op(__builtin_shufflevector(y[0], y[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
            __builtin_shufflevector(y[0], y[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31));
}

inline f32x16 lane_sums(const f32x16 (&v)[16]) {
  return lane_reduce(v, [](f32x16 p, f32x16 q) { return p + q; });
}

// One head's softmax over a span's n scores sh: m becomes their max, sh
// exp(score - m) and l their sum.  AVX-512: 16 scores a register, read as the
// dot products stored them (scalar reads of a vector store stall, waiting for
// it to land), with the attention kernels' exp (exp_poly.h); a NaN score
// stays NaN.  AVX2: the same 8 a register (libm's expf, one score at a time,
// was a quarter of a float16 cache's decode attention: 32 sequences of 130
// positions, 30 layers, on a Zen 4 running the AVX2 build, 9.8 -> 7.2-7.8
// ms).  Not inlined: one body for every cache dtype, so that -ffast-math
// cannot contract it differently in each (a float16 cache's sums are a
// float32 copy's, bit for bit).
__attribute__((noinline)) void span_softmax(float* __restrict__ sh, int64_t n, float& m, float& l) {
#if defined(__AVX512F__)
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 vmax = neg_inf;
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const __mmask16 k = n - i0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i0)) - 1);
    vmax = _mm512_max_ps(_mm512_mask_loadu_ps(neg_inf, k, sh + i0), vmax);
  }
  m = _mm512_reduce_max_ps(vmax);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const __mmask16 k = n - i0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i0)) - 1);
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, sh + i0), mv);
    __m512 e = reinterpret_cast<__m512>(splitserve_exp::exp_nonpositive<f32x16, i32x16>(reinterpret_cast<f32x16>(x)));
    e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
    _mm512_mask_storeu_ps(sh + i0, k, e);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(k, e));
  }
  l = _mm512_reduce_add_ps(vsum);
#elif defined(__AVX2__)
  // The same with 8 scores a register (the same exp, lane by lane); a last
  // partial register goes through `tail`, its lanes past n at -inf for the
  // max and left out of the sum.
  typedef int32_t i32x8 __attribute__((vector_size(32)));  // dvec's lanes (DW is 8 here) as integers
  const int64_t whole = n / 8 * 8, rest = n - whole;
  alignas(32) float tail[8];
  for (int64_t j = 0; j < 8; ++j) tail[j] = j < rest ? sh[whole + j] : -std::numeric_limits<float>::infinity();
  __m256 vmax = _mm256_load_ps(tail);
  for (int64_t i0 = 0; i0 < whole; i0 += 8) vmax = _mm256_max_ps(_mm256_loadu_ps(sh + i0), vmax);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  m = lanes[0];
  for (int j = 1; j < 8; ++j) m = lanes[j] > m ? lanes[j] : m;
  const __m256 mv = _mm256_set1_ps(m);
  auto exp8 = [&](__m256 v) {
    const __m256 x = _mm256_sub_ps(v, mv);
    const __m256 e = reinterpret_cast<__m256>(splitserve_exp::exp_nonpositive<dvec, i32x8>(reinterpret_cast<dvec>(x)));
    return _mm256_blendv_ps(e, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // NaN stays NaN
  };
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t i0 = 0; i0 < whole; i0 += 8) {
    const __m256 e = exp8(_mm256_loadu_ps(sh + i0));
    _mm256_storeu_ps(sh + i0, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  if (rest > 0) {
    _mm256_store_ps(tail, exp8(_mm256_load_ps(tail)));
    for (int64_t j = rest; j < 8; ++j) tail[j] = 0.f;
    vsum = _mm256_add_ps(vsum, _mm256_load_ps(tail));
    std::memcpy(sh + whole, tail, rest * sizeof(float));
  }
  _mm256_store_ps(lanes, vsum);
  l = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
#else
  m = sh[0];
  for (int64_t i = 1; i < n; ++i) m = std::max(m, sh[i]);
  l = 0.f;
  for (int64_t i = 0; i < n; ++i) { sh[i] = std::exp(sh[i] - m); l += sh[i]; }
#endif
}

// Decode attention in bfloat16 pairs (paged_decode_attention's bf16_dots,
// asked for where a step's generated rows already meet bfloat16 weights).
// Scores: the query, scaled, rounded to bfloat16 once; key rows widened to
// bfloat16, which holds every e4m3fn and bfloat16 value exactly, so each
// product is exact and only the query's rounding differs from the float32
// scores (far below an fp8 key's own: 3 bits of mantissa against 8).  Two
// dot products a head and row where float32 took four multiplies, and no
// float16 widening.  The values' pass pairs too (add_weighted_pairs_nh).
// Other caches and builds stay in float32.
#if defined(__AVX512BF16__)
// n floats (a multiple of 32) rounded to bfloat16, ties to even.
inline void round_bf16(const float* __restrict__ x, uint16_t* __restrict__ y, int64_t n) {
  for (int64_t i = 0; i < n; i += 32) {
    const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    _mm512_storeu_si512(y + i, (__m512i)h);
  }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__)
#define SPLITSERVE_BF16_DOTS 1
template <typename T>
constexpr bool kBf16Keys = std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::BFloat16>;

// A key row's D values as C = D / 32 vectors of bfloat16 pairs, in order.
template <int C>
inline void load_row_bf16(const c10::Float8_e4m3fn* r, __m512bh (&w)[C]) {
  static_assert(C % 2 == 0, "e4m3fn rows are widened 64 values at a time");
  for (int c = 0; c < C; c += 2) {
    __m512i h[2];
    e4m3_words(r + 32 * c, kE4m3Bf16Table, h);
    w[c] = (__m512bh)h[0];
    w[c + 1] = (__m512bh)h[1];
  }
}
template <int C>
inline void load_row_bf16(const c10::BFloat16* r, __m512bh (&w)[C]) {
  for (int c = 0; c < C; ++c) w[c] = (__m512bh)_mm512_loadu_si512(r + 32 * c);
}
#else
template <typename T>
constexpr bool kBf16Keys = false;
#endif

// s[g * s_stride + i] = q[g * D : + D] . rows[i * stride : + D] for i < n,
// 16 positions at a time, for NH query heads that share a KV head: each key
// row is read and widened once for all of them; per head a row's products
// summed in one register, then 16 of them across lanes (lane_sums).  BF: the
// products in bfloat16 pairs (above; kBf16Keys rows, D a multiple of 64).
template <int D, int NH, bool BF, typename T>
inline void dot_rows_nh(const float* __restrict__ q, const T* __restrict__ rows, int64_t stride, int64_t n,
                        float* __restrict__ s, int64_t s_stride) {
  // One row's NH register sums: float32 products, or bfloat16 pairs.
  auto row_sums = [&] {
#if defined(SPLITSERVE_BF16_DOTS)
    if constexpr (BF) {
      constexpr int C = D / 32;
      std::array<std::array<__m512bh, C>, NH> qv;
      for (int g = 0; g < NH; ++g)
        for (int c = 0; c < C; ++c)  // the second argument fills the low half: values in order
          qv[g][c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + g * D + 32 * c + 16), _mm512_loadu_ps(q + g * D + 32 * c));
      return [qv](const T* r, f32x16 (&sums)[NH]) {
        __m512bh row[C];
        load_row_bf16<C>(r, row);
        for (int g = 0; g < NH; ++g) {
          __m512 acc = _mm512_setzero_ps();
          for (int c = 0; c < C; ++c) acc = _mm512_dpbf16_ps(acc, row[c], qv[g][c]);
          sums[g] = reinterpret_cast<f32x16>(acc);
        }
      };
    } else
#endif
    {
      static_assert(!BF, "bfloat16 pairs need AVX512-BF16 and AVX512-VBMI");
      constexpr int C = D / 16;
      std::array<std::array<f32x16, C>, NH> qv;
      for (int g = 0; g < NH; ++g)
        for (int c = 0; c < C; ++c) qv[g][c] = *reinterpret_cast<const f32x16_u*>(q + g * D + 16 * c);
      return [qv](const T* r, f32x16 (&sums)[NH]) {
        f32x16 row[C];
        load_row<C>(r, row);
        for (int g = 0; g < NH; ++g) {
          f32x16 acc = {};
          for (int c = 0; c < C; ++c) acc += qv[g][c] * row[c];
          sums[g] = acc;
        }
      };
    }
  }();
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - i0);
    f32x16 part[NH][16];
    for (int j = 0; j < 16; ++j) {
      f32x16 sums[NH];
      if (j < m) row_sums(rows + (i0 + j) * stride, sums);
      else
        for (int g = 0; g < NH; ++g) sums[g] = f32x16{};
      for (int g = 0; g < NH; ++g) part[g][j] = sums[g];
    }
    for (int g = 0; g < NH; ++g) {
      const f32x16 lanes = lane_sums(part[g]);
      if (m == 16) *reinterpret_cast<f32x16_u*>(s + g * s_stride + i0) = lanes;
      else std::memcpy(s + g * s_stride + i0, &lanes, m * sizeof(float));
    }
  }
}

template <int D, bool BF, typename T>
inline void dot_rows_heads(const float* __restrict__ q, const T* __restrict__ rows, int64_t stride, int64_t n,
                           float* __restrict__ s, int64_t s_stride, int64_t nh) {
  switch (nh) {
    case 1: return dot_rows_nh<D, 1, BF>(q, rows, stride, n, s, s_stride);
    case 2: return dot_rows_nh<D, 2, BF>(q, rows, stride, n, s, s_stride);
    case 3: return dot_rows_nh<D, 3, BF>(q, rows, stride, n, s, s_stride);
    default: return dot_rows_nh<D, 4, BF>(q, rows, stride, n, s, s_stride);
  }
}

#if defined(__AVX512F__)
#if defined(SPLITSERVE_BF16_DOTS)
// add_weighted_rows_nh in bfloat16 pairs (BF): the weights p, rounded to
// bfloat16 (the prefill kernel's bfloat16 rows round theirs too), times the
// value rows widened to bfloat16 (exact), two positions a dot product.  Two
// rows' values interleave within each 128-bit lane (unpacklo/hi_epi16), so
// accumulator k's lane 4L + j holds value 32 (k / 2) + 8L + 4 (k % 2) + j:
// a[] is kept in that order from the span's first block to its last, and
// unpair_values puts it back.  An odd block's last row pairs with zeros.
template <int D, int NH, typename T>
inline void add_weighted_pairs_nh(float* __restrict__ a, const uint16_t* __restrict__ p, int64_t p_stride,
                                  const T* __restrict__ rows, int64_t stride, int64_t n) {
  constexpr int C = D / 16, W = D / 32;
  __m512 acc[NH][C];
  for (int g = 0; g < NH; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_loadu_ps(a + g * D + 16 * c);
  for (int64_t i = 0; i < n; i += 2) {
    const bool two = i + 1 < n;
    __m512bh r0[W], r1[W];
    load_row_bf16<W>(rows + i * stride, r0);
    if (two) load_row_bf16<W>(rows + (i + 1) * stride, r1);
    else
      for (int w = 0; w < W; ++w) r1[w] = (__m512bh)_mm512_setzero_si512();
    __m512bh v[C];
    for (int w = 0; w < W; ++w) {
      v[2 * w] = (__m512bh)_mm512_unpacklo_epi16((__m512i)r0[w], (__m512i)r1[w]);
      v[2 * w + 1] = (__m512bh)_mm512_unpackhi_epi16((__m512i)r0[w], (__m512i)r1[w]);
    }
    for (int g = 0; g < NH; ++g) {
      uint32_t pair = p[g * p_stride + i];
      if (two) pair |= static_cast<uint32_t>(p[g * p_stride + i + 1]) << 16;
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], v[c], pp);
    }
  }
  for (int g = 0; g < NH; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(a + g * D + 16 * c, acc[g][c]);
}

// a[0:D], in add_weighted_pairs_nh's order, back in the values' order.
template <int D>
inline void unpair_values(float* __restrict__ a) {
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int w = 0; w < D / 32; ++w) {
    const __m512 x = _mm512_loadu_ps(a + 32 * w), y = _mm512_loadu_ps(a + 32 * w + 16);
    _mm512_storeu_ps(a + 32 * w, _mm512_permutex2var_ps(x, lo, y));
    _mm512_storeu_ps(a + 32 * w + 16, _mm512_permutex2var_ps(x, hi, y));
  }
}
#endif

// add_weighted_rows_nh (p: float weights) or add_weighted_pairs_nh (p:
// bfloat16 weights) for nh (1 .. kRowHeads<D>) heads.
template <int D, int NH, typename P, typename T>
inline void add_weighted_nh(float* __restrict__ a, const P* __restrict__ p, int64_t p_stride,
                            const T* __restrict__ rows, int64_t stride, int64_t n) {
#if defined(SPLITSERVE_BF16_DOTS)
  if constexpr (std::is_same_v<P, uint16_t>) {
    add_weighted_pairs_nh<D, NH>(a, p, p_stride, rows, stride, n);
    return;
  }
#endif
  static_assert(std::is_same_v<P, float> || std::is_same_v<P, uint16_t>, "weights: float32, or bfloat16 bits");
  if constexpr (std::is_same_v<P, float>) add_weighted_rows_nh<D, NH>(a, p, p_stride, rows, stride, n);
}

template <int D, typename P, typename T>
inline void add_weighted_rows_heads(float* __restrict__ a, const P* __restrict__ p, int64_t p_stride,
                                    const T* __restrict__ rows, int64_t stride, int64_t n, int64_t nh) {
  if constexpr (kRowHeads<D> == 4) {
    switch (nh) {
      case 1: return add_weighted_nh<D, 1>(a, p, p_stride, rows, stride, n);
      case 2: return add_weighted_nh<D, 2>(a, p, p_stride, rows, stride, n);
      case 3: return add_weighted_nh<D, 3>(a, p, p_stride, rows, stride, n);
      default: return add_weighted_nh<D, 4>(a, p, p_stride, rows, stride, n);
    }
  } else {
    if (nh == 1) return add_weighted_nh<D, 1>(a, p, p_stride, rows, stride, n);
    return add_weighted_nh<D, 2>(a, p, p_stride, rows, stride, n);
  }
}
#endif

// Partial result of one span: per query head, m, l and the unnormalised sum.
struct Partial {
  float* m;    // [Hq]
  float* l;    // [Hq]
  float* acc;  // [Hq, D]
};

// D_ > 0: head size known at compile time (unrolled, vectorised); 0: any.
// Two passes over the span's blocks: every position's scores first (scores:
// [Hq, PART_TOKENS]), then one softmax per head over all of them, then the
// values weighted by it.  Folding block by block (an online softmax) put a
// chain of reductions, a scalar exp and a rescale of the accumulators between
// every 16 positions; a span's scores fit in L1 (Hq x 128 floats), and its
// values, asked for during the first pass, wait in L2 for the second.
// BF: scores and weighted values in bfloat16 pairs (dot_rows_nh's BF,
// add_weighted_pairs_nh; kBf16Keys caches, D_ a multiple of 64).
template <typename scalar_t, int D_, bool BF>
void span(const scalar_t* __restrict__ base, const int32_t* __restrict__ table,
          int64_t t0, int64_t t1, const float* __restrict__ qf, int64_t Hq, int64_t Hkv,
          int64_t D_dyn, int64_t bs, int64_t s_blk, int64_t s_kv, int64_t s_tok, int64_t s_head,
          Partial out, float* __restrict__ scores /* [Hq, PART_TOKENS] */,
          float* __restrict__ kv_f /* [bs, Hkv, D] */) {
  constexpr int64_t PT = PART_TOKENS;
  const int64_t D = D_ > 0 ? D_ : D_dyn;
  const int64_t G = Hq / Hkv;
  const int64_t row_bytes = s_tok * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t v_bytes = s_kv * static_cast<int64_t>(sizeof(scalar_t));
  std::fill(out.acc, out.acc + Hq * D, 0.f);
  // Where RowLoad cannot widen rows in registers (AVX2 builds; fp8 without
  // AVX512BW), the block's rows of a KV head as floats (and their stride):
  // float32 rows where they are, others widened into kv_f first, all heads
  // at once.
  auto widen = [&](const scalar_t* rows, int64_t n) {
    if constexpr (!std::is_same_v<scalar_t, float>) {
      if (s_head == D && s_tok == Hkv * D)  // the block's rows are one run: widened in one pass
        as_floats(rows, kv_f, n * Hkv * D);
      else
        for (int64_t i = 0; i < n; ++i)
          for (int64_t hk = 0; hk < Hkv; ++hk)
            as_floats(rows + i * s_tok + hk * s_head, kv_f + (i * Hkv + hk) * D, D);
    }
  };
  auto head_rows = [&](const scalar_t* rows, int64_t hk) -> std::pair<const float*, int64_t> {
    if constexpr (std::is_same_v<scalar_t, float>) return {rows + hk * s_head, s_tok};
    else return {kv_f + hk * D, Hkv * D};
  };
  // Pass 1: the scores of every query head and position.
  for (int64_t t = t0; t < t1;) {
    const int64_t off = t % bs;
    const int64_t n = std::min(bs - off, t1 - t);  // positions of this block in the span
    const scalar_t* kb = base + table[t / bs] * s_blk + off * s_tok;
    float* sb = scores + (t - t0);
    // The next block lies elsewhere in memory, where the hardware prefetchers
    // cannot guess: while this block computes, ask for the next one's keys
    // and values, row by row.
    const char* next = t + n < t1 ? reinterpret_cast<const char*>(base + table[(t + n) / bs] * s_blk)
                                  : nullptr;
    if constexpr (D_ > 0 && D_ % 16 == 0 && DW == 16) {
      // Rows widened in registers as they are read where RowLoad can, else
      // widened into kv_f first: the same sums either way.
      if constexpr (!RowLoad<scalar_t>::value) widen(kb, n);
      for (int64_t hk = 0; hk < Hkv; ++hk) {
        if (next != nullptr) {  // its values too: pass 2 then finds them in L2 (Zen 4, 32
                                // sequences at context 130-300 over a float16 cache: 3-6% faster
                                // than asking for them in pass 2 alone)
          prefetch_share(next, n * row_bytes, hk, Hkv);
          prefetch_share(next + v_bytes, n * row_bytes, hk, Hkv);
        }
        auto dots = [&](const auto* krows, int64_t kstride) {
          for (int64_t g0 = 0; g0 < G; g0 += 4) {
            const int64_t h = hk * G + g0;
            constexpr bool pairs = BF && kBf16Keys<std::remove_cv_t<std::remove_pointer_t<decltype(krows)>>>;
            dot_rows_heads<D_, pairs>(qf + h * D, krows, kstride, n, sb + h * PT, PT, std::min<int64_t>(4, G - g0));
          }
        };
        if constexpr (RowLoad<scalar_t>::value) {
          dots(kb + hk * s_head, s_tok);
        } else {
          const auto [krows, kstride] = head_rows(kb, hk);
          dots(krows, kstride);
        }
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        if (next != nullptr)
          for (int64_t c = 0; c < row_bytes; c += 64) prefetch_line(next + i * row_bytes + c);
        for (int64_t hk = 0; hk < Hkv; ++hk) {
          const float* kr = as_floats(kb + i * s_tok + hk * s_head, kv_f + (i * Hkv + hk) * D, D);
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = hk * G + g;
            const float* __restrict__ qh = qf + h * D;
            float s = 0.f;
            for (int64_t d = 0; d < D; ++d) s += qh[d] * kr[d];
            sb[h * PT + i] = s;
          }
        }
      }
    }
    t += n;
  }
  // Each head's softmax over the span: its max m, its sum l, scores -> weights.
  for (int64_t h = 0; h < Hq; ++h) span_softmax(scores + h * PT, t1 - t0, out.m[h], out.l[h]);
  // Pass 2: values, acc_h += p_h,i v_i.
#if defined(SPLITSERVE_BF16_DOTS)
  constexpr bool kPairs = BF && kBf16Keys<scalar_t> && D_ > 0 && D_ % 64 == 0;
  // The grouped pass below is the one that pairs; unpair_values expects its order.
  static_assert(!kPairs || RowLoad<scalar_t>::value, "bfloat16 pairs take the grouped values pass");
#else
  constexpr bool kPairs = false;
#endif
  const uint16_t* p16 = nullptr;  // kPairs: the weights in bfloat16, [Hq, PT] as scores
#if defined(SPLITSERVE_BF16_DOTS)
  static_assert(PART_TOKENS % 32 == 0, "round_bf16 takes whole rows of scores");
  if constexpr (kPairs) {  // every head's whole row of PT (a multiple of 32); past the span's positions unread
    thread_local std::vector<uint16_t> rounded;
    rounded.resize(Hq * PT);
    round_bf16(scores, rounded.data(), Hq * PT);
    p16 = rounded.data();
  }
#endif
  for (int64_t t = t0; t < t1;) {
    const int64_t off = t % bs;
    const int64_t n = std::min(bs - off, t1 - t);
    const scalar_t* vb = base + table[t / bs] * s_blk + off * s_tok + s_kv;
    const float* pb = scores + (t - t0);
    const char* next = t + n < t1 ? reinterpret_cast<const char*>(base + table[(t + n) / bs] * s_blk + s_kv)
                                  : nullptr;
    if constexpr (D_ > 0 && D_ % DW == 0) {
      // Each head's accumulator stays in registers across the block's positions
      // (added to in memory, position by position, it was a store and a load
      // per 16 values and position: the kernel's largest cost); the same
      // additions in the same order, so the same bits.
      bool grouped = false;
#if defined(__AVX512F__)
      if constexpr (D_ % 16 == 0 && RowLoad<scalar_t>::value) {
        // The heads of a KV head together, its rows widened in registers
        // (pass 1 asked for these values already: nothing to ask for here);
        // BF: the weights in bfloat16 (pairs).
        constexpr int64_t HM = kRowHeads<D_>;
        for (int64_t hk = 0; hk < Hkv; ++hk) {
          for (int64_t g0 = 0; g0 < G; g0 += HM) {
            const int64_t h = hk * G + g0;
            if constexpr (kPairs)
              add_weighted_rows_heads<D_>(out.acc + h * D, p16 + h * PT + (t - t0), PT, vb + hk * s_head, s_tok, n,
                                          std::min(HM, G - g0));
            else
              add_weighted_rows_heads<D_>(out.acc + h * D, pb + h * PT, PT, vb + hk * s_head, s_tok, n,
                                          std::min(HM, G - g0));
          }
        }
        grouped = true;
      }
#endif
      if (!grouped) {
        widen(vb, n);
        for (int64_t h = 0; h < Hq; ++h) {
          if (next != nullptr) prefetch_share(next, n * row_bytes, h, Hq);
          const auto [vrows, vstride] = head_rows(vb, h / G);
          add_weighted_rows<D_>(out.acc + h * D, pb + h * PT, vrows, vstride, n);
        }
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        if (next != nullptr)
          for (int64_t c = 0; c < row_bytes; c += 64) prefetch_line(next + i * row_bytes + c);
        for (int64_t hk = 0; hk < Hkv; ++hk) {
          const float* vr = as_floats(vb + i * s_tok + hk * s_head, kv_f + (i * Hkv + hk) * D, D);
          for (int64_t g = 0; g < G; ++g) {
            const int64_t h = hk * G + g;
            const float p = pb[h * PT + i];
            float* __restrict__ a = out.acc + h * D;
            for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
          }
        }
      }
    }
    t += n;
  }
#if defined(SPLITSERVE_BF16_DOTS)
  if constexpr (kPairs)
    for (int64_t h = 0; h < Hq; ++h) unpair_values<D_>(out.acc + h * D);
#endif
  (void)p16;
}

// scalar_t: the query's and output's dtype; cache_t: the cache's (the same, bfloat16, float16 or fp8).
template <typename scalar_t, typename cache_t, int D_>
void decode_kernel(const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   double scale, int64_t window, bool bf16_dots, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1);
  const int64_t D = D_ > 0 ? D_ : q.size(2);
  const int64_t bs = kv.size(3), Hkv = kv.size(4);
  const int64_t s_blk = kv.stride(0), s_lyr = kv.stride(1), s_kv = kv.stride(2),
                s_tok = kv.stride(3), s_head = kv.stride(4);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* base = kv.data_ptr<cache_t>() + layer * s_lyr;
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t bt_stride = block_tables.stride(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);

  // Tasks: (sequence, span); first[b] is sequence b's first task, lo[b] its
  // first visible position, span_lo[b] the fixed span that holds it.
  std::vector<int64_t> first(B + 1, 0), lo(B), span_lo(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = lens[b];
    TORCH_CHECK(L > 0, "seq_lens: every sequence needs at least one position");
    lo[b] = window > 0 ? std::max<int64_t>(0, L - window) : 0;
    span_lo[b] = lo[b] / PART_TOKENS;
    first[b + 1] = first[b] + (L + PART_TOKENS - 1) / PART_TOKENS - span_lo[b];
  }
  const int64_t T = first[B];
  // Every task writes its whole partial (span() starts it): not zeroed here.
  std::unique_ptr<float[]> part_m(new float[T * Hq]), part_l(new float[T * Hq]), part_acc(new float[T * Hq * D]);
  std::vector<int64_t> task_seq(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = first[b]; i < first[b + 1]; ++i) task_seq[i] = b;

  const int64_t block_kv_bytes = (s_kv + bs * s_tok) * static_cast<int64_t>(sizeof(cache_t));  // K, then V
  // span's BF where it applies (kBf16Keys, whole 64-value rows).
  auto span_fn = span<cache_t, D_, false>;
  if constexpr (kBf16Keys<cache_t> && D_ > 0 && D_ % 64 == 0)
    if (bf16_dots) span_fn = span<cache_t, D_, true>;
  // Spans of each sequence not yet done: the thread that finishes its last
  // one merges them (in span order, so the same bits whichever thread it is),
  // where a second parallel region after the spans cost a dispatch a layer.
  // With the values asked for in pass 1 (span()), a decode step's attention of
  // 32 sequences at context 100-180 over a float16 cache took 5.1-6.1 against
  // 5.7-7.0 ms (Zen 4, family 25 model 17; engine processes alternated, 7 pairs).
  std::unique_ptr<std::atomic<int32_t>[]> spans_left(new std::atomic<int32_t>[B]);
  for (int64_t b = 0; b < B; ++b) spans_left[b].store(static_cast<int32_t>(first[b + 1] - first[b]),
                                                      std::memory_order_relaxed);
  auto merge = [&](int64_t b) {
    thread_local std::vector<float> merged;
    merged.resize(D);
    float* acc = merged.data();
    for (int64_t h = 0; h < Hq; ++h) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t i = first[b]; i < first[b + 1]; ++i) m = std::max(m, part_m[i * Hq + h]);
      float l = 0.f;
      std::fill(acc, acc + D, 0.f);
      for (int64_t i = first[b]; i < first[b + 1]; ++i) {
        const float w = std::exp(part_m[i * Hq + h] - m);
        l += part_l[i * Hq + h] * w;
        const float* a = &part_acc[(i * Hq + h) * D];
        for (int64_t d = 0; d < D; ++d) acc[d] += a[d] * w;
      }
      const float inv = 1.f / l;
      for (int64_t d = 0; d < D; ++d) op[(b * Hq + h) * D + d] = static_cast<scalar_t>(acc[d] * inv);
    }
  };
  parallel_claim(T, 1, [&](int64_t begin, int64_t end) {
    // Scratch kept by each thread across pieces and calls (a piece is one task:
    // fresh vectors were an allocation and 13 KB of zeroing each, 1% of a step).
    thread_local std::vector<float> qf, scores, kv_f;
    qf.resize(Hq * D);
    scores.resize(Hq * PART_TOKENS);
    kv_f.resize(bs * Hkv * D);
    int64_t qb = -1;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task_seq[task];
      if (b != qb) {
        for (int64_t i = 0; i < Hq * D; ++i) qf[i] = to_f(qp[b * Hq * D + i]) * fscale;
        qb = b;
      }
      const int64_t s0 = (task - first[b] + span_lo[b]) * PART_TOKENS;  // the span's fixed start
      const int64_t t0 = std::max(lo[b], s0);
      const int64_t t1 = std::min<int64_t>(s0 + PART_TOKENS, lens[b]);
      Partial p{&part_m[task * Hq], &part_l[task * Hq], &part_acc[task * Hq * D]};
      // The span's first block, keys and values, asked for at once: span()
      // asks for each next block while the one before computes, but nothing
      // came before the first, whose rows the loads would otherwise miss one
      // by one (Zen 4, 32 sequences at context ~110: the layer's decode
      // attention 4-5% faster).
      const char* first_block = reinterpret_cast<const char*>(base + bt[b * bt_stride + t0 / bs] * s_blk);
      for (int64_t c = 0; c < block_kv_bytes; c += 64) prefetch_line(first_block + c);
      // And the next task's first block: a thread's tasks are consecutive
      // (parallel_claim.h's shares), so it is ready when that task starts (Zen
      // 4, 32 sequences, 30 layers over a bfloat16 cache, 8 pairs of
      // alternating processes: median 0.94x the time at context 264, 0.95x
      // at 100).
      if (task + 1 < T) {
        const int64_t nb = task_seq[task + 1];
        const int64_t ns0 = (task + 1 - first[nb] + span_lo[nb]) * PART_TOKENS, nt0 = std::max(lo[nb], ns0);
        const char* nblk = reinterpret_cast<const char*>(base + bt[nb * bt_stride + nt0 / bs] * s_blk);
        for (int64_t c = 0; c < block_kv_bytes; c += 64) prefetch_line(nblk + c);
      }
      span_fn(base, bt + b * bt_stride, t0, t1, qf.data(), Hq, Hkv, D, bs, s_blk, s_kv, s_tok, s_head, p, scores.data(),
          kv_f.data());
      if (first[b + 1] - first[b] == 1) {  // one span: normalised here, as a merge would
        for (int64_t h = 0; h < Hq; ++h) {
          const float inv = 1.f / p.l[h];
          const float* a = p.acc + h * D;
          for (int64_t d = 0; d < D; ++d) op[(b * Hq + h) * D + d] = static_cast<scalar_t>(a[d] * inv);
        }
      } else if (spans_left[b].fetch_sub(1, std::memory_order_acq_rel) == 1) {
        merge(b);  // the sequence's last span to finish: every partial is written
      }
    }
  });
}

// The head size as a compile-time constant where it is a common one.
template <typename scalar_t, typename cache_t>
void decode_heads(const at::Tensor& q, const at::Tensor& kv, int64_t layer, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, double scale, int64_t window, bool bf16_dots, at::Tensor& out) {
  switch (q.size(2)) {
    case 64:
      decode_kernel<scalar_t, cache_t, 64>(q, kv, layer, block_tables, seq_lens, scale, window, bf16_dots, out);
      break;
    case 128:
      decode_kernel<scalar_t, cache_t, 128>(q, kv, layer, block_tables, seq_lens, scale, window, bf16_dots, out);
      break;
    default: decode_kernel<scalar_t, cache_t, 0>(q, kv, layer, block_tables, seq_lens, scale, window, bf16_dots, out);
  }
}


// ---- prefill attention ----
//
// The query tokens of the step's prefills (and multi-token chunks after a
// cached prefix): sequence b's q_len queries sit at positions L - q_len ..
// L - 1 and see keys 0 .. their own position (or, with a window W, the last W
// of them), all read from the paged cache (the step's new keys are already
// stored).  A task is one KV head and a run of queries: the G query heads that
// share the KV head times those queries are the rows of two small matrix
// products per block of BK keys, S = Q K^T and O += P V, with an online
// softmax between them (as in flash attention).
//
// Keys are taken in blocks at fixed positions (0, BK, 2 BK, ...), and each
// row's arithmetic touches its own row only: a query's output is bit for bit
// the same however its prompt was cut into chunks, whatever else the step
// holds, and with or without a cached prefix.  Keys no row of a task can see
// are never read.
namespace prefill {

#if defined(__AVX512F__) || defined(SPLITSERVE_PREFILL_VW16)  // the latter: AVX-512's tiling, checked on AVX2
constexpr int VW = 16;
#else
constexpr int VW = 8;
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef float vf_u __attribute__((vector_size(VW * 4), aligned(4)));

constexpr int KT = 16;           // keys per tile of S, head dims per tile of O
constexpr int NV = KT / VW;      // vectors per tile row
constexpr int MR = VW == 16 ? 12 : 6;  // rows per micro-kernel: 12 accumulators of 16 registers (AVX2)
constexpr int64_t BK = 64;       // keys per block
constexpr int64_t ROWS = 96;     // rows per task (query heads x queries), about

inline vf load(const float* p) { return *reinterpret_cast<const vf_u*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vf_u*>(p) = v; }
inline vf splat(float x) { return vf{} + x; }

// exp(x) for x <= 0, lane by lane (exp_poly.h).
inline vf exp_neg(vf x) { return splitserve_exp::exp_nonpositive<vf, vi>(x); }

inline float exp_neg1(float x) {
  const vf v = exp_neg(splat(x));
  return v[0];
}

// s[r][0..16) = q_r . kt[.][0..16) for R rows (q rows D apart, s rows ls apart).
template <int R>
inline void qk_tile(const float* __restrict__ q, int64_t D, const float* __restrict__ kt, float* __restrict__ s,
                    int64_t ls) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = splat(0.f);
  for (int64_t d = 0; d < D; ++d) {
    vf k[NV];
    for (int v = 0; v < NV; ++v) k[v] = load(kt + d * KT + v * VW);
    for (int r = 0; r < R; ++r) {
      const vf a = splat(q[r * D + d]);
      for (int v = 0; v < NV; ++v) acc[r][v] += a * k[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) store(s + r * ls + v * VW, acc[r][v]);
}

// o[r][d0..d0+16) = o * rescale[r] + sum over keys i0..i1 of p[r][i] v[i][d0..].
template <int R>
inline void pv_tile(const float* __restrict__ p, int64_t lp, int64_t i0, int64_t i1, const float* __restrict__ v,
                    int64_t D, int64_t d0, const float* __restrict__ rescale, float* __restrict__ o) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < NV; ++u) acc[r][u] = load(o + r * D + d0 + u * VW) * rescale[r];
  for (int64_t i = i0; i < i1; ++i) {
    vf w[NV];
    for (int u = 0; u < NV; ++u) w[u] = load(v + i * D + d0 + u * VW);
    for (int r = 0; r < R; ++r) {
      const vf a = splat(p[r * lp + i]);
      for (int u = 0; u < NV; ++u) acc[r][u] += a * w[u];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < NV; ++u) store(o + r * D + d0 + u * VW, acc[r][u]);
}

// The R-row kernels for any rows < MR at the end of a task.
template <int R>
inline void qk_rows(int64_t rows, const float* q, int64_t D, const float* kt, float* s, int64_t ls) {
  if constexpr (R > 1) {
    if (rows < R) return qk_rows<R - 1>(rows, q, D, kt, s, ls);
  }
  qk_tile<R>(q, D, kt, s, ls);
}

template <int R>
inline void pv_rows(int64_t rows, const float* p, int64_t lp, int64_t i0, int64_t i1, const float* v, int64_t D,
                    int64_t d0, const float* rescale, float* o) {
  if constexpr (R > 1) {
    if (rows < R) return pv_rows<R - 1>(rows, p, lp, i0, i1, v, D, d0, rescale, o);
  }
  pv_tile<R>(p, lp, i0, i1, v, D, d0, rescale, o);
}

struct Task {
  int64_t seq, head, q0, q1, cost;
  bool bf16;  // the rows are prompt tokens that attend in bfloat16 (below)
};

// Softmax of one row's block of scores s[0..n) (n a multiple of VW), visible
// keys [a, e): the running max m and sum l updated, s replaced by p (0
// outside [a, e)), and the factor for the row's output so far returned.  A
// row that sees every key of the block takes the unmasked loop; its p and sum
// come out the same bits.
inline float softmax_block(float* __restrict__ s, int64_t a, int64_t e, int64_t n, float& m, float& l,
                           const vi& lane) {
  vf sum = splat(0.f);
  float m_new;
  if (a == 0 && e == n) {
    vf mx = load(s);
    for (int64_t j = VW; j < n; j += VW) {
      const vf x = load(s + j);
      mx = x > mx ? x : mx;
    }
    float bmax = mx[0];
    for (int u = 1; u < VW; ++u) bmax = std::max(bmax, mx[u]);
    m_new = std::max(m, bmax);
    for (int64_t j = 0; j < n; j += VW) {
      const vf p = exp_neg(load(s + j) - m_new);
      store(s + j, p);
      sum += p;
    }
  } else {
    const int64_t j0 = a / VW * VW, j1 = (e + VW - 1) / VW * VW;
    const vf lowest = splat(-std::numeric_limits<float>::max());
    vf mx = lowest;
    for (int64_t j = j0; j < j1; j += VW) {  // the max of the visible lanes: any order, the same
      const vi idx = lane + static_cast<int32_t>(j);
      const vf x = (idx >= static_cast<int32_t>(a)) & (idx < static_cast<int32_t>(e)) ? load(s + j) : lowest;
      mx = x > mx ? x : mx;
    }
    float bmax = mx[0];
    for (int u = 1; u < VW; ++u) bmax = std::max(bmax, mx[u]);
    m_new = std::max(m, bmax);
    std::fill(s, s + j0, 0.f);
    std::fill(s + j1, s + n, 0.f);
    for (int64_t j = j0; j < j1; j += VW) {
      const vi idx = lane + static_cast<int32_t>(j);
      const vf p = exp_neg(load(s + j) - m_new);
      const vf masked = (idx >= static_cast<int32_t>(a)) & (idx < static_cast<int32_t>(e)) ? p : splat(0.f);
      store(s + j, masked);
      sum += masked;
    }
  }
  float total = sum[0];
  for (int u = 1; u < VW; ++u) total += sum[u];
  const float rescale = exp_neg1(m - m_new);
  l = l * rescale + total;
  m = m_new;
  return rescale;
}

// ---- bfloat16 prompt rows (--prefill-dtype bfloat16) ----
//
// A float32 model's prompt tokens may attend in bfloat16: the scaled q, the
// keys, the softmax's p and the values rounded to nearest even (a bfloat16
// cache's keys and values as stored), S = Q K^T and O += P V as `vdpbf16ps`
// products of pairs summed in float32; the softmax, its running max and sum
// and the output stay float32.  The blocks, the online softmax and each row's
// order of sums are the float32 path's, so a row's bits still depend on its
// own sequence alone.  Keys are packed as tiles of 16 keys [D / 2][16][2]
// (pairs of head dims), values as pairs of keys [key / 2][D][2].

using splitserve_bf16::round_bits;

// A cache row of D values as bfloat16: a bfloat16 cache's bits as stored,
// others widened to float32 (into buf) and rounded.
template <typename cache_t>
inline void as_bf16(const cache_t* row, float* buf, uint16_t* out, int64_t D) {
  if constexpr (std::is_same_v<cache_t, c10::BFloat16>) {
    std::memcpy(out, row, D * sizeof(uint16_t));
  } else {
    const float* f = as_floats(row, buf, D);
    for (int64_t d = 0; d < D; ++d) out[d] = round_bits(f[d]);
  }
}

#if defined(__AVX512BF16__)
constexpr bool HAS_BF16 = true;
constexpr int BR = 6;  // rows per bfloat16 micro-kernel, times up to 4 vectors: 24 accumulators

inline __m512bh pair_splat(const uint16_t* p) {
  uint32_t u;
  std::memcpy(&u, p, 4);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(u));
}

// s[r][16 t .. 16 t + 16) = q_r . keys of tile t, t < NT, for R rows of q
// (bfloat16, D apart); kt: NT consecutive key tiles [D / 2][16][2].
template <int R, int NT>
inline void qk_tile_bf(const uint16_t* __restrict__ q, int64_t D, const uint16_t* __restrict__ kt,
                       float* __restrict__ s, int64_t ls) {
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 2) {
    __m512bh k[NT];
    for (int t = 0; t < NT; ++t) k[t] = (__m512bh)_mm512_loadu_si512(kt + t * KT * D + d * KT);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = pair_splat(q + r * D + d);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], a, k[t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(s + r * ls + t * KT, acc[r][t]);
}

// o[r][d0 .. d0 + 16 NT) = o * rescale[r] + sum over key pairs j0..j1 of
// p[r][2j, 2j+1] . v[2j, 2j+1][d] (p: bfloat16 rows lp apart; v: [pair][D][2]).
template <int R, int NT>
inline void pv_tile_bf(const uint16_t* __restrict__ p, int64_t lp, int64_t j0, int64_t j1,
                       const uint16_t* __restrict__ v, int64_t D, int64_t d0, const float* __restrict__ rescale,
                       float* __restrict__ o) {
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t)
      acc[r][t] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d0 + t * KT), _mm512_set1_ps(rescale[r]));
  for (int64_t j = j0; j < j1; ++j) {
    __m512bh w[NT];
    for (int t = 0; t < NT; ++t) w[t] = (__m512bh)_mm512_loadu_si512(v + (j * D + d0 + t * KT) * 2);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = pair_splat(p + r * lp + 2 * j);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], a, w[t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(o + r * D + d0 + t * KT, acc[r][t]);
}

// The kernels for `rows` <= BR rows and `tiles` <= 4 tiles (or vectors).
template <int R, int NT>
inline void qk_bf(int64_t rows, int64_t tiles, const uint16_t* q, int64_t D, const uint16_t* kt, float* s,
                  int64_t ls) {
  if constexpr (R > 1) {
    if (rows < R) return qk_bf<R - 1, NT>(rows, tiles, q, D, kt, s, ls);
  }
  if constexpr (NT > 1) {
    if (tiles < NT) return qk_bf<R, NT - 1>(rows, tiles, q, D, kt, s, ls);
  }
  qk_tile_bf<R, NT>(q, D, kt, s, ls);
}

template <int R, int NT>
inline void pv_bf(int64_t rows, int64_t vecs, const uint16_t* p, int64_t lp, int64_t j0, int64_t j1,
                  const uint16_t* v, int64_t D, int64_t d0, const float* rescale, float* o) {
  if constexpr (R > 1) {
    if (rows < R) return pv_bf<R - 1, NT>(rows, vecs, p, lp, j0, j1, v, D, d0, rescale, o);
  }
  if constexpr (NT > 1) {
    if (vecs < NT) return pv_bf<R, NT - 1>(rows, vecs, p, lp, j0, j1, v, D, d0, rescale, o);
  }
  pv_tile_bf<R, NT>(p, lp, j0, j1, v, D, d0, rescale, o);
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
// On CPUs with AMX (this file is built for its CPU) the same products run on
// AMX tiles where D is a multiple of 32: a key tile [D / 2][16][2] is, 32 dims
// at a time, an AMX B tile as packed, and so are 16 pairs of keys' values
// [pair][16 dims][2]; q and p are A tiles as they lie (rows D and BK apart).
// Rows go 16 at a time (the buffers have whole tiles of rows; a padded row's
// sums are never read), keys 16 at a time for S and 32 for O (p is 0 past a
// row's sight, and values past the sequence are packed as zeros, so the
// extra products add exact zeros).  tdpbf16ps rounds its sums unlike
// vdpbf16ps, so such a machine runs AMX for every bfloat16 prompt row, and a
// row's bits still depend on its own sequence alone.
constexpr int64_t AR = splitserve_amx::ROWS;  // rows of an AMX tile
// Keys per block on AMX tiles, where a block of BK would spend more on its
// fixed costs (the output's rescale, tile loads and stores of it, a row's
// reductions) than on its products.
constexpr int64_t BKA = 256;

// Per task, as the thread may have run other tile code in between.
inline void amx_configure() {
  const splitserve_amx::Config cfg;
  _tile_loadconfig(&cfg);
}

// Up to four tiles of sums at once (tiles 0-3): the A tile (tile 4) is
// loaded once for each four B tiles (they take turns in 5-7), and the sums'
// chains of tdpbf16ps are independent.  Each tile of sums adds its products
// in the order a lone tile would.  GCC's tile intrinsics take tile numbers as
// literal tokens: one statement per tile of sums T (0-3), its B tile
// 5 + T % 3, where NT > T.
#define SPLITSERVE_AMX_EACH(NT, STMT)   \
  do {                                  \
    STMT(0, 5);                         \
    if constexpr (NT > 1) { STMT(1, 6); } \
    if constexpr (NT > 2) { STMT(2, 7); } \
    if constexpr (NT > 3) { STMT(3, 5); } \
  } while (0)

// s[r][j .. j + 16 NT) = q_r . keys, for 16 rows of q (bfloat16, D apart); kt: the block's key tiles.
template <int NT>
inline void qk_amx_tiles(const uint16_t* q, int64_t D, const uint16_t* kt, int64_t j, float* s, int64_t ls) {
#define AMX_ZERO(T, B) _tile_zero(T)
#define AMX_DOT(T, B)                                                  \
  _tile_loadd(B, kt + (j + (T) * KT) * D + ks * 32 * KT, 64); \
  _tile_dpbf16ps(T, 4, B)
#define AMX_STORE(T, B) _tile_stored(T, s + j + (T) * KT, ls * 4)
  SPLITSERVE_AMX_EACH(NT, AMX_ZERO);
  for (int64_t ks = 0; ks < D / 32; ++ks) {
    _tile_loadd(4, q + ks * 32, D * 2);
    SPLITSERVE_AMX_EACH(NT, AMX_DOT);
  }
  SPLITSERVE_AMX_EACH(NT, AMX_STORE);
#undef AMX_ZERO
#undef AMX_DOT
#undef AMX_STORE
}

// qk_amx for two tiles of rows at once (32 rows of q, D = 64), keys j0 ..
// n16 of the block (j0 the first tile's: the second's rows, later in the
// prompt, start no earlier): both tiles' queries stay in tiles 4-7
// throughout, and each key tile's two halves (tiles 2, 3) serve both, half
// a tile load a product where qk_amx_tiles takes 1.25.  Each tile of sums
// gets the two products a lone tile's would, in the same order: the same
// bits.
inline void qk_amx_pair64(const uint16_t* q, const uint16_t* kt, int64_t j0, int64_t n16, float* s, int64_t ls) {
  constexpr int64_t D = 64;
  _tile_loadd(4, q, D * 2);
  _tile_loadd(5, q + 32, D * 2);
  _tile_loadd(6, q + 16 * D, D * 2);
  _tile_loadd(7, q + 16 * D + 32, D * 2);
  for (int64_t j = j0; j < n16; j += KT) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, kt + j * D, 64);
    _tile_loadd(3, kt + j * D + 32 * KT, 64);
    _tile_dpbf16ps(0, 4, 2);
    _tile_dpbf16ps(1, 6, 2);
    _tile_dpbf16ps(0, 5, 3);
    _tile_dpbf16ps(1, 7, 3);
    _tile_stored(0, s + j, ls * 4);
    _tile_stored(1, s + 16 * ls + j, ls * 4);
  }
}

// f(i, std::integral_constant<int, NT>) over [from, to) in steps of NT tiles
// of KT (four while four fit, then what is left).
template <typename F>
inline void by_four_tiles(int64_t from, int64_t to, F&& f) {
  int64_t i = from;
  for (; i + 4 * KT <= to; i += 4 * KT) f(i, std::integral_constant<int, 4>{});
  switch ((to - i) / KT) {
    case 3: f(i, std::integral_constant<int, 3>{}); break;
    case 2: f(i, std::integral_constant<int, 2>{}); break;
    case 1: f(i, std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

inline void qk_amx(const uint16_t* q, int64_t D, const uint16_t* kt, int64_t j0, int64_t n16, float* s, int64_t ls) {
  by_four_tiles(j0, n16, [&](int64_t j, auto nt) { qk_amx_tiles<decltype(nt)::value>(q, D, kt, j, s, ls); });
}

// 2^t for t <= 0, for p that is rounded to bfloat16 (8 significant bits)
// before its products, so it need not carry float32's 24: 2^floor(t) (one
// vscalefps) times a degree-3 polynomial of t - floor(t) (one vreduceps), a
// relative error under 8e-5 against bfloat16's rounding step of 4e-3.  With
// the vcvtne2ps2bf16 below, the whole attention took 0.83-0.97x the time
// (median 0.93x) it took with the degree-4 polynomial of a rounded t this
// replaced (Intel Xeon with AMX, family 6 model 207).
inline __m512 exp2_bf16(__m512 t) {  // t <= 0
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // t - floor(t), in [0, 1)
  __m512 p = _mm512_set1_ps(7.802452147006989e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.260671705007553e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.958335041999817e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999251961708069e-1f));
  return _mm512_scalef_ps(p, t);  // times 2^floor(t)
}

inline f32x16 lane_maxes(const f32x16 (&v)[16]) {
  return lane_reduce(v, [](f32x16 p, f32x16 q) { return p > q ? p : q; });
}

// One row's keys [a, e) of a block (a < e): 16 at a time from a / 16, the
// vectors it sees whole [w0, w1) unmasked, the first and last under a mask.
struct RowKeys {
  int64_t j0 = 0, j1 = 0, w0 = 0, w1 = 0;
  __mmask16 first = 0, last = 0;
  RowKeys() = default;
  RowKeys(int64_t a, int64_t e) {
    j0 = a / KT * KT, j1 = (e + KT - 1) / KT * KT;
    w0 = (a + KT - 1) / KT * KT, w1 = std::max(w0, e / KT * KT);
    first = seen(j0, a, e), last = seen(w1, a, e);
  }
  static __mmask16 seen(int64_t j, int64_t a, int64_t e) {
    const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(static_cast<int32_t>(j)));
    return _mm512_cmpge_epi32_mask(idx, _mm512_set1_epi32(static_cast<int32_t>(a))) &
           _mm512_cmplt_epi32_mask(idx, _mm512_set1_epi32(static_cast<int32_t>(e)));
  }
};

// softmax_block for the rows of one AMX tile (rows <= 16 of them, s and p16
// rows n apart, row r's keys [a[r], e[r])), p written as bfloat16 in the same
// pass: the keys a row sees whole 32 at a time, unmasked, rounded by one
// vcvtne2ps2bf16, its first and last 16 under a mask.  The rows' maxima,
// their factors exp(m - m_new) and their sums come 16 rows to a vector
// (lane_maxes, lane_sums: each row's lanes through the same tree, so a row's
// bits do not depend on the rows beside it); a row at a time, those
// reductions and the scalar exp were 40% of the softmax.  The sum l adds p
// before its rounding, as the other paths do, in key order.  A row with no
// key in sight (a >= e) keeps m and l, gets rescale 1 and p 0.  Compiled
// once, not inlined: under -ffast-math each inlined copy may associate its
// sums its own way, and a row's bits would then move with edits to the code
// around its call.
__attribute__((noinline)) void softmax_tile_bf16(const float* __restrict__ s, int64_t rows, const int64_t* a,
                                                 const int64_t* e, int64_t n, float* __restrict__ m,
                                                 float* __restrict__ l, uint16_t* __restrict__ p16,
                                                 float* __restrict__ rescale) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::max());
  f32x16 part[AR];  // per row: its lanes' maxima, then their sums
  RowKeys keys[AR];  // per row with a key in sight
  for (int64_t r = 0; r < AR; ++r) {
    part[r] = reinterpret_cast<f32x16>(lowest);
    if (r >= rows || a[r] >= e[r]) continue;
    const RowKeys& k = keys[r] = RowKeys(a[r], e[r]);
    const float* sr = s + r * n;
    __m512 mx = lowest;
    if (k.j0 < k.w0) mx = _mm512_mask_max_ps(mx, k.first, mx, _mm512_loadu_ps(sr + k.j0));
    // Two chains of maxima (max is exact in any order): one chain's latency
    // held the attention back (0.92-0.96x the time with two, Intel Xeon with AMX).
    __m512 mx2 = lowest;
    int64_t j = k.w0;
    for (; j + 2 * KT <= k.w1; j += 2 * KT) {
      mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + j));
      mx2 = _mm512_max_ps(mx2, _mm512_loadu_ps(sr + j + KT));
    }
    if (j < k.w1) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + j));
    mx = _mm512_max_ps(mx, mx2);
    if (k.w1 < k.j1) mx = _mm512_mask_max_ps(mx, k.last, mx, _mm512_loadu_ps(sr + k.w1));
    part[r] = reinterpret_cast<f32x16>(mx);
  }
  const __mmask16 live = static_cast<__mmask16>((1u << rows) - 1);
  const __m512 m_old = _mm512_mask_loadu_ps(lowest, live, m);
  const __m512 m_new = _mm512_max_ps(m_old, reinterpret_cast<__m512>(lane_maxes(part)));
  alignas(64) float shift[AR];
  _mm512_store_ps(shift, _mm512_mul_ps(m_new, _mm512_set1_ps(-1.44269504088896341f)));
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  for (int64_t r = 0; r < AR; ++r) {
    part[r] = f32x16{};
    if (r >= rows) continue;
    uint16_t* pr = p16 + r * n;
    if (a[r] >= e[r]) {
      std::fill(pr, pr + n, uint16_t{0});
      continue;
    }
    const RowKeys& k = keys[r];
    const float* sr = s + r * n;
    const __m512 sh = _mm512_set1_ps(shift[r]);
    auto t_of = [&](int64_t j) { return _mm512_fmadd_ps(_mm512_loadu_ps(sr + j), log2e, sh); };
    std::fill(pr, pr + k.j0, uint16_t{0});
    std::fill(pr + k.j1, pr + n, uint16_t{0});
    __m512 sum = _mm512_setzero_ps();
    auto one = [&](int64_t j, __mmask16 seen) {
      const __m512 p = _mm512_maskz_mov_ps(seen, exp2_bf16(t_of(j)));
      sum = _mm512_add_ps(sum, p);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(p));
    };
    if (k.j0 < k.w0) one(k.j0, k.first);
    int64_t j = k.w0;
    for (; j + 2 * KT <= k.w1; j += 2 * KT) {
      const __m512 p0 = exp2_bf16(t_of(j));
      sum = _mm512_add_ps(sum, p0);
      const __m512 p1 = exp2_bf16(t_of(j + KT));
      sum = _mm512_add_ps(sum, p1);
      _mm512_storeu_si512(pr + j, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    if (j < k.w1) one(j, 0xFFFF);
    if (k.w1 < k.j1) one(k.w1, k.last);
    part[r] = reinterpret_cast<f32x16>(sum);
  }
  const __m512 total = reinterpret_cast<__m512>(lane_sums(part));
  const __m512 factor = reinterpret_cast<__m512>(exp_neg(reinterpret_cast<vf>(_mm512_sub_ps(m_old, m_new))));
  const __m512 l_new = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, l), factor, total);
  _mm512_mask_storeu_ps(m, live, m_new);
  _mm512_mask_storeu_ps(l, live, l_new);
  _mm512_mask_storeu_ps(rescale, live, factor);
}

// o's dims d0 .. d0 + 16 NT += sum over key pairs jp0 .. jp1 of p . v (below).
template <int NT>
inline void pv_amx_tiles(const uint16_t* p, int64_t lp, int64_t jp0, int64_t jp1, const uint16_t* v, int64_t D,
                         int64_t d0, float* o) {
#define AMX_LOAD(T, B) _tile_loadd(T, o + d0 + (T) * KT, D * 4)
#define AMX_DOT(T, B)                                               \
  _tile_loadd(B, v + (jp * D + d0 + (T) * KT) * 2, D * 4); \
  _tile_dpbf16ps(T, 4, B)
#define AMX_STORE(T, B) _tile_stored(T, o + d0 + (T) * KT, D * 4)
  SPLITSERVE_AMX_EACH(NT, AMX_LOAD);
  for (int64_t jp = jp0; jp < jp1; jp += AR) {
    _tile_loadd(4, p + jp * 2, lp * 2);
    SPLITSERVE_AMX_EACH(NT, AMX_DOT);
  }
  SPLITSERVE_AMX_EACH(NT, AMX_STORE);
#undef AMX_LOAD
#undef AMX_DOT
#undef AMX_STORE
}

// pv_amx for two tiles of rows at once, D = 64: rows 0-15 (p, o) over key
// pairs jp[0] .. je[0], rows 16-31 (p + 16 lp, o + 16 D) over jp[1] .. je[1].
// Half of o's dims at a time in tiles 0-3 (two per tile of rows), both
// tiles' p in 4 and 5, the values' two tiles in 6 and 7, each used twice; a
// tile of o gets the products a lone tile's would, in the same order.
inline void pv_amx_pair64(const int64_t rows[2], const uint16_t* p, int64_t lp, const int64_t jp[2],
                          const int64_t je[2], const uint16_t* v, const float* rescale, float* o) {
  constexpr int64_t D = 64;
  for (int g = 0; g < 2; ++g)
    for (int64_t r = 0; r < rows[g]; ++r)
      if (rescale[g * AR + r] != 1.f)  // most blocks move no row's max: o as it is
        for (int64_t d = 0; d < D; ++d) o[(g * AR + r) * D + d] *= rescale[g * AR + r];
  splitserve_amx::rows_written();  // o's rescaled rows and p
  const uint16_t* p1 = p + AR * lp;
  float* o1 = o + AR * D;
  const int64_t from = std::min(jp[0], jp[1]), to = std::max(je[0], je[1]);
  for (int64_t d0 = 0; d0 < D; d0 += 2 * KT) {
    _tile_loadd(0, o + d0, D * 4);
    _tile_loadd(1, o + d0 + KT, D * 4);
    _tile_loadd(2, o1 + d0, D * 4);
    _tile_loadd(3, o1 + d0 + KT, D * 4);
    for (int64_t j = from; j < to; j += AR) {
      _tile_loadd(6, v + (j * D + d0) * 2, D * 4);
      _tile_loadd(7, v + (j * D + d0 + KT) * 2, D * 4);
      if (j >= jp[0] && j < je[0]) {
        _tile_loadd(4, p + j * 2, lp * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (j >= jp[1] && j < je[1]) {
        _tile_loadd(5, p1 + j * 2, lp * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, o + d0, D * 4);
    _tile_stored(1, o + d0 + KT, D * 4);
    _tile_stored(2, o1 + d0, D * 4);
    _tile_stored(3, o1 + d0 + KT, D * 4);
  }
}

// o[r][0 .. D) = o * rescale[r] + sum over key pairs jp0 .. jp1 (multiples of
// 16) of p[r][2j, 2j + 1] . v[2j, 2j + 1][d], for 16 rows (rows of them real).
inline void pv_amx(int64_t rows, const uint16_t* p, int64_t lp, int64_t jp0, int64_t jp1, const uint16_t* v,
                   int64_t D, const float* rescale, float* o) {
  for (int64_t r = 0; r < rows; ++r)
    if (rescale[r] != 1.f)
      for (int64_t d = 0; d < D; ++d) o[r * D + d] *= rescale[r];
  splitserve_amx::rows_written();  // o's rescaled rows and p
  by_four_tiles(0, D, [&](int64_t d0, auto nt) { pv_amx_tiles<decltype(nt)::value>(p, lp, jp0, jp1, v, D, d0, o); });
}
#else
constexpr int64_t AR = 1, BKA = BK;
#endif
#else
constexpr bool HAS_BF16 = false;
constexpr int64_t AR = 1, BKA = BK;
#endif

struct Scratch {
  std::vector<float> qs, o, s, m, l, rescale;
  std::vector<uint16_t> qs16, p16;
};

template <typename scalar_t, typename cache_t>
void prefill_kernel(const at::Tensor& q, const at::Tensor& kv, int64_t layer, const at::Tensor& block_tables,
                    const std::vector<int64_t>& query_lens, const std::vector<int64_t>& seq_lens, double scale,
                    int64_t window, const std::vector<int64_t>& bf16_rows, at::Tensor& out) {
  const int64_t Hq = q.size(1), D = q.size(2);
  const int64_t bs = kv.size(3), Hkv = kv.size(4), G = Hq / Hkv;
  const int64_t s_blk = kv.stride(0), s_lyr = kv.stride(1), s_kv = kv.stride(2), s_tok = kv.stride(3),
                s_head = kv.stride(4);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* base = kv.data_ptr<cache_t>() + layer * s_lyr;
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t bt_stride = block_tables.stride(0);
  scalar_t* op = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);
  const int64_t QB = std::max<int64_t>(1, ROWS / G);  // queries per task
  const int64_t B = static_cast<int64_t>(query_lens.size());

  // Each sequence's keys and values for each KV head, once, in float32: K as
  // tiles of 16 keys [D][16], V as rows [D], read from the first key any of
  // its queries sees (the earlier ones are packed as zeros).
  std::vector<int64_t> qstart(B + 1, 0), kstart(B + 1, 0), klo(B);
  for (int64_t b = 0; b < B; ++b) {
    qstart[b + 1] = qstart[b] + query_lens[b];
    const int64_t first = seq_lens[b] - query_lens[b];
    klo[b] = window > 0 ? std::max<int64_t>(0, first - window + 1) : 0;
    // Whole blocks of keys; the tiles past the last key's are never read.
    kstart[b + 1] = kstart[b] + (seq_lens[b] + BK - 1) / BK * BK * Hkv * D;
  }
  // Not zero-filled first: the packing below writes every tile up to the
  // sequence's last key whole, the keys out of sight as zeros.
  std::unique_ptr<float[]> kpack(new float[kstart[B]]), vpack(new float[kstart[B]]);
  // Sequence b's first bf16_rows[b] queries attend in bfloat16: their keys
  // and values packed again as pairs, at the same offsets.
  auto lead16 = [&](int64_t b) { return bf16_rows.empty() ? int64_t{0} : bf16_rows[b]; };
  bool any16 = false;
  for (int64_t b = 0; b < B; ++b) any16 = any16 || lead16(b) > 0;
  std::unique_ptr<uint16_t[]> kpack16(any16 ? new uint16_t[kstart[B]] : nullptr),
      vpack16(any16 ? new uint16_t[kstart[B]] : nullptr);
  // Sequence b's keys for KV head hk start here (in kpack, and in vpack).
  auto region = [&](int64_t b, int64_t hk) { return kstart[b] + hk * ((kstart[b + 1] - kstart[b]) / Hkv); };
  // bfloat16 rows on AMX tiles (above) where the CPU has them and D allows.
  bool amx = false;
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
  amx = any16 && D % 32 == 0 && splitserve_amx::tiles_allowed();
#endif
  // AMX reads values 32 keys at a time: the keys after the last tile, up to
  // the block's end, are packed as zeros too.
  for (int64_t b = 0; amx && b < B; ++b) {
    const int64_t written = (seq_lens[b] + KT - 1) / KT * KT * D, whole = (kstart[b + 1] - kstart[b]) / Hkv;
    for (int64_t hk = 0; hk < Hkv; ++hk)
      std::fill(vpack16.get() + region(b, hk) + written, vpack16.get() + region(b, hk) + whole, uint16_t{0});
  }
  std::vector<int64_t> tile_start(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) tile_start[b + 1] = tile_start[b] + Hkv * ((seq_lens[b] + KT - 1) / KT);
  parallel_claim(tile_start[B], 4, [&](int64_t begin, int64_t end) {
    std::vector<float> rowbuf(D);
    std::vector<uint16_t> rows16(2 * KT * D);  // the tile's keys, then its values, as bfloat16 [KT][D]
    int64_t b = 0;
    for (int64_t t = begin; t < end; ++t) {
      while (tile_start[b + 1] <= t) ++b;
      const int64_t tiles = (seq_lens[b] + KT - 1) / KT;
      const int64_t hk = (t - tile_start[b]) / tiles, tile = (t - tile_start[b]) % tiles;
      const int64_t at = region(b, hk) + tile * KT * D;
      const int32_t* table = bt + b * bt_stride;
      auto row = [&](int64_t pos) { return base + table[pos / bs] * s_blk + (pos % bs) * s_tok + hk * s_head; };
      auto seen = [&](int64_t pos) { return pos >= klo[b] && pos < seq_lens[b]; };
      if (lead16(b) < query_lens[b]) {  // float32 rows: K as tiles [D][16], V as rows [D]
        float* kt = kpack.get() + at;
        float* vr = vpack.get() + at;
        for (int64_t i = 0; i < KT; ++i) {
          const int64_t pos = tile * KT + i;
          if (!seen(pos)) {
            for (int64_t d = 0; d < D; ++d) kt[d * KT + i] = 0.f;
            std::fill(vr + i * D, vr + (i + 1) * D, 0.f);
            continue;
          }
          const cache_t* krow = row(pos);
          const float* kf = as_floats(krow, rowbuf.data(), D);
          for (int64_t d = 0; d < D; ++d) kt[d * KT + i] = kf[d];
          const float* vf_ = as_floats(krow + s_kv, vr + i * D, D);
          if (vf_ != vr + i * D) std::memcpy(vr + i * D, vf_, D * sizeof(float));
        }
      }
      if (lead16(b) > 0) {  // bfloat16 rows: K as tiles [D / 2][16][2], V as pairs of keys [D][2]
        uint16_t* kr = rows16.data();
        uint16_t* vr = kr + KT * D;
        for (int64_t i = 0; i < KT; ++i) {
          const int64_t pos = tile * KT + i;
          if (!seen(pos)) {
            std::fill(kr + i * D, kr + (i + 1) * D, uint16_t{0});
            std::fill(vr + i * D, vr + (i + 1) * D, uint16_t{0});
          } else {
            as_bf16(row(pos), rowbuf.data(), kr + i * D, D);
            as_bf16(row(pos) + s_kv, rowbuf.data(), vr + i * D, D);
          }
        }
        // A key's pair of dims is one 32-bit word: the tile is the [16][D / 2] words transposed.
        uint32_t* kt16 = reinterpret_cast<uint32_t*>(kpack16.get() + at);
        const uint32_t* kw = reinterpret_cast<const uint32_t*>(kr);
        for (int64_t dp = 0; dp < D / 2; ++dp)
          for (int64_t i = 0; i < KT; ++i) kt16[dp * KT + i] = kw[i * (D / 2) + dp];
        uint16_t* vp16 = vpack16.get() + at;
        for (int64_t i = 0; i < KT; i += 2)
          for (int64_t d = 0; d < D; ++d) {
            vp16[(i / 2 * D + d) * 2] = vr[i * D + d];
            vp16[(i / 2 * D + d) * 2 + 1] = vr[(i + 1) * D + d];
          }
      }
    }
  });

  std::vector<Task> tasks;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t first = seq_lens[b] - query_lens[b];
    // The bfloat16 rows and the others in tasks of their own.
    for (auto [from, to, bf] :
         {std::tuple{int64_t{0}, lead16(b), true}, std::tuple{lead16(b), query_lens[b], false}})
      for (int64_t q0 = from; q0 < to; q0 += QB) {
        const int64_t q1 = std::min(q0 + QB, to);
        const int64_t hi = first + q1, lo = window > 0 ? std::max<int64_t>(0, first + q0 - window + 1) : 0;
        for (int64_t h = 0; h < Hkv; ++h) tasks.push_back({b, h, q0, q1, (hi - lo) * (q1 - q0), bf});
      }
  }
  // The longest first: a thread that claims the last tasks finishes with the others.
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });

  parallel_claim(static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    // Whole AMX tiles of rows (AR, 1 without AMX): a padded row is computed, never read.
    const int64_t RT = QB * G, RA = (RT + AR - 1) / AR * AR;
    const int64_t bk_max = amx ? BKA : BK;
    // The thread's buffers, kept from call to call (a task's zeroed
    // allocations were 5% of a prompt's attention): every value a task reads
    // it has written first, but for a padded row's, which are earlier
    // tasks' finite values (or zeros) and reach only that row's sums.
    thread_local Scratch scratch;
    auto& [qs, o, s, m, l, rescale, qs16, p16] = scratch;
    for (auto [v, n] : {std::pair{&qs, RT * D}, {&o, RA * D}, {&s, RA * bk_max}, {&m, RT}, {&l, RT}, {&rescale, RA}})
      if (static_cast<int64_t>(v->size()) < n) v->resize(n);
    for (auto [v, n] : {std::pair{&qs16, any16 ? RA * D : 0}, {&p16, any16 ? RA * bk_max : 0}})
      if (static_cast<int64_t>(v->size()) < n) v->resize(n);
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (amx) amx_configure();
#endif
    std::vector<int64_t> lo(RT), hi(RT);
    vi lane;
    for (int u = 0; u < VW; ++u) lane[u] = u;
    for (int64_t ti = begin; ti < end; ++ti) {
      const Task& task = tasks[ti];
      const int64_t b = task.seq, hk = task.head;
      const int64_t first = seq_lens[b] - query_lens[b];
      const float* kp = kpack.get() + region(b, hk);
      const float* vp = vpack.get() + region(b, hk);
      const int64_t rows = (task.q1 - task.q0) * G;
      // Row rho = (query i, head g): scaled q, its visible keys [lo, hi).
      for (int64_t i = 0; i < task.q1 - task.q0; ++i) {
        const int64_t pos = first + task.q0 + i;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t rho = i * G + g;
          const scalar_t* src = qp + ((qstart[b] + task.q0 + i) * Hq + hk * G + g) * D;
          for (int64_t d = 0; d < D; ++d) qs[rho * D + d] = to_f(src[d]) * fscale;
          if (task.bf16)
            for (int64_t d = 0; d < D; ++d) qs16[rho * D + d] = round_bits(qs[rho * D + d]);
          lo[rho] = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
          hi[rho] = pos + 1;
          m[rho] = -std::numeric_limits<float>::max();
          l[rho] = 0.f;
        }
      }
      std::fill(o.begin(), o.begin() + rows * D, 0.f);
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
      splitserve_amx::rows_written();  // q's rows
#endif
      const int64_t khi = hi[rows - 1];  // rows run in position order
      // Keys in blocks of bk from multiples of bk (a row's blocks are its own
      // keys', whatever else its task holds): BKA on AMX tiles, BK elsewhere.
      const int64_t bk = amx && task.bf16 ? BKA : BK;
      for (int64_t k0 = lo[0] / bk * bk; k0 < khi; k0 += bk) {
        const int64_t k1 = std::min(k0 + bk, khi), n16 = (k1 - k0 + KT - 1) / KT * KT;
        const float* kt = kp + k0 * D;
        const float* vb = vp + k0 * D;
        // Rows that see none of this block's keys stay as they are (rescale 1, p 0).
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
        if (amx && task.bf16) {
          // Each tile of rows (or two, D = 64) through S, its softmax and P V
          // in turn, its scores and p read back while in L1.
          const uint16_t* kt16 = kpack16.get() + (kt - kpack.get());
          const uint16_t* vb16 = vpack16.get() + (vb - vpack.get());
          // The key pairs a tile of rows starting at r0 (r of them) multiplies:
          // 16 at a time, from its first row's first 16 (p is 0 out of a row's sight).
          auto pairs = [&](int64_t r0, int64_t r, int64_t& jp, int64_t& je) {
            const int64_t a = std::max(lo[r0], k0) - k0, e = std::min(hi[r0 + r - 1], k1) - k0;
            jp = a / 2 / AR * AR;
            je = std::min<int64_t>(bk / 2, ((e + 1) / 2 + AR - 1) / AR * AR);
          };
          auto sees = [&](int64_t r0, int64_t r) { return hi[r0 + r - 1] > k0 && lo[r0] < k1; };
          for (int64_t r0 = 0, step = AR; r0 < rows; r0 += step) {
            const int64_t r = std::min<int64_t>(AR, rows - r0), r2 = std::min<int64_t>(AR, rows - r0 - AR);
            const bool pair = D == 64 && r2 > 0 && sees(r0, r) && sees(r0 + AR, r2);
            step = pair ? 2 * AR : AR;
            if (!sees(r0, r)) continue;
            const int64_t j0 = (std::max(lo[r0], k0) - k0) / KT * KT;
            float* sg = s.data() + r0 * bk;
            uint16_t* pg = p16.data() + r0 * bk;
            if (pair)
              qk_amx_pair64(qs16.data() + r0 * D, kt16, j0, n16, sg, bk);
            else
              qk_amx(qs16.data() + r0 * D, D, kt16, j0, n16, sg, bk);
            for (int64_t t0 = 0; t0 < r + (pair ? r2 : 0); t0 += AR) {
              const int64_t nr = t0 == 0 ? r : r2;
              int64_t a[AR], e[AR];
              for (int64_t i = 0; i < nr; ++i) {
                const int64_t rho = r0 + t0 + i;
                a[i] = std::max(lo[rho], k0) - k0, e[i] = std::min(hi[rho], k1) - k0;
              }
              softmax_tile_bf16(sg + t0 * bk, nr, a, e, bk, m.data() + r0 + t0, l.data() + r0 + t0,
                                pg + t0 * bk, rescale.data() + r0 + t0);
            }
            if (pair) {
              const int64_t n[2] = {r, r2};
              int64_t jp[2], je[2];
              pairs(r0, r, jp[0], je[0]);
              pairs(r0 + AR, r2, jp[1], je[1]);
              pv_amx_pair64(n, pg, bk, jp, je, vb16, rescale.data() + r0, o.data() + r0 * D);
            } else {
              int64_t jp, je;
              pairs(r0, r, jp, je);
              pv_amx(r, pg, bk, jp, je, vb16, D, rescale.data() + r0, o.data() + r0 * D);
            }
          }
          continue;
        }
#endif
        if (task.bf16) {
#if defined(__AVX512BF16__)
          const uint16_t* kt16 = kpack16.get() + (kt - kpack.get());
          for (int64_t r0 = 0; r0 < rows; r0 += BR) {
            const int64_t r = std::min<int64_t>(BR, rows - r0);
            if (hi[r0 + r - 1] <= k0 || lo[r0] >= k1) continue;
            const int64_t j0 = (std::max(lo[r0], k0) - k0) / KT * KT;
            qk_bf<BR, 4>(r, (n16 - j0) / KT, qs16.data() + r0 * D, D, kt16 + j0 * D, s.data() + r0 * BK + j0, BK);
          }
#endif
        } else {
          for (int64_t r0 = 0; r0 < rows; r0 += MR) {
            const int64_t r = std::min<int64_t>(MR, rows - r0);
            if (hi[r0 + r - 1] <= k0 || lo[r0] >= k1) continue;
            const int64_t j0 = (std::max(lo[r0], k0) - k0) / KT * KT;
            for (int64_t j = j0; j < n16; j += KT)
              qk_rows<MR>(r, qs.data() + r0 * D, D, kt + j * D, s.data() + r0 * BK + j, BK);
          }
        }
        for (int64_t rho = 0; rho < rows; ++rho) {
          const int64_t a = std::max(lo[rho], k0) - k0, e = std::min(hi[rho], k1) - k0;
          if (a >= e) {
            rescale[rho] = 1.f;
            std::fill(s.data() + rho * bk, s.data() + (rho + 1) * bk, 0.f);
            if (task.bf16) std::fill(p16.data() + rho * bk, p16.data() + (rho + 1) * bk, uint16_t{0});
            continue;
          }
          rescale[rho] = softmax_block(s.data() + rho * bk, a, e, bk, m[rho], l[rho], lane);
        }
        if (task.bf16) {
#if defined(__AVX512BF16__)
          // p in bfloat16 pairs; keys out of a row's sight have p = 0 (a pair
          // half out of sight adds 0 times a packed value, zeros past the end).
          round_bf16(s.data(), p16.data(), rows * bk);
          const uint16_t* vb16 = vpack16.get() + (vb - vpack.get());
          for (int64_t r0 = 0; r0 < rows; r0 += BR) {
            const int64_t r = std::min<int64_t>(BR, rows - r0);
            const int64_t a = std::max(lo[r0], k0) - k0, e = std::min(hi[r0 + r - 1], k1) - k0;
            if (a >= e) continue;
            for (int64_t d0 = 0; d0 < D; d0 += 4 * KT)
              pv_bf<BR, 4>(r, (D - d0) / KT, p16.data() + r0 * BK, BK, a / 2, (e + 1) / 2, vb16, D, d0,
                           rescale.data() + r0, o.data() + r0 * D);
          }
#endif
        } else {
          for (int64_t r0 = 0; r0 < rows; r0 += MR) {
            const int64_t r = std::min<int64_t>(MR, rows - r0);
            const int64_t a = std::max(lo[r0], k0) - k0, e = std::min(hi[r0 + r - 1], k1) - k0;
            if (a >= e) continue;
            for (int64_t d0 = 0; d0 < D; d0 += KT)
              pv_rows<MR>(r, s.data() + r0 * BK, BK, a, e, vb, D, d0, rescale.data() + r0, o.data() + r0 * D);
          }
        }
      }
      for (int64_t i = 0; i < task.q1 - task.q0; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t rho = i * G + g;
          const float inv = 1.f / l[rho];
          scalar_t* dst = op + ((qstart[b] + task.q0 + i) * Hq + hk * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(o[rho * D + d] * inv);
        }
    }
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    if (amx) _tile_release();
#endif
  });
}

}  // namespace prefill

}  // namespace

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor kv_cache, int64_t layer,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                  int64_t window, bool bf16_dots) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 6, "paged_decode_attention: bad ranks");
  TORCH_CHECK(kv_cache.stride(5) == 1, "kv_cache: last dim must be contiguous");
  const auto cache_type = kv_cache.scalar_type();
  const bool fp8 = cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2;
  TORCH_CHECK(fp8 || cache_type == at::kBFloat16 || cache_type == at::kHalf || q.scalar_type() == cache_type,
              "q and kv_cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(q.size(1) % kv_cache.size(4) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(window >= 0, "window: must be >= 0 (0: no sliding window)");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    if (cache_type == at::kFloat8_e4m3fn)
      decode_heads<scalar_t, c10::Float8_e4m3fn>(q, kv_cache, layer, block_tables, seq_lens, scale, window, bf16_dots, out);
    else if (cache_type == at::kFloat8_e5m2)
      decode_heads<scalar_t, c10::Float8_e5m2>(q, kv_cache, layer, block_tables, seq_lens, scale, window, bf16_dots, out);
    else if (cache_type == at::kBFloat16)
      decode_heads<scalar_t, c10::BFloat16>(q, kv_cache, layer, block_tables, seq_lens, scale, window, bf16_dots, out);
    else if (cache_type == at::kHalf)
      decode_heads<scalar_t, c10::Half>(q, kv_cache, layer, block_tables, seq_lens, scale, window, bf16_dots, out);
    else
      decode_heads<scalar_t, scalar_t>(q, kv_cache, layer, block_tables, seq_lens, scale, window, bf16_dots, out);
  });
  return out;
}


// q: [sum of query_lens, Hq, D], the sequences' queries one after another;
// block_tables: [B, max_blocks] int32; query_lens, seq_lens: [B].  D: a multiple of 16.
at::Tensor paged_prefill_attention(at::Tensor q, at::Tensor kv_cache, int64_t layer, at::Tensor block_tables,
                                   std::vector<int64_t> query_lens, std::vector<int64_t> seq_lens, double scale,
                                   int64_t window, std::vector<int64_t> bf16_rows) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 6, "paged_prefill_attention: bad ranks");
  TORCH_CHECK(kv_cache.stride(5) == 1, "kv_cache: last dim must be contiguous");
  TORCH_CHECK(q.size(2) % prefill::KT == 0 && q.size(2) == kv_cache.size(5),
              "paged_prefill_attention: the head size must be a multiple of 16 and match the cache");
  const auto cache_type = kv_cache.scalar_type();
  const bool fp8 = cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2;
  TORCH_CHECK(fp8 || cache_type == at::kBFloat16 || cache_type == at::kHalf || q.scalar_type() == cache_type,
              "q and kv_cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2, "block_tables must be int32 [B, n]");
  TORCH_CHECK(q.size(1) % kv_cache.size(4) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(window >= 0, "window: must be >= 0 (0: no sliding window)");
  const int64_t B = static_cast<int64_t>(query_lens.size());
  TORCH_CHECK(static_cast<int64_t>(seq_lens.size()) == B && block_tables.size(0) >= B,
              "query_lens, seq_lens and block_tables must have one entry per sequence");
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(query_lens[b] > 0 && seq_lens[b] >= query_lens[b], "seq_lens: each at least its query_lens, > 0");
    TORCH_CHECK((seq_lens[b] + kv_cache.size(3) - 1) / kv_cache.size(3) <= block_tables.size(1),
                "block_tables: too few blocks for seq_lens");
    total += query_lens[b];
  }
  TORCH_CHECK(q.size(0) == total, "q: one row per query token (the sum of query_lens)");
  TORCH_CHECK(bf16_rows.empty() || static_cast<int64_t>(bf16_rows.size()) == B,
              "bf16_rows: one entry per sequence, or none");
  for (int64_t b = 0; b < static_cast<int64_t>(bf16_rows.size()); ++b) {
    TORCH_CHECK(bf16_rows[b] >= 0 && bf16_rows[b] <= query_lens[b], "bf16_rows: each 0 .. its query_lens");
    TORCH_CHECK(bf16_rows[b] == 0 || (prefill::HAS_BF16 && q.scalar_type() == at::kFloat),
                "bf16_rows: bfloat16 attention needs float32 queries and a build with AVX512-BF16");
  }
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < (seq_lens[b] + kv_cache.size(3) - 1) / kv_cache.size(3); ++i)
      TORCH_CHECK(bt[b * block_tables.size(1) + i] >= 0 && bt[b * block_tables.size(1) + i] < kv_cache.size(0),
                  "block_tables: a block id out of range");
  auto out = at::empty_like(q);
  if (total == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill_attention", [&] {
    if (cache_type == at::kFloat8_e4m3fn)
      prefill::prefill_kernel<scalar_t, c10::Float8_e4m3fn>(q, kv_cache, layer, block_tables, query_lens, seq_lens,
                                                            scale, window, bf16_rows, out);
    else if (cache_type == at::kFloat8_e5m2)
      prefill::prefill_kernel<scalar_t, c10::Float8_e5m2>(q, kv_cache, layer, block_tables, query_lens, seq_lens,
                                                          scale, window, bf16_rows, out);
    else if (cache_type == at::kBFloat16)
      prefill::prefill_kernel<scalar_t, c10::BFloat16>(q, kv_cache, layer, block_tables, query_lens, seq_lens, scale,
                                                       window, bf16_rows, out);
    else if (cache_type == at::kHalf)
      prefill::prefill_kernel<scalar_t, c10::Half>(q, kv_cache, layer, block_tables, query_lens, seq_lens, scale,
                                                   window, bf16_rows, out);
    else
      prefill::prefill_kernel<scalar_t, scalar_t>(q, kv_cache, layer, block_tables, query_lens, seq_lens, scale,
                                                  window, bf16_rows, out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Without the GIL, as the linear kernels: the worker's event loop runs meanwhile.
  m.def("use_pool", [](bool on) { claim_pool::enabled() = on; },
        "run the kernels on their own thread pool (only where OpenMP's idle threads sleep)");
  m.def("paged_decode_attention", &paged_decode_attention, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "paged decode attention (CPU)",
        py::arg("q"), py::arg("kv_cache"), py::arg("layer"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("window") = 0, py::arg("bf16_dots") = false);
  m.def("paged_prefill_attention", &paged_prefill_attention, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "causal attention of prefill queries over the paged cache (CPU)",
        py::arg("q"), py::arg("kv_cache"), py::arg("layer"), py::arg("block_tables"), py::arg("query_lens"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("window") = 0,
        py::arg("bf16_rows") = std::vector<int64_t>{});
  // For the linear module's DecodeStack, which calls the decode kernel from C++ (no GIL, no Python).
  m.def("decode_attention_capsule", [] {
    return py::capsule(reinterpret_cast<void*>(&paged_decode_attention), "splitserve.paged_decode_attention");
  }, "paged_decode_attention as a C function pointer");
  // Whether bf16_rows can be given: this build has AVX512-BF16.
  m.def("prefill_bf16_supported", [] { return prefill::HAS_BF16; });
  // Whether bf16_dots changes a decode's arithmetic here (this build, fp8 e4m3 and bfloat16 caches).
  m.def("decode_bf16_supported", [] {
#if defined(SPLITSERVE_BF16_DOTS)
    return true;
#else
    return false;
#endif
  });
  m.def("prefill_amx", [] {
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
    return splitserve_amx::tiles_allowed();
#else
    return false;
#endif
  }, "whether bfloat16 prompt rows attend on AMX tiles here (head sizes a multiple of 32)");
}
