// The CUDA runtime calls of the copy engine and the host arena, in plain C++ (no torch headers, so
// nvcc compiles copy_engine_cuda.cu quickly). Only built when PYSTRONGHOLD_WITH_CUDA is defined.
// Every function reports a failure by throwing std::runtime_error with the CUDA error's name.
#pragma once

#include <cstdint>
#include <string>

// The CUDA runtime's stream and event types (cudaStream_t is CUstream_st*, cudaEvent_t CUevent_st*),
// declared here so that this header needs no CUDA header.
struct CUstream_st;
struct CUevent_st;

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

// A new event of `device` recorded on `stream` (a stream of that device): the point a copy issued
// later waits for. The calling thread's current device is left as it was.
CUevent_st* record_event(int device, CUstream_st* stream);
// Destroys an event of record_event (nullptr: nothing); never throws (used in destructors).
void destroy_event(CUevent_st* event) noexcept;

// Copies `len` bytes between host and `device` on the calling worker's own stream and waits for
// it. to_device: host_src -> dev_dst; otherwise dev_src -> host_dst. When the host side is not
// pinned the bytes go through the worker's pinned staging buffer (`staging_bytes` per piece).
// The worker's stream first waits for `after` (an event of `device`; nullptr: none).
// `worker_state` is the worker's opaque slot (streams and staging), created on first use.
void copy_chunk(void* dst, const void* src, int64_t len, bool to_device, int device,
                bool host_pinned, int64_t staging_bytes, CUevent_st* after, void** worker_state);
// Frees what copy_chunk created in `worker_state`; never throws.
void release_worker_state(void** worker_state) noexcept;

}  // namespace cuda
}  // namespace pystronghold
