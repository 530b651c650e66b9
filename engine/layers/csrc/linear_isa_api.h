// The linear kernels' per-instruction-set entry points.  Each is compiled in
// its own translation unit (linear_isa_<name>.cpp, with its instruction set
// enabled by a pragma) and picked at run time from the CPU's flags, so one
// build runs on every x86-64 machine.  Every set computes bit for bit the same
// result: each output is sum_k fma(x[k], w[k]) in k order, and quantized
// 8-bit weights are rebuilt exactly as their float32 copies were.
#pragma once

#include <cstdint>
#include <cstring>

namespace splitserve_linear {

constexpr int64_t NR = 16;  // output columns per panel
constexpr int64_t QB = 32;  // inputs per quantized block
// q4 block: d[16], m[16] float32, then 4 chunks of 64 bytes, chunk c for
// inputs 8c..8c+7: byte 4j + i holds q(8c + i, j) in its low nibble and
// q(8c + 4 + i, j) in its high one (i < 4, column j < 16).  So a chunk's low
// nibbles are 4 inputs of each column as the integer kernels' vpdpbusd reads
// them (column j's bytes in 32-bit lane j), its high ones the next 4, and
// input 8c + kk of every column is its 32-bit lanes shifted by q4_shift(kk).
// w = d * q + m, computed factored: each block adds d * sum(x q) + m * sum(x)
// (not bit-equal to the f32 panels).
constexpr int64_t Q4_BLOCK_BYTES = 2 * NR * 4 + QB * NR / 2;  // 384
// static: each translation unit keeps its own copy, built for its instruction set.
static inline int q4_shift(int kk) { return kk < 4 ? 8 * kk : 8 * (kk - 4) + 4; }
// q of input kk (0..7) and column j of a chunk.
static inline int q4_value(const uint8_t* chunk, int kk, int j) {
  return (chunk[4 * j + kk % 4] >> (kk < 4 ? 0 : 4)) & 0x0F;
}
// q8 block: d[16] float32, then 32 rows of 16 int8.  w = d * q (exact: d is
// a float16 value, q 8 bits, so the product fits float32's 24 bits).
constexpr int64_t Q8_BLOCK_BYTES = NR * 4 + QB * NR;  // 576

// y[i, col0 + j] = (x[i, :] @ panels)[j] (+ bias[col0 + j]) for i < rows,
// j < cols (at most np * 16); x rows ldx apart, y rows ldy apart.  `panels`
// is np consecutive panels, pbytes apart, in the format's layout, K inputs.
// xs: q4 only, each row's sums of x per block of 32 inputs, rows ldxs apart.
using RowsTimesPanels = void (*)(const void* panels, int64_t pbytes, int64_t np, int64_t K, const float* x,
                                 int64_t ldx, const float* xs, int64_t ldxs, int64_t rows, const float* bias,
                                 int64_t col0, int64_t cols, float* y, int64_t ldy);

// out[t, :] = silu(gate_up[t, :I]) * gate_up[t, I:] for t < rows, as many
// lanes at a time as the set has; every set gives the same bits (each lane's
// arithmetic is IEEE's, unfused, whatever the width).
using SiluRows = void (*)(const float* gate_up, int64_t I, int64_t rows, float* out);

// decode_dtype=int8: y[i, col0 + j] = sum over blocks b of
//   fma(sx[i, b], m[b, j], fma(d[b, j] * dx[i, b], isum[i, b, j], acc))
// in block order, isum the exact int32 sum over the block of q[k, j] * xq[i, k]:
// 4-bit blocks (as q4) times rows of x quantized to int8 per block of 32
// inputs (xq [rows, K] int8 rows ldx apart; dx, the block's scale, and sx, its
// float32 sum, [rows, K/32] rows ldxs apart).  Integer sums are exact, so
// every instruction set gives the same bits.
using Q4I8Rows = void (*)(const void* panels, int64_t pbytes, int64_t np, int64_t K, const int8_t* xq, int64_t ldx,
                          const float* dx, const float* sx, int64_t ldxs, int64_t rows, const float* bias,
                          int64_t col0, int64_t cols, float* y, int64_t ldy);

// The same for 8-bit blocks (as q8): y[i, col0 + j] = sum over blocks b of
// fma(d[b, j] * dx[i, b], isum[i, b, j], acc), in block order; xc[i, b] is the
// block's sum of xq (the VNNI kernel's unsigned weights need it).
using Q8I8Rows = void (*)(const void* panels, int64_t pbytes, int64_t np, int64_t K, const int8_t* xq, int64_t ldx,
                          const float* dx, const int32_t* xc, int64_t ldxs, int64_t rows, const float* bias,
                          int64_t col0, int64_t cols, float* y, int64_t ldy);

// decode_dtype=int8's inputs: for each of `blocks` blocks of 32 floats of x,
// dx = max |x| / 127, xq = x * (127 / max |x|) rounded to nearest even (a
// block of zeros: scale 0, all 0), sx = the block's sum (pairs 16 apart, then
// 8, 4, 2, 1: one order on every set); dx is NaN where the block holds a NaN
// or an infinity, so that it reaches the output.  IEEE operations lane by
// lane, so every set gives the same bits.
using QuantizeI8 = void (*)(const float* x, int64_t blocks, int8_t* xq, float* dx, float* sx);

struct IsaKernels {
  const char* name;
  RowsTimesPanels f32, q4, q8;
  SiluRows silu_mul;
  Q4I8Rows q4i8;  // portable C++ built for the set (the vector units only where the compiler finds them)
  Q8I8Rows q8i8;
  QuantizeI8 quantize_i8;
};

extern const IsaKernels kScalarKernels;
extern const IsaKernels kAvx2Kernels;
extern const IsaKernels kAvx512Kernels;
// bfloat16 panels [P, K/2, 16, 2] times rows of bfloat16 pairs (x as uint32
// pairs in tiles of BF_TILE_ROWS rows, pair-major: see linear_isa.h), float32
// sums: AVX512-BF16 only (bf16_supported()).
constexpr int64_t BF_TILE_ROWS = 12;
extern const RowsTimesPanels kBf16Rows;
// The same panels on AMX tiles (amx_bf16 and amx_tile; K a multiple of 32),
// x as plain bfloat16 rows, ldx pairs a row, zero rows after the last up to a
// multiple of AMX_ROWS.  Its float32 sums are not kBf16Rows's bits.
constexpr int64_t AMX_ROWS = 16;
// A task of many rows (M_CHUNK or more) on AMX where K is at most
// AMX_HELD_K takes AMX_PANELS panels (linear_cpu.cpp's G), and each pair of
// row tiles goes through K in passes of about AMX_PASS_BLOCKS blocks of 32
// inputs: the pair's share of x for a pass (18 KB) stays in L1 while every
// panel's share streams past, the sums stored between passes.  A tile load
// costs about as much as a product here, and one from L2 more (see
// benchmarks/README.md, session 45).  Rows go AMX_PASS_TILES tiles at a time.
constexpr int64_t AMX_PANELS = 8;
constexpr int64_t AMX_HELD_K = 1024;
constexpr int64_t AMX_PASS_BLOCKS = 9;
constexpr int64_t AMX_PASS_TILES = 12;
extern const RowsTimesPanels kAmxBf16Rows;
// kAmxBf16Rows's bits from the 4-bit blocks (q4's layout, pbytes a panel) the
// panels were rounded from, each block made into its tile as it is needed:
// AMX with AVX512-VBMI (amx_q4_cpu()).
extern const RowsTimesPanels kAmxQ4Rows;
// The same from 8-bit blocks (q8's layout: the head).
extern const RowsTimesPanels kAmxQ8Rows;
// Its x: float32 rows [rows, K] rounded to plain bfloat16 rows (K / 2 pairs a row).
using PlainRows = void (*)(const float* x, int64_t rows, int64_t K, uint32_t* out);
extern const PlainRows kAmxPlainRows;
// kAmxBf16Rows (Q4, Q8: kAmxQ4Rows, kAmxQ8Rows) for a gate and up projection in one weight
// (gate's panels first, up's up_bytes after them), with silu(gate) * up
// (silu_mul's lanes) taken of each tile of sums in cache: y's column col0 + j
// for j < cols, of panels 0 .. np, is gate's output j times up's, rounded to
// bfloat16 (round_bits: the down projection's input as kAmxPlainRows would
// make it), y a uint16_t rows ldy apart.  The float32 gate and up outputs are
// never written out (prompt rows wrote and read back 2 x 4 bytes an output
// through memory), nor the gated float32 rows; the same bits as kAmxBf16Rows,
// silu_mul and the rounding.
using SiluPanelRows = void (*)(const void* panels, int64_t pbytes, int64_t up_bytes, int64_t np, int64_t K,
                               const float* x, int64_t ldx, int64_t rows, int64_t col0, int64_t cols, void* y,
                               int64_t ldy);
extern const SiluPanelRows kAmxBf16SiluRows;
extern const SiluPanelRows kAmxQ4SiluRows;
extern const SiluPanelRows kAmxQ8SiluRows;
// The same on kBf16Rows's panels and x (vdpbf16ps), y float32 (not rounded):
// kBf16Rows then silu_mul's bits.
extern const SiluPanelRows kBf16SiluRows;
// Each row's argmax over a call's outputs, as torch.argmax finds it in y:
// the largest value, the first column among equal ones (-0 equal to 0), a NaN
// above every number (the first NaN).  argmax_key ranks an output so that
// the argmax is the largest key: the value's order in the high word (a NaN
// at the top), the column reversed in the low one.  Keys compare the same
// whichever thread or tile saw an output first, so the result does not depend
// on how a call's panels are dealt out.
inline uint64_t argmax_key(float v, int64_t col) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  if ((b & 0x7fffffffu) > 0x7f800000u) b = 0xffffffffu;  // NaN
  else if (b == 0x80000000u) b = 0x80000000u;  // -0 ranks as 0
  else b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  return (uint64_t{b} << 32) | (0xffffffffu - static_cast<uint32_t>(col));
}
// The column a key names.
inline int64_t argmax_col(uint64_t key) { return 0xffffffffu - static_cast<uint32_t>(key & 0xffffffffu); }
// kBf16Rows's (kBf16Q4Rows's, kBf16Q8Rows's) sums without y: each row i's
// best[i] raised to the largest argmax_key of its outputs col0 .. col0 + cols.
using ArgmaxPanelRows = void (*)(const void* panels, int64_t pbytes, int64_t np, int64_t K, const float* x,
                                 int64_t ldx, int64_t rows, int64_t col0, int64_t cols, uint64_t* best);
extern const ArgmaxPanelRows kBf16ArgmaxRows;
extern const ArgmaxPanelRows kBf16Q4ArgmaxRows;
extern const ArgmaxPanelRows kBf16Q8ArgmaxRows;
// kBf16Rows's bits (kBf16SiluRows's) from the 4- or 8-bit blocks (q4's or
// q8's layout, pbytes a panel) the panels were rounded from, each block's
// pairs made as they are needed: AVX512-BF16 with AVX512-VBMI
// (q4bf16_supported()), for few rows where AMX does not run.
extern const RowsTimesPanels kBf16Q4Rows;
extern const RowsTimesPanels kBf16Q8Rows;
extern const SiluPanelRows kBf16Q4SiluRows;
extern const SiluPanelRows kBf16Q8SiluRows;
// The int8 kernel with AVX512-VNNI dot products and AVX512-VBMI nibble
// shuffles (Ice Lake, Sapphire Rapids, Zen 4/5), the same bits as q4i8.
// decode_dtype=bfloat16: 4-bit blocks (as q4) times rows of x rounded to
// bfloat16, x as uint32 pairs (x[2 kp] low, x[2 kp + 1] high) rows ldx pairs
// apart, sx each row's float32 sums of the rounded x per block of 32 inputs
// (rows ldxs apart).  Each block adds d * sum(x q) + m * sum(x) with the sum
// over x q of exact products in float32, pairs in k order; AVX512-BF16 with
// AVX512-VBMI only (q4bf16_supported()).
using Q4Bf16Rows = void (*)(const void* panels, int64_t pbytes, int64_t np, int64_t K, const uint32_t* x,
                            int64_t ldx, const float* sx, int64_t ldxs, int64_t rows, const float* bias, int64_t col0,
                            int64_t cols, float* y, int64_t ldy);
extern const Q4Bf16Rows kQ4Bf16;
// The same for 8-bit blocks (as q8; the head): each block adds d * sum(x q),
// the q values exact in bfloat16; sx unused.
extern const Q4Bf16Rows kQ8Bf16;
extern const Q4I8Rows kQ4I8Vnni;
extern const Q8I8Rows kQ8I8Vnni;

}  // namespace splitserve_linear
