// The host arena: one large aligned allocation per tier, carved into named aligned views.
// Pinned with cudaHostRegister when a CUDA device is usable, else page-aligned and optionally
// mlock'ed. Capacity beyond what the host can give fails before anything is allocated.
// Plain C++ (host_arena.cpp); module.cpp turns its views into tensors.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

// NOTE: hidden like pybind11's own types, so binding these classes raises no -Wattributes warning.
#pragma GCC visibility push(hidden)
namespace pystronghold {

struct ArenaMemory;

// nbytes of the arena at `data`; `keep_alive` holds the whole allocation alive (a tensor's deleter
// keeps it).
struct ArenaView {
  char* data = nullptr;
  int64_t nbytes = 0;
  std::shared_ptr<ArenaMemory> keep_alive;
};

class HostArena {
 public:
  // pin: "auto" (cudaHostRegister when a CUDA device is usable), "cuda" (or fail), "none".
  HostArena(int64_t capacity, int64_t alignment, const std::string& pin, bool lock);

  // A view of nbytes at an offset that is a multiple of the arena's alignment and of item_bytes.
  ArenaView allocate(const std::string& name, int64_t nbytes, int64_t item_bytes);
  // {name: (offset_bytes, nbytes)} of every view allocated.
  std::map<std::string, std::pair<int64_t, int64_t>> views();

  int64_t capacity() const;
  int64_t used();
  int64_t alignment() const { return alignment_; }
  bool pinned() const;
  bool locked() const;
  uintptr_t base_address() const;
  const std::string& pin_warning() const { return pin_warning_; }
  const std::string& lock_warning() const { return lock_warning_; }

 private:
  void register_pages(bool required);

  std::shared_ptr<ArenaMemory> mem_;
  const int64_t alignment_;
  std::mutex mutex_;
  int64_t used_ = 0;
  std::map<std::string, std::pair<int64_t, int64_t>> views_;
  std::string pin_warning_, lock_warning_;
};

}  // namespace pystronghold
#pragma GCC visibility pop
