// AMX tiles, shared by the CPU kernels that use them: the one tile
// configuration they load (every tile 16 rows of 64 bytes), and the
// permission Linux wants a process to ask for before its first tile
// instruction (ARCH_REQ_XCOMP_PERM for XTILEDATA; asked once, process-wide).
#pragma once

#include <cstdint>
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace splitserve_amx {

constexpr int ROWS = 16;  // rows of every tile

// Palette 1, tiles 0-7 each ROWS rows of 64 bytes (ldtilecfg's layout).
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {ROWS, ROWS, ROWS, ROWS, ROWS, ROWS, ROWS, ROWS};
};

// Call between writing memory with ordinary stores and loading it as tiles.
// GCC's _tile_loadd names only the address to the compiler, not the memory
// behind it, so a store just before it (a tile made in a buffer, a softmax's
// p) could be moved after it; this barrier keeps every store before.
inline void rows_written() { __asm__ volatile("" ::: "memory"); }

// Whether this process may use the tiles (asked the first time).
inline bool tiles_allowed() {
#if defined(__linux__) && defined(__x86_64__)
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

}  // namespace splitserve_amx
