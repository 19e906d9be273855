// The host arena (host_arena.h): the host's memory budget, the one allocation, pinning and locking.
#include "host_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "check.h"
#include "gil.h"

#if defined(PYSTRONGHOLD_WITH_CUDA)
#include "copy_engine_cuda.h"
#endif

namespace pystronghold {

// ---- how much memory the host can give this process
// NOTE: plain stdio and strtoll, never iostreams: on the first GPU machine the `std::ifstream >>`
// parsing of /proc/meminfo segfaulted inside libstdc++'s locale machinery (docs/DESIGN.md, "No
// iostreams in csrc/"); tests/test_csrc_sources.py keeps them out.

// The value of "<key>:" in /proc/meminfo in bytes, or -1 when the file or the key is missing.
static int64_t meminfo_bytes(const char* key) {
  FILE* in = std::fopen("/proc/meminfo", "r");
  if (in == nullptr) return -1;
  const size_t key_len = std::strlen(key);
  char line[256];
  int64_t bytes = -1;
  while (std::fgets(line, sizeof line, in) != nullptr) {
    if (std::strncmp(line, key, key_len) != 0 || line[key_len] != ':') continue;
    char* end = nullptr;
    errno = 0;
    const long long kib = std::strtoll(line + key_len + 1, &end, 10);  // skips leading blanks
    if (errno == 0 && end != line + key_len + 1 && kib >= 0) bytes = static_cast<int64_t>(kib) * 1024;
    break;
  }
  std::fclose(in);
  return bytes;
}

// A cgroup v2 file holding one integer ("max" or a missing file: no limit, -1).
static int64_t read_cgroup_value(const char* path) {
  FILE* in = std::fopen(path, "r");
  if (in == nullptr) return -1;
  char text[64];
  const bool got = std::fgets(text, sizeof text, in) != nullptr;
  std::fclose(in);
  if (!got) return -1;
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text, &end, 10);
  if (errno != 0 || end == text || value < 0) return -1;  // "max\n" parses no digits
  return static_cast<int64_t>(value);
}

// Bytes this process may still allocate: MemAvailable, lowered by a cgroup v2 limit if any.
static int64_t host_available_bytes(std::string* how) {
  int64_t avail = meminfo_bytes("MemAvailable");
  *how = "MemAvailable " + std::to_string(avail) + " bytes";
  const int64_t limit = read_cgroup_value("/sys/fs/cgroup/memory.max");
  const int64_t current = read_cgroup_value("/sys/fs/cgroup/memory.current");
  if (limit > 0 && current >= 0 && (avail < 0 || limit - current < avail)) {
    avail = limit - current;
    *how += ", cgroup memory.max " + std::to_string(limit) + " - memory.current " + std::to_string(current);
  }
  return avail;
}

// ---- the one allocation; views hold it alive through a shared_ptr in their deleter

struct ArenaMemory {
  void* map = nullptr;
  int64_t map_bytes = 0;
  char* base = nullptr;
  int64_t bytes = 0;
  bool registered = false;
  bool locked = false;
  // NOTE: unregistering and unmapping a pinned GiB takes a tenth of a second or more (the store
  // frees tens of GiB at close): other Python threads run meanwhile when this thread holds the GIL
  ~ArenaMemory() {
    run_without_gil([this] { release(); });
  }

 private:
  void release() noexcept {
#if defined(PYSTRONGHOLD_WITH_CUDA)
    if (registered) cuda::host_unregister(base);
#endif
    if (locked) munlock(base, static_cast<size_t>(bytes));
    if (map != nullptr) munmap(map, static_cast<size_t>(map_bytes));
  }
};


// ---- the arena

HostArena::HostArena(int64_t capacity, int64_t alignment, const std::string& pin, bool lock) : alignment_(alignment) {
  PS_CHECK(capacity >= 1, "HostArena: capacity_bytes must be >= 1, got ", capacity);
  PS_CHECK(alignment >= 1 && (alignment & (alignment - 1)) == 0,
           "HostArena: alignment must be a power of two (bytes), got ", alignment);
  PS_CHECK(pin == "auto" || pin == "cuda" || pin == "none",
           "HostArena: pin must be 'auto', 'cuda' or 'none', got '", pin, "'");
  std::string how;
  const int64_t available = host_available_bytes(&how);
  PS_CHECK(available < 0 || capacity <= available, "HostArena: capacity_bytes=", capacity,
           " is more than this host can give (", how, "); nothing was allocated");
  const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t base_align = std::max<int64_t>(alignment, page);
  mem_ = std::make_shared<ArenaMemory>();
  mem_->map_bytes = capacity + (base_align > page ? base_align : 0);
  void* map = mmap(nullptr, static_cast<size_t>(mem_->map_bytes), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  PS_CHECK(map != MAP_FAILED, "HostArena: mmap of ", mem_->map_bytes, " bytes failed: ", std::strerror(errno));
  mem_->map = map;
  const auto addr = reinterpret_cast<uintptr_t>(map);
  mem_->base = reinterpret_cast<char*>((addr + base_align - 1) / base_align * base_align);
  mem_->bytes = capacity;
  // NOTE: pinning and locking fault in every page (seconds per GiB): other Python threads (the
  // store's fill) run meanwhile. Nothing below touches a Python object; an error thrown here
  // takes the GIL back as it unwinds.
  run_without_gil([&] {
    if (pin != "none") register_pages(pin == "cuda");
    if (lock) {
      if (mlock(mem_->base, static_cast<size_t>(capacity)) == 0) {
        mem_->locked = true;
      } else {
        lock_warning_ = std::string("mlock of ") + std::to_string(capacity) + " bytes failed: " +
                        std::strerror(errno) + " (raise `ulimit -l` or grant CAP_IPC_LOCK); the arena is not locked";
      }
    }
  });
}

ArenaView HostArena::allocate(const std::string& name, int64_t nbytes, int64_t item_bytes) {
  std::lock_guard<std::mutex> guard(mutex_);
  PS_CHECK(!name.empty(), "HostArena.allocate: name must not be empty");
  PS_CHECK(nbytes >= 0, "HostArena.allocate('", name, "'): negative size ", nbytes);
  PS_CHECK(item_bytes >= 1 && (item_bytes & (item_bytes - 1)) == 0, "HostArena.allocate('", name,
           "'): item size must be a power of two, got ", item_bytes);
  PS_CHECK(views_.count(name) == 0, "HostArena.allocate: a view named '", name, "' exists already");
  const int64_t align = std::max(alignment_, item_bytes);
  const int64_t offset = (used_ + align - 1) / align * align;
  PS_CHECK(offset + nbytes <= mem_->bytes, "HostArena.allocate('", name, "'): needs ", nbytes,
           " bytes at offset ", offset, " (alignment ", align, "), but the arena holds ",
           mem_->bytes, " bytes with ", used_, " used (", mem_->bytes - offset, " left after alignment)");
  used_ = offset + nbytes;
  views_[name] = {offset, nbytes};
  return ArenaView{mem_->base + offset, nbytes, mem_};
}

std::map<std::string, std::pair<int64_t, int64_t>> HostArena::views() {
  std::lock_guard<std::mutex> guard(mutex_);
  return views_;
}

int64_t HostArena::capacity() const { return mem_->bytes; }

int64_t HostArena::used() {
  std::lock_guard<std::mutex> guard(mutex_);
  return used_;
}

bool HostArena::pinned() const { return mem_->registered; }
bool HostArena::locked() const { return mem_->locked; }
uintptr_t HostArena::base_address() const { return reinterpret_cast<uintptr_t>(mem_->base); }

void HostArena::register_pages(bool required) {
#if defined(PYSTRONGHOLD_WITH_CUDA)
  std::string why;
  if (cuda::device_count(&why) == 0) {
    PS_CHECK(!required, "HostArena(pin='cuda'): no usable CUDA device: ", why);
    return;  // pin='auto' without a device: page-aligned memory, silently (the normal CPU case)
  }
  try {
    cuda::host_register(mem_->base, mem_->bytes);
    mem_->registered = true;
  } catch (const std::runtime_error& exc) {
    PS_CHECK(!required, "HostArena(pin='cuda'): cudaHostRegister of ", mem_->bytes, " bytes failed: ", exc.what());
    pin_warning_ = std::string("cudaHostRegister of ") + std::to_string(mem_->bytes) +
                   " bytes failed (" + exc.what() + "); the arena is not pinned";
  }
#else
  PS_CHECK(!required, "HostArena(pin='cuda'): this build of pystronghold._C has no CUDA support");
#endif
}

}  // namespace pystronghold
