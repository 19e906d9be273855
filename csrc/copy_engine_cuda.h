// The CUDA runtime calls of the copy engine and the host arena, in plain C++ (no torch headers, so
// nvcc compiles copy_engine_cuda.cu quickly). Only built when PYSTRONGHOLD_WITH_CUDA is defined.
// Every function reports a failure by throwing std::runtime_error with the CUDA error's name.
#pragma once

#include <cstdint>
#include <string>

namespace pystronghold {
namespace cuda {

// Number of usable CUDA devices; 0 with `why` set when there is none (no driver, no device...).
int device_count(std::string* why);

// Page-locks [ptr, ptr + bytes) with cudaHostRegister (portable), so copies from it are true DMA.
void host_register(void* ptr, int64_t bytes);
// Undoes host_register; never throws (used in destructors).
void host_unregister(void* ptr) noexcept;
// Whether ptr lies in page-locked (cudaHostAlloc'ed or registered) host memory.
bool is_pinned(const void* ptr);

// Copies `len` bytes between host and `device` on the calling worker's own stream and waits for
// it. to_device: host_src -> dev_dst; otherwise dev_src -> host_dst. When the host side is not
// pinned the bytes go through the worker's pinned staging buffer (`staging_bytes` per piece).
// `worker_state` is the worker's opaque slot (streams and staging), created on first use.
void copy_chunk(void* dst, const void* src, int64_t len, bool to_device, int device,
                bool host_pinned, int64_t staging_bytes, void** worker_state);
// Frees what copy_chunk created in `worker_state`; never throws.
void release_worker_state(void** worker_state) noexcept;

}  // namespace cuda
}  // namespace pystronghold
