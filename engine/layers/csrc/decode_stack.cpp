// A decode step through a stack of Llama blocks in one call.
//
// Every row of such a step is one sequence's generated token.  Per layer:
// the input norm inside the QKV projection, per-head q and k norms where the
// model has them, rope and the cache store, the paged decode attention (the
// attention module's kernel, passed in as a capsule), the output projection,
// the residual add and post-attention norm inside the gate and up
// projection, SiLU, and the down projection added to the residual stream.
// These are LlamaLayer._forward_fused's ops, in its order, each through the
// same kernel with the same arguments, so the bits are the same.  The Python
// loop made about ten calls a layer, and the interpreter ran between them
// while the kernels' worker thread waited.  Here the GIL is released once
// for the whole pass, so a serving worker's event loop runs beside it rather
// than in the gaps between kernels.
//
// Which kernel a projection runs is PackedLinear's decode path
// (engine/layers/packed_linear.py, decode_path); the Python side builds the
// stack once (engine/models/decode_stack.py) and uses it only for steps
// without prompt rows.
#include "linear_ops.h"

#include <string>
#include <utility>
#include <vector>

namespace {

namespace py = pybind11;

// PackedLinear's decode paths (packed_linear.py: EXACT, BF16_WEIGHTS, BF16_ROWS, INT8).
enum Path : int64_t { kExact = 0, kBf16Weights = 1, kBf16Rows = 2, kInt8 = 3 };

// One packed projection as a decode step runs it.
struct Projection {
  int64_t path = kExact;
  int64_t n = 0, k = 0;  // outputs, inputs
  OptTensor panels, q4, q8, bf16, bias;
  int64_t q8_max_rows = 0;  // kExact: up to this many rows read the 8-bit blocks, more the panels

  // The 4-bit blocks, else the 8-bit ones (PackedLinear._tile_blocks).
  const OptTensor& blocks() const { return q4.has_value() ? q4 : q8; }

  // PackedLinear.decode(x).
  at::Tensor operator()(const at::Tensor& x) const {
    switch (path) {
      case kBf16Weights:
        if (q4) return bf16_blocks_linear<4>(x, *bf16, *q4, n, bias, c10::nullopt);
        if (q8) return bf16_blocks_linear<8>(x, *bf16, *q8, n, bias, c10::nullopt);
        return bf16_linear(x, *bf16, n, bias, c10::nullopt);
      case kBf16Rows:
        return q4 ? q4bf16_linear(x, *q4, n, bias, c10::nullopt) : q8bf16_linear(x, *q8, n, bias, c10::nullopt);
      case kInt8:
        return q4 ? q4i8_linear(x, *q4, n, bias, c10::nullopt) : q8i8_linear(x, *q8, n, bias, c10::nullopt);
      default:
        if (q4) return q4_linear(x, *q4, n, bias, c10::nullopt);
        if (q8 && x.numel() <= q8_max_rows * k) return q8_linear(x, *q8, n, bias, c10::nullopt);
        TORCH_CHECK(panels, "DecodeStack: a layer of 8-bit blocks without float32 panels for ", x.size(0), " rows");
        return packed_linear(x, *panels, n, bias, c10::nullopt);
    }
  }

  // PackedLinear.forward_normed: this projection of rms_norm(x, w, eps, residual).
  at::Tensor normed(const at::Tensor& x, const at::Tensor& w, double eps, const OptTensor& residual) const {
    if (path == kBf16Weights) return bf16_norm_linear(x, *bf16, blocks(), n, w, eps, residual, bias);
    if (path == kBf16Rows) return bf16_rows_norm_linear(x, *blocks(), n, w, eps, residual, bias);
    if (path == kInt8) return int8_norm_linear(x, *blocks(), n, w, eps, residual, bias);
    return (*this)(rms_norm(x, w, eps, residual));
  }

  // PackedLinear.forward_silu: this projection of silu_and_mul(gate_up).
  at::Tensor gated(const at::Tensor& gate_up) const {
    if (path == kBf16Weights) return bf16_silu_linear(gate_up, *bf16, blocks(), n, bias);
    if (path == kBf16Rows) return bf16_rows_silu_linear(gate_up, *blocks(), n, bias);
    if (path == kInt8) return int8_silu_linear(gate_up, *blocks(), n, bias);
    return (*this)(silu_and_mul(gate_up));
  }

  // Whether PackedLinear.forward_normed_silu gates in its own call (else it returns None).
  bool gates_itself() const { return path == kBf16Weights && !bias.has_value(); }

  // PackedLinear.forward_normed_silu where gates_itself(): silu_and_mul(normed(x, ...)) in one call.
  at::Tensor normed_gated(const at::Tensor& x, const at::Tensor& w, double eps, const OptTensor& residual) const {
    return bf16_norm_silu_linear(x, *bf16, blocks(), n, w, eps, residual);
  }
};

struct Layer {
  int64_t index = 0;  // in the KV cache
  at::Tensor norm1, norm2;  // input_layernorm's and post_attention_layernorm's weights
  double eps1 = 0, eps2 = 0;
  Projection qkv, o, gate_up, down;
  int64_t window = 0;  // > 0: sliding-window attention over this many positions
  OptTensor q_norm, k_norm;  // per-head norms of q and k ahead of rope (Qwen3), or none
  double q_eps = 0, k_eps = 0;
};

// paged_attention_cpu.cpp's paged_decode_attention.
using DecodeAttention = at::Tensor (*)(at::Tensor q, at::Tensor kv_cache, int64_t layer, at::Tensor block_tables,
                                       at::Tensor seq_lens, double scale, int64_t window, bool bf16_dots);
constexpr const char* kAttentionCapsule = "splitserve.paged_decode_attention";

class DecodeStack {
 public:
  DecodeStack(std::vector<Layer> layers, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
              double kv_scale, const py::capsule& attention)
      : layers_(std::move(layers)), num_heads_(num_heads), num_kv_heads_(num_kv_heads),
        q_size_(num_heads * head_dim), scale_(scale), kv_scale_(kv_scale) {
    TORCH_CHECK(attention.name() != nullptr && std::string(attention.name()) == kAttentionCapsule,
                "DecodeStack: attention must be the attention module's decode_attention_capsule()");
    attention_ = reinterpret_cast<DecodeAttention>(attention.get_pointer());
  }

  // x: [B, hidden] float32, one generated token per sequence, updated in place
  // (the residual stream) and returned; cos, sin: the rows' rope values;
  // block_tables [B, max_blocks] and seq_lens [B] as the attention takes them;
  // bf16_dots: the attention in bfloat16 pairs (paged_decode_attention's bf16_dots).
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor kv_cache,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, bool bf16_dots) const {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                "DecodeStack.forward: x must be a contiguous float32 [B, hidden]");
    TORCH_CHECK(block_tables.size(0) == x.size(0) && seq_lens.numel() == x.size(0),
                "DecodeStack.forward: one row a sequence");
    const int64_t t = x.size(0);
    for (const Layer& l : layers_) {
      const at::Tensor qkv = l.qkv.normed(x, l.norm1, l.eps1, c10::nullopt);
      if (l.q_norm) norm_heads(qkv, 0, num_heads_, *l.q_norm, l.q_eps);
      if (l.k_norm) norm_heads(qkv, q_size_, num_kv_heads_, *l.k_norm, l.k_eps);
      const auto qk = rope_and_store_kv(qkv, cos, sin, kv_cache, l.index, slot_mapping, num_heads_, num_kv_heads_);
      at::Tensor o = attention_(std::get<0>(qk), kv_cache, l.index, block_tables, seq_lens, scale_ * kv_scale_,
                                l.window, bf16_dots);
      if (kv_scale_ != 1.0) o = o * kv_scale_;  // an fp8 cache's scale, as paged_attention applies it
      o = l.o(o.reshape({t, q_size_}));
      // x += o inside the norm (its residual), then the MLP's output added to x.
      if (l.gate_up.gates_itself())
        x.add_(l.down(l.gate_up.normed_gated(o, l.norm2, l.eps2, x)));
      else
        x.add_(l.down.gated(l.gate_up.normed(o, l.norm2, l.eps2, x)));
    }
    return x;
  }

 private:
  // Each of the n heads of qkv's columns from lo normed in place (a per-head RMSNorm).
  void norm_heads(const at::Tensor& qkv, int64_t lo, int64_t n, const at::Tensor& w, double eps) const {
    const int64_t t = qkv.size(0), d = q_size_ / num_heads_;
    at::Tensor part = qkv.narrow(1, lo, n * d);
    part.copy_(rms_norm(part.reshape({t, n, d}), w, eps, c10::nullopt).view({t, -1}));
  }

  std::vector<Layer> layers_;
  int64_t num_heads_, num_kv_heads_, q_size_;
  double scale_, kv_scale_;
  DecodeAttention attention_ = nullptr;
};

}  // namespace

void def_decode_stack(py::module_& m) {
  py::class_<Projection>(m, "DecodeProjection", "one packed projection's decode path (PackedLinear.decode_path)")
      .def(py::init([](int64_t path, int64_t n, int64_t k, OptTensor panels, OptTensor q4, OptTensor q8,
                       OptTensor bf16, OptTensor bias, int64_t q8_max_rows) {
             TORCH_CHECK(path >= kExact && path <= kInt8, "DecodeProjection: unknown path ", path);
             const bool blocks = q4.has_value() || q8.has_value();
             TORCH_CHECK(path != kBf16Weights || bf16.has_value(), "DecodeProjection: bfloat16 panels missing");
             TORCH_CHECK((path != kBf16Rows && path != kInt8) || blocks, "DecodeProjection: blocks missing");
             TORCH_CHECK(path != kExact || blocks || panels.has_value(), "DecodeProjection: weights missing");
             return Projection{path, n, k, std::move(panels), std::move(q4), std::move(q8), std::move(bf16),
                               std::move(bias), q8_max_rows};
           }),
           py::arg("path"), py::arg("n"), py::arg("k"), py::arg("panels"), py::arg("q4"), py::arg("q8"),
           py::arg("bf16"), py::arg("bias"), py::arg("q8_max_rows"));
  py::class_<Layer>(m, "DecodeLayer", "one Llama block of a DecodeStack")
      .def(py::init([](int64_t index, at::Tensor norm1, double eps1, at::Tensor norm2, double eps2, Projection qkv,
                       Projection o, Projection gate_up, Projection down, int64_t window, OptTensor q_norm,
                       double q_eps, OptTensor k_norm, double k_eps) {
             TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "DecodeLayer: q and k norms come together");
             return Layer{index, std::move(norm1), std::move(norm2), eps1, eps2, std::move(qkv), std::move(o),
                          std::move(gate_up), std::move(down), window, std::move(q_norm), std::move(k_norm),
                          q_eps, k_eps};
           }),
           py::arg("index"), py::arg("norm1"), py::arg("eps1"), py::arg("norm2"), py::arg("eps2"), py::arg("qkv"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("window"), py::arg("q_norm") = py::none(),
           py::arg("q_eps") = 0.0, py::arg("k_norm") = py::none(), py::arg("k_eps") = 0.0);
  py::class_<DecodeStack>(m, "DecodeStack", "a decode step through every layer in one call, without the GIL")
      .def(py::init<std::vector<Layer>, int64_t, int64_t, int64_t, double, double, const py::capsule&>(),
           py::arg("layers"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"),
           py::arg("kv_scale"), py::arg("attention"))
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>(),
           "x (updated in place) after every layer, for a step of one generated token a sequence",
           py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("kv_cache"), py::arg("slot_mapping"),
           py::arg("block_tables"), py::arg("seq_lens"), py::arg("bf16_dots") = false);
}
