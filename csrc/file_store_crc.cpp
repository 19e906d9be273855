// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the file tier's record checksum: the SSE4.2
// crc32 instruction where the CPU has it (chosen at run time), slice-by-8 tables otherwise.
#include <cstdint>
#include <cstring>

#include "file_store_crc.h"

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define PYSTRONGHOLD_CRC_X86 1
#endif

namespace pystronghold {

namespace {

struct Crc32cTables {
  uint32_t t[8][256];
  Crc32cTables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
  }
};

const Crc32cTables& tables() {
  static const Crc32cTables tab;
  return tab;
}

// `crc` is the running (inverted) state.
uint32_t crc32c_software(uint32_t crc, const unsigned char* p, int64_t n) {
  const auto& t = tables().t;
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);  // little-endian hosts only (x86, aarch64)
    word ^= crc;
    crc = t[7][word & 0xFF] ^ t[6][(word >> 8) & 0xFF] ^ t[5][(word >> 16) & 0xFF] ^
          t[4][(word >> 24) & 0xFF] ^ t[3][(word >> 32) & 0xFF] ^ t[2][(word >> 40) & 0xFF] ^
          t[1][(word >> 48) & 0xFF] ^ t[0][word >> 56];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xFF];
  return crc;
}

#if defined(PYSTRONGHOLD_CRC_X86)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t crc, const unsigned char* p, int64_t n) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
    p += 8;
    n -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (n-- > 0) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

bool have_sse42() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

}  // namespace

uint32_t crc32c(const void* data, int64_t nbytes, bool force_software) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t crc = 0xFFFFFFFFu;
#if defined(PYSTRONGHOLD_CRC_X86)
  if (!force_software && have_sse42()) return ~crc32c_sse42(crc, p, nbytes);
#endif
  (void)force_software;
  return ~crc32c_software(crc, p, nbytes);
}

}  // namespace pystronghold
