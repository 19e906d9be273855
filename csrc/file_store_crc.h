// CRC32C (Castagnoli), the file tier's record checksum; no torch headers (file_store_crc.cpp).
#pragma once

#include <cstdint>

namespace pystronghold {

// CRC32C of nbytes at data: the SSE4.2 crc32 instruction when the CPU has it (unless
// force_software), slice-by-8 tables otherwise. crc32c("123456789") == 0xE3069283.
uint32_t crc32c(const void* data, int64_t nbytes, bool force_software = false);

}  // namespace pystronghold
