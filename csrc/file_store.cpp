// The file tier's files: creation (header, preallocation), opening (header checks), fsync. Record
// reads and writes are in file_store_io.cpp, the Python binding in module.cpp. Layout: file_store.h.
#include "file_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "check.h"

namespace pystronghold {

namespace {

struct StoreHeader {  // at offset 0 of the zero-filled first 4096 bytes
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;
  int64_t num_blocks;
  int64_t record_bytes;
  int64_t slot_bytes;
  int64_t data_offset;
  int64_t segment_bytes;
  uint32_t checksum_kind;  // 1: CRC32C of per-segment CRC32Cs
  uint32_t reserved;
  char state[64];
  uint32_t header_crc;  // CRC32C of the bytes before this field
};
static_assert(offsetof(StoreHeader, header_crc) == 128, "store header layout changed");
constexpr char kStoreMagic[8] = {'P', 'S', 'T', 'R', 'S', 'T', 'O', 'R'};

struct AlignedPage {
  void* p = nullptr;
  AlignedPage() {
    if (posix_memalign(&p, kStoreAlign, kStoreAlign) != 0) p = nullptr;
    PS_CHECK(p != nullptr, "FileStore: out of memory for a 4096-byte buffer");
    std::memset(p, 0, kStoreAlign);
  }
  ~AlignedPage() { std::free(p); }
};

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

std::string parent_dir(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
}

// Opens `path` with `flags`, adding O_DIRECT per `direct`; reports what happened in `note`.
int open_maybe_direct(const std::string& path, int flags, const std::string& direct, bool* is_direct,
                      std::string* note) {
  *is_direct = false;
  if (direct != "never") {
    const int fd = ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC);
    if (fd >= 0) {
      *is_direct = true;
      return fd;
    }
    const int err = errno;
    if (err != EINVAL || direct == "always") return -1;  // EINVAL: the file system refuses O_DIRECT
    *note = "O_DIRECT is not supported for " + path + " (" + errno_text(err) + "); using buffered I/O";
  } else {
    *note = "buffered I/O for " + path + " (direct='never')";
  }
  return ::open(path.c_str(), flags | O_CLOEXEC);
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // best effort: the file itself was fsynced
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

std::shared_ptr<RecordFile> RecordFile::create(const std::string& path, const RecordLayout& in,
                                               const std::string& direct, bool preallocate) {
  PS_CHECK(direct == "auto" || direct == "always" || direct == "never",
           "FileStore: direct must be 'auto', 'always' or 'never', got '", direct, "'");
  PS_CHECK(in.num_blocks >= 1, "FileStore: num_blocks must be >= 1, got ", in.num_blocks);
  PS_CHECK(in.record_bytes >= 1, "FileStore: record_bytes of state '", in.state, "' must be >= 1, got ",
           in.record_bytes);
  PS_CHECK(in.segment_bytes >= kStoreAlign && in.segment_bytes % kStoreAlign == 0,
           "FileStore: segment_bytes must be a positive multiple of 4096, got ", in.segment_bytes);
  PS_CHECK(!in.state.empty() && in.state.size() < 64, "FileStore: state name must have 1..63 characters, got '",
           in.state, "'");
  RecordLayout layout = in;
  layout.data_offset = kStoreAlign;
  layout.slot_bytes = kStoreAlign + (in.record_bytes + kStoreAlign - 1) / kStoreAlign * kStoreAlign;

  const int made = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  PS_CHECK(made >= 0, "FileStore: cannot create ", path, ": ", errno_text(errno));
  ::close(made);
  auto fail = [&](int fd, const std::string& what, int err) {
    if (fd >= 0) ::close(fd);
    ::unlink(path.c_str());
    PS_CHECK(false, "FileStore: ", what, " ", path, " failed: ", errno_text(err),
             "; the file was removed, nothing else changed");
  };
  bool is_direct = false;
  std::string note;
  const int fd = open_maybe_direct(path, O_RDWR, direct, &is_direct, &note);
  if (fd < 0) fail(-1, "opening (direct='" + direct + "')", errno);
  if (preallocate) {
    const int rc = ::posix_fallocate(fd, 0, layout.file_bytes());
    if (rc != 0) fail(fd, "preallocating " + std::to_string(layout.file_bytes()) + " bytes for", rc);
  } else if (::ftruncate(fd, layout.file_bytes()) != 0) {
    fail(fd, "sizing (sparse) " + std::to_string(layout.file_bytes()) + " bytes for", errno);
  }
  AlignedPage page;
  StoreHeader h{};
  std::memcpy(h.magic, kStoreMagic, 8);
  h.version = kStoreFormatVersion;
  h.header_bytes = kStoreAlign;
  h.num_blocks = layout.num_blocks;
  h.record_bytes = layout.record_bytes;
  h.slot_bytes = layout.slot_bytes;
  h.data_offset = layout.data_offset;
  h.segment_bytes = layout.segment_bytes;
  h.checksum_kind = 1;
  std::strncpy(h.state, layout.state.c_str(), sizeof(h.state) - 1);
  h.header_crc = crc32c(&h, offsetof(StoreHeader, header_crc));
  std::memcpy(page.p, &h, sizeof(h));
  const ssize_t n = ::pwrite(fd, page.p, kStoreAlign, 0);
  if (n != kStoreAlign) fail(fd, "writing the header of", n < 0 ? errno : ENOSPC);
  if (::fsync(fd) != 0) fail(fd, "fsync of", errno);
  fsync_dir(parent_dir(path));
  return std::shared_ptr<RecordFile>(new RecordFile(path, fd, is_direct, note, layout, ""));
}

std::shared_ptr<RecordFile> RecordFile::open(const std::string& path, const std::string& direct) {
  PS_CHECK(direct == "auto" || direct == "always" || direct == "never",
           "FileStore: direct must be 'auto', 'always' or 'never', got '", direct, "'");
  bool is_direct = false;
  std::string note, read_only;
  int fd = open_maybe_direct(path, O_RDWR, direct, &is_direct, &note);
  if (fd < 0 && (errno == EROFS || errno == EACCES || errno == EPERM)) {
    read_only = "opened read-only: " + path + " cannot be opened for writing: " + errno_text(errno);
    fd = open_maybe_direct(path, O_RDONLY, direct, &is_direct, &note);
  }
  PS_CHECK(fd >= 0, "FileStore: cannot open ", path, ": ", errno_text(errno));
  auto refuse = [&](const std::string& why) {
    ::close(fd);
    PS_CHECK(false, "FileStore: refusing ", path, ": ", why);
  };
  AlignedPage page;
  const ssize_t n = ::pread(fd, page.p, kStoreAlign, 0);
  if (n < 0) refuse("reading its header failed: " + errno_text(errno));
  if (n < static_cast<ssize_t>(sizeof(StoreHeader))) refuse("too short to hold a store header (" + std::to_string(n) + " bytes)");
  StoreHeader h;
  std::memcpy(&h, page.p, sizeof(h));
  if (std::memcmp(h.magic, kStoreMagic, 8) != 0) refuse("not a pystronghold file-tier store (bad magic)");
  if (h.version != kStoreFormatVersion) {
    refuse("store format version " + std::to_string(h.version) + ", but this pystronghold reads version " +
           std::to_string(kStoreFormatVersion) + " only; recreate the store with this version");
  }
  if (h.header_crc != crc32c(&h, offsetof(StoreHeader, header_crc))) refuse("header checksum mismatch (corrupt header)");
  RecordLayout layout;
  layout.num_blocks = h.num_blocks;
  layout.record_bytes = h.record_bytes;
  layout.segment_bytes = h.segment_bytes;
  layout.slot_bytes = h.slot_bytes;
  layout.data_offset = h.data_offset;
  h.state[sizeof(h.state) - 1] = '\0';
  layout.state = h.state;
  const int64_t want_slot = kStoreAlign + (h.record_bytes + kStoreAlign - 1) / kStoreAlign * kStoreAlign;
  if (h.checksum_kind != 1 || h.header_bytes != kStoreAlign || h.num_blocks < 1 || h.record_bytes < 1 ||
      h.slot_bytes != want_slot || h.data_offset != kStoreAlign || h.segment_bytes < kStoreAlign ||
      h.segment_bytes % kStoreAlign != 0) {
    refuse("inconsistent record layout in the header");
  }
  struct stat st{};
  if (::fstat(fd, &st) != 0) refuse("fstat failed: " + errno_text(errno));
  if (st.st_size < layout.file_bytes()) {
    refuse("truncated: " + std::to_string(st.st_size) + " bytes, the layout needs " +
           std::to_string(layout.file_bytes()));
  }
  return std::shared_ptr<RecordFile>(new RecordFile(path, fd, is_direct, note, layout, read_only));
}

RecordFile::~RecordFile() { ::close(fd_); }

void RecordFile::flush() {
  PS_CHECK(::fsync(fd_) == 0, "FileStore.flush: fsync of ", path_, " failed: ", errno_text(errno),
           "; completed writes may not be durable");
}

void RecordFile::close() {
  std::lock_guard<std::mutex> guard(mutex_);
  closed_ = true;
}

}  // namespace pystronghold
