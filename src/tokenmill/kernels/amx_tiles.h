// AMX tiles for the bfloat16 linear kernels: whether this process may use them, and the
// tile configurations those kernels load.
//
// Built only where the compiler targets a CPU with AMX-TILE and AMX-BF16 (-march=native on
// such a host); TOKENMILL_AMX says so. Linux makes a process ask for the tile registers'
// state before its first tile instruction (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA);
// amx_permitted() asks once and says whether it was granted (an older kernel refuses, and
// then the AVX-512 kernels run instead).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define TOKENMILL_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace tokenmill {

inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

// The 64-byte operand of LDTILECFG (palette 1): each tile's rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};

  void set(int tile, int tile_rows, int row_bytes) {
    rows[tile] = static_cast<uint8_t>(tile_rows);
    bytes_per_row[tile] = static_cast<uint16_t>(row_bytes);
  }

  // LDTILECFG. (GCC's builtin does not tell the optimizer that it reads all 64 bytes, which
  // then drops the stores that set them: the empty asm makes them happen first.)
  void load() const {
    asm volatile("" : : "r"(this) : "memory");
    _tile_loadconfig(this);
  }
};

}  // namespace tokenmill

#endif
