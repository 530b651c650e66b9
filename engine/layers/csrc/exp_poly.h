// exp(x) for x <= 0, lane by lane, on GCC vector types (V: floats, I: int32
// of the same width), shared by the attention kernels' softmax and the linear
// kernels' SiLU: x = n ln2 + r, |r| <= ln2 / 2, and r's Taylor polynomial to
// r^6 (relative error under 2e-7).  Every lane runs the same operations in the
// same order, so an element's bits do not depend on its lane or the width.
// The arithmetic follows the includer's floating-point options (the linear
// kernels include it under no-fast-math and no fused multiply-adds).
#pragma once

#include <cstring>

namespace splitserve_exp {

template <typename V, typename I>
inline V exp_nonpositive(V x) {
  const V lowest = V{} - 87.f;
  x = x > lowest ? x : lowest;
  const I n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, I);  // round(x / ln2): x <= 0
  const V fn = __builtin_convertvector(n, V);
  const V r = x - fn * 0.693145751953125f - fn * 1.428606765330187e-06f;
  V p = V{} + 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const I bits = (n + 127) << 23;
  V two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

}  // namespace splitserve_exp
