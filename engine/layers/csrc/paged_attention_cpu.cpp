// Paged decode attention for CPUs: one query token per sequence, keys and
// values read straight from the block-contiguous KV cache (no gather copy, no
// padding).  One task per (sequence, kv head) serves that head's whole GQA group.
//
//   q:            [B, Hq, D]
//   kv_cache:     [num_blocks, num_layers, 2, block_size, Hkv, D]
//   block_tables: [B, max_blocks] int32
//   seq_lens:     [B] int32
//   returns       [B, Hq, D]
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

template <typename T>
static inline float to_f(T x) { return static_cast<float>(x); }

// D_ > 0: head size known at compile time (fully unrolled, vectorized dot
// products); D_ == 0: any head size.
template <typename scalar_t, int D_>
static void decode_kernel(const at::Tensor& q, const at::Tensor& kv, int64_t layer,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          double scale, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1);
  const int64_t D = D_ > 0 ? D_ : q.size(2);
  const int64_t bs = kv.size(3), Hkv = kv.size(4);
  const int64_t G = Hq / Hkv;
  const int64_t s_blk = kv.stride(0), s_lyr = kv.stride(1), s_kv = kv.stride(2),
                s_tok = kv.stride(3), s_head = kv.stride(4);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* base = kv.data_ptr<scalar_t>() + layer * s_lyr;
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t bt_stride = block_tables.stride(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t L = lens[b];
      scores.assign(G * L, 0.f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_f(qp[(b * Hq + h * G + g) * D + d]) * fscale;
      // Pass 1: scores[g, t] = q_g . k_t
      for (int64_t t = 0; t < L; ++t) {
        const int64_t blk = bt[b * bt_stride + t / bs];
        const scalar_t* __restrict__ k = base + blk * s_blk + (t % bs) * s_tok + h * s_head;
        float kf[D_ > 0 ? D_ : 1];
        const float* kr;
        std::vector<float> kdyn;
        if constexpr (D_ > 0) {
          for (int64_t d = 0; d < D_; ++d) kf[d] = to_f(k[d]);
          kr = kf;
        } else {
          kdyn.resize(D);
          for (int64_t d = 0; d < D; ++d) kdyn[d] = to_f(k[d]);
          kr = kdyn.data();
        }
        for (int64_t g = 0; g < G; ++g) {
          const float* __restrict__ qg = &qf[g * D];
          float s = 0.f;
          for (int64_t d = 0; d < D; ++d) s += qg[d] * kr[d];
          scores[g * L + t] = s;
        }
      }
      // Softmax per query head.
      for (int64_t g = 0; g < G; ++g) {
        float* sg = &scores[g * L];
        const float m = *std::max_element(sg, sg + L);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
      }
      // Pass 2: out_g = sum_t p[g, t] v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t blk = bt[b * bt_stride + t / bs];
        const scalar_t* __restrict__ v = base + blk * s_blk + s_kv + (t % bs) * s_tok + h * s_head;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* __restrict__ a = &acc[g * D];
          for (int64_t d = 0; d < D; ++d) a[d] += p * to_f(v[d]);
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          op[(b * Hq + h * G + g) * D + d] = static_cast<scalar_t>(acc[g * D + d]);
    }
  });
}

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor kv_cache, int64_t layer,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 6, "paged_decode_attention: bad ranks");
  TORCH_CHECK(kv_cache.stride(5) == 1, "kv_cache: last dim must be contiguous");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    switch (q.size(2)) {
      case 64: decode_kernel<scalar_t, 64>(q, kv_cache, layer, block_tables, seq_lens, scale, out); break;
      case 128: decode_kernel<scalar_t, 128>(q, kv_cache, layer, block_tables, seq_lens, scale, out); break;
      default: decode_kernel<scalar_t, 0>(q, kv_cache, layer, block_tables, seq_lens, scale, out);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}
