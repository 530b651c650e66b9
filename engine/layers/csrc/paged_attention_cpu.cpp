// Paged decode attention for CPUs: one query token per sequence, keys and
// values read straight from the block-contiguous KV cache (no gather copy, no
// padding).
//
//   q:            [B, Hq, D]
//   kv_cache:     [num_blocks, num_layers, 2, block_size, Hkv, D], q's dtype or
//                 fp8 (e4m3fn, e5m2: dequantized as rows are loaded; the
//                 cache's scale is 1, see engine/layers/kv_quant.py)
//   block_tables: [B, max_blocks] int32
//   seq_lens:     [B] int32
//   window:       > 0: a sequence of length L attends to its last `window`
//                 positions only, L - window .. L - 1 (sliding window); 0: all
//   returns       [B, Hq, D]
//
// A task is one sequence's span of up to PART_TOKENS positions, all heads at
// once: a cache block's keys (and then its values) for one layer are one
// contiguous run of memory, read once, front to back.  Each task keeps an
// online softmax (running max m, running sum l, unnormalised output) per query
// head in one pass over its blocks; a sequence longer than one span merges its
// spans' partial results.  Spans are cut at fixed positions, so the order of
// every sum depends on the sequence alone, never on the batch it runs in.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "parallel_claim.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

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

// fp8 rows: each of the 256 byte values decoded once into a table, then one
// load per element.
template <typename fp8_t>
const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(fp8_t(static_cast<uint8_t>(i), fp8_t::from_bits()));
    return t;
  }();
  return table.data();
}

template <typename fp8_t>
inline const float* fp8_as_floats(const fp8_t* row, float* buf, int64_t D) {
  const float* table = fp8_table<fp8_t>();
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row);
  for (int64_t d = 0; d < D; ++d) buf[d] = table[bytes[d]];
  return buf;
}

template <>
inline const float* as_floats(const c10::Float8_e4m3fn* row, float* buf, int64_t D) {
  return fp8_as_floats(row, buf, D);
}

template <>
inline const float* as_floats(const c10::Float8_e5m2* row, float* buf, int64_t D) {
  return fp8_as_floats(row, buf, D);
}

// Partial result of one span: per query head, m, l and the unnormalised sum.
struct Partial {
  float* m;    // [Hq]
  float* l;    // [Hq]
  float* acc;  // [Hq, D]
};

// D_ > 0: head size known at compile time (unrolled, vectorised); 0: any.
template <typename scalar_t, int D_>
void span(const scalar_t* __restrict__ base, const int32_t* __restrict__ table,
          int64_t t0, int64_t t1, const float* __restrict__ qf, int64_t Hq, int64_t Hkv,
          int64_t D_dyn, int64_t bs, int64_t s_blk, int64_t s_kv, int64_t s_tok, int64_t s_head,
          Partial out, float* __restrict__ scores /* [Hq, bs] */, float* __restrict__ kv_f /* [bs, Hkv, D] */) {
  const int64_t D = D_ > 0 ? D_ : D_dyn;
  const int64_t G = Hq / Hkv;
  for (int64_t h = 0; h < Hq; ++h) { out.m[h] = -std::numeric_limits<float>::infinity(); out.l[h] = 0.f; }
  std::fill(out.acc, out.acc + Hq * D, 0.f);
  for (int64_t t = t0; t < t1;) {
    const int64_t blk = table[t / bs];
    const int64_t off = t % bs;
    const int64_t n = std::min(bs - off, t1 - t);  // positions of this block in the span
    const scalar_t* kb = base + blk * s_blk + off * s_tok;
    // The next block lies elsewhere in memory, where the hardware prefetchers
    // cannot guess: while this block computes, ask for the next one row by row.
    const char* next = t + n < t1 ? reinterpret_cast<const char*>(base + table[(t + n) / bs] * s_blk)
                                  : nullptr;
    const int64_t row_bytes = s_tok * static_cast<int64_t>(sizeof(scalar_t));
    // Scores for every query head and position of the block.
    for (int64_t i = 0; i < n; ++i) {
      if (next != nullptr)
        for (int64_t c = 0; c < row_bytes; c += 64) __builtin_prefetch(next + i * row_bytes + c);
      for (int64_t hk = 0; hk < Hkv; ++hk) {
        const float* kr = as_floats(kb + i * s_tok + hk * s_head, kv_f + (i * Hkv + hk) * D, D);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = hk * G + g;
          const float* __restrict__ qh = qf + h * D;
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qh[d] * kr[d];
          scores[h * bs + i] = s;
        }
      }
    }
    // Online softmax: fold the block into each head's running max and sum.
    for (int64_t h = 0; h < Hq; ++h) {
      float* sh = scores + h * bs;
      float bmax = sh[0];
      for (int64_t i = 1; i < n; ++i) bmax = std::max(bmax, sh[i]);
      const float m_new = std::max(out.m[h], bmax);
      const float rescale = std::exp(out.m[h] - m_new);  // 0 on the first block
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i) { sh[i] = std::exp(sh[i] - m_new); sum += sh[i]; }
      out.l[h] = out.l[h] * rescale + sum;
      out.m[h] = m_new;
      if (rescale != 1.f) {
        float* a = out.acc + h * D;
        for (int64_t d = 0; d < D; ++d) a[d] *= rescale;
      }
    }
    // Values: acc_h += p_h,i v_i.
    const scalar_t* vb = kb + s_kv;
    for (int64_t i = 0; i < n; ++i) {
      if (next != nullptr)
        for (int64_t c = 0; c < row_bytes; c += 64)
          __builtin_prefetch(next + s_kv * static_cast<int64_t>(sizeof(scalar_t)) + i * row_bytes + c);
      for (int64_t hk = 0; hk < Hkv; ++hk) {
        const float* vr = as_floats(vb + i * s_tok + hk * s_head, kv_f + (i * Hkv + hk) * D, D);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = hk * G + g;
          const float p = scores[h * bs + i];
          float* __restrict__ a = out.acc + h * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
        }
      }
    }
    t += n;
  }
}

// scalar_t: the query's and output's dtype; cache_t: the cache's (the same, or fp8).
template <typename scalar_t, typename cache_t, int D_>
void decode_kernel(const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   double scale, int64_t window, at::Tensor& out) {
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
  std::vector<float> part_m(T * Hq), part_l(T * Hq), part_acc(T * Hq * D);
  std::vector<int64_t> task_seq(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = first[b]; i < first[b + 1]; ++i) task_seq[i] = b;

  parallel_claim(T, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Hq * D), scores(Hq * bs), kv_f(bs * Hkv * D);
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
      span<cache_t, D_>(base, bt + b * bt_stride, t0, t1, qf.data(), Hq, Hkv, D, bs, s_blk, s_kv,
                         s_tok, s_head, p, scores.data(), kv_f.data());
    }
  });

  // Merge each sequence's spans (in span order) and normalise.
  parallel_claim(B, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t h = 0; h < Hq; ++h) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = first[b]; i < first[b + 1]; ++i) m = std::max(m, part_m[i * Hq + h]);
        float l = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t i = first[b]; i < first[b + 1]; ++i) {
          const float w = std::exp(part_m[i * Hq + h] - m);
          l += part_l[i * Hq + h] * w;
          const float* a = &part_acc[(i * Hq + h) * D];
          for (int64_t d = 0; d < D; ++d) acc[d] += a[d] * w;
        }
        const float inv = 1.f / l;
        for (int64_t d = 0; d < D; ++d) op[(b * Hq + h) * D + d] = static_cast<scalar_t>(acc[d] * inv);
      }
    }
  });
}

// The head size as a compile-time constant where it is a common one.
template <typename scalar_t, typename cache_t>
void decode_heads(const at::Tensor& q, const at::Tensor& kv, int64_t layer, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, double scale, int64_t window, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: decode_kernel<scalar_t, cache_t, 64>(q, kv, layer, block_tables, seq_lens, scale, window, out); break;
    case 128: decode_kernel<scalar_t, cache_t, 128>(q, kv, layer, block_tables, seq_lens, scale, window, out); break;
    default: decode_kernel<scalar_t, cache_t, 0>(q, kv, layer, block_tables, seq_lens, scale, window, out);
  }
}

}  // namespace

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor kv_cache, int64_t layer,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                  int64_t window) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 6, "paged_decode_attention: bad ranks");
  TORCH_CHECK(kv_cache.stride(5) == 1, "kv_cache: last dim must be contiguous");
  const auto cache_type = kv_cache.scalar_type();
  const bool fp8 = cache_type == at::kFloat8_e4m3fn || cache_type == at::kFloat8_e5m2;
  TORCH_CHECK(fp8 || q.scalar_type() == cache_type, "q and kv_cache dtypes differ");
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
      decode_heads<scalar_t, c10::Float8_e4m3fn>(q, kv_cache, layer, block_tables, seq_lens, scale, window, out);
    else if (cache_type == at::kFloat8_e5m2)
      decode_heads<scalar_t, c10::Float8_e5m2>(q, kv_cache, layer, block_tables, seq_lens, scale, window, out);
    else
      decode_heads<scalar_t, scalar_t>(q, kv_cache, layer, block_tables, seq_lens, scale, window, out);
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
        py::arg("scale"), py::arg("window") = 0);
}
