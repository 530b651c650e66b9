// A float32 rounded to the nearest bfloat16, ties to even, as torch rounds
// (NaN becomes 0x7FC0), written in integers: c10's conversion tests NaN with
// std::isnan, which the kernels' -ffast-math may fold away.  Without a branch,
// so that loops of it vectorize.  Shared by the linear kernels (x as bfloat16
// pairs) and the attention kernel (bfloat16 prompt rows).
#pragma once

#include <cstdint>
#include <cstring>

namespace splitserve_bf16 {

inline uint16_t round_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

}  // namespace splitserve_bf16
