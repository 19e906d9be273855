// CUDA runtime side of the copy engine and the host arena (see copy_engine_cuda.h). Each worker
// thread owns, per device, a non-blocking stream and a pinned staging buffer, so host<->device
// chunks of different workers overlap and never run on torch's current stream; each chunk's stream
// waits for an event recorded on that stream when the copy was requested.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "copy_engine_cuda.h"

namespace pystronghold {
namespace cuda {

namespace {

void check(cudaError_t rc, const char* what) {
  if (rc == cudaSuccess) return;
  cudaGetLastError();  // clear the sticky-free error so the next call starts clean
  throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorName(rc) + " (" +
                           cudaGetErrorString(rc) + ")");
}

struct DeviceSlot {
  int device = -1;
  cudaStream_t stream = nullptr;
  void* staging = nullptr;  // cudaHostAlloc'ed, staging_bytes
  int64_t staging_bytes = 0;
};

struct WorkerState {
  std::vector<DeviceSlot> slots;
  DeviceSlot& slot(int device, int64_t staging_bytes, bool need_staging) {
    auto it = std::find_if(slots.begin(), slots.end(), [&](const DeviceSlot& s) { return s.device == device; });
    if (it == slots.end()) {
      DeviceSlot s;
      s.device = device;
      check(cudaSetDevice(device), "cudaSetDevice");
      check(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
      slots.push_back(s);
      it = slots.end() - 1;
    }
    if (need_staging && it->staging_bytes < staging_bytes) {
      if (it->staging != nullptr) cudaFreeHost(it->staging);
      it->staging = nullptr;
      it->staging_bytes = 0;
      check(cudaHostAlloc(&it->staging, static_cast<size_t>(staging_bytes), cudaHostAllocPortable),
            "cudaHostAlloc of the staging buffer");
      it->staging_bytes = staging_bytes;
    }
    return *it;
  }
};

}  // namespace

int device_count(std::string* why) {
  int n = 0;
  const cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc != cudaSuccess) {
    cudaGetLastError();
    if (why != nullptr) *why = std::string(cudaGetErrorName(rc)) + " (" + cudaGetErrorString(rc) + ")";
    return 0;
  }
  if (n == 0 && why != nullptr) *why = "cudaGetDeviceCount reports 0 devices";
  return n;
}

void host_register(void* ptr, int64_t bytes) {
  check(cudaHostRegister(ptr, static_cast<size_t>(bytes), cudaHostRegisterPortable), "cudaHostRegister");
}

void host_unregister(void* ptr) noexcept {
  if (cudaHostUnregister(ptr) != cudaSuccess) cudaGetLastError();
}

bool is_pinned(const void* ptr) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

CUevent_st* record_event(int device, CUstream_st* stream) {
  int previous = -1;
  check(cudaGetDevice(&previous), "cudaGetDevice");
  // NOTE: the event must belong to the stream's device; the caller's current device comes back
  // however this ends (torch keeps its own idea of it).
  struct RestoreDevice {
    int device;
    ~RestoreDevice() {
      if (cudaSetDevice(device) != cudaSuccess) cudaGetLastError();
    }
  } restore{previous};
  check(cudaSetDevice(device), "cudaSetDevice");
  cudaEvent_t event = nullptr;
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  const cudaError_t rc = cudaEventRecord(event, stream);
  if (rc != cudaSuccess) cudaEventDestroy(event);
  check(rc, "cudaEventRecord on the caller's current stream");
  return event;
}

void destroy_event(CUevent_st* event) noexcept {
  if (event != nullptr && cudaEventDestroy(event) != cudaSuccess) cudaGetLastError();
}

void copy_chunk(void* dst, const void* src, int64_t len, bool to_device, int device, bool host_pinned,
                int64_t staging_bytes, CUevent_st* after, void** worker_state) {
  if (len == 0) return;
  std::string why;
  if (device_count(&why) == 0) throw std::runtime_error("no usable CUDA device: " + why);
  if (*worker_state == nullptr) *worker_state = new WorkerState();
  auto* state = static_cast<WorkerState*>(*worker_state);
  DeviceSlot& slot = state->slot(device, staging_bytes, !host_pinned);
  check(cudaSetDevice(device), "cudaSetDevice");
  if (after != nullptr) check(cudaStreamWaitEvent(slot.stream, after, 0), "cudaStreamWaitEvent");
  const cudaMemcpyKind kind = to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
  if (host_pinned) {
    check(cudaMemcpyAsync(dst, src, static_cast<size_t>(len), kind, slot.stream), "cudaMemcpyAsync");
    check(cudaStreamSynchronize(slot.stream), "cudaStreamSynchronize");
    return;
  }
  // NOTE: pageable host memory: stage piece by piece through the pinned buffer (a real DMA copy),
  // instead of letting the driver stage synchronously on its own.
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  for (int64_t done = 0; done < len; done += slot.staging_bytes) {
    const size_t piece = static_cast<size_t>(std::min(slot.staging_bytes, len - done));
    if (to_device) {
      std::memcpy(slot.staging, s + done, piece);
      check(cudaMemcpyAsync(d + done, slot.staging, piece, kind, slot.stream), "cudaMemcpyAsync (staged)");
      check(cudaStreamSynchronize(slot.stream), "cudaStreamSynchronize");
    } else {
      check(cudaMemcpyAsync(slot.staging, s + done, piece, kind, slot.stream), "cudaMemcpyAsync (staged)");
      check(cudaStreamSynchronize(slot.stream), "cudaStreamSynchronize");
      std::memcpy(d + done, slot.staging, piece);
    }
  }
}

void release_worker_state(void** worker_state) noexcept {
  auto* state = static_cast<WorkerState*>(*worker_state);
  if (state == nullptr) return;
  for (auto& s : state->slots) {
    cudaSetDevice(s.device);
    if (s.stream != nullptr) cudaStreamDestroy(s.stream);
    if (s.staging != nullptr) cudaFreeHost(s.staging);
  }
  cudaGetLastError();
  delete state;
  *worker_state = nullptr;
}

}  // namespace cuda
}  // namespace pystronghold
