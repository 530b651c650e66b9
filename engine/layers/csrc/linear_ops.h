// The linear module's torch-facing ops (linear_cpu.cpp), declared for its
// other sources (decode_stack.cpp); linear_cpu.cpp includes this too, so a
// signature that drifts fails its build.
#pragma once

#include <torch/extension.h>

#include <tuple>

using OptTensor = c10::optional<at::Tensor>;

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N, const OptTensor& bias,
                         const OptTensor& out);
at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const OptTensor& bias,
                     const OptTensor& out);
at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const OptTensor& bias,
                     const OptTensor& out);
at::Tensor q4i8_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const OptTensor& bias,
                       const OptTensor& out);
at::Tensor q8i8_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const OptTensor& bias,
                       const OptTensor& out);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N, const OptTensor& bias,
                       const OptTensor& out);
template <int BITS>
at::Tensor bf16_blocks_linear(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& blocks, int64_t N,
                              const OptTensor& bias, const OptTensor& out);
at::Tensor bf16_norm_linear(const at::Tensor& x, const at::Tensor& panels, const OptTensor& blocks, int64_t N,
                            const at::Tensor& weight, double eps, const OptTensor& residual, const OptTensor& bias);
at::Tensor bf16_norm_silu_linear(const at::Tensor& x, const at::Tensor& panels, const OptTensor& blocks, int64_t N,
                                 const at::Tensor& weight, double eps, const OptTensor& residual);
at::Tensor bf16_silu_linear(const at::Tensor& gate_up, const at::Tensor& panels, const OptTensor& blocks, int64_t N,
                            const OptTensor& bias);
at::Tensor q4bf16_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const OptTensor& bias,
                         const OptTensor& out);
at::Tensor q8bf16_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const OptTensor& bias,
                         const OptTensor& out);
at::Tensor bf16_rows_norm_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const at::Tensor& weight,
                                 double eps, const OptTensor& residual, const OptTensor& bias);
at::Tensor bf16_rows_silu_linear(const at::Tensor& gate_up, const at::Tensor& blocks, int64_t N,
                                 const OptTensor& bias);
at::Tensor int8_norm_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t N, const at::Tensor& weight,
                            double eps, const OptTensor& residual, const OptTensor& bias);
at::Tensor int8_silu_linear(const at::Tensor& gate_up, const at::Tensor& blocks, int64_t N, const OptTensor& bias);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, const OptTensor& residual);
std::tuple<at::Tensor, at::Tensor> rope_and_store_kv(const at::Tensor& qkv, const at::Tensor& cos,
                                                     const at::Tensor& sin, at::Tensor& kv_cache, int64_t layer,
                                                     const at::Tensor& slot_mapping, int64_t num_heads,
                                                     int64_t num_kv_heads);
at::Tensor silu_and_mul(const at::Tensor& gate_up);

// Adds DecodeStack (decode_stack.cpp) to the module.
void def_decode_stack(pybind11::module_& m);
