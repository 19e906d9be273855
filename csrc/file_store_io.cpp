// Record reads and writes of the file tier as copy-engine requests: chunks of segment_bytes moved
// with pread/pwrite (O_DIRECT through an aligned bounce buffer when the host side is unaligned),
// one CRC32C per segment computed by the worker, and the record meta written or verified by the
// worker that finishes the request. Layout and checksum scheme: file_store.h.
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>

#include "check.h"
#include "file_store.h"

namespace pystronghold {

namespace {

struct RecordMeta {  // at offset 0 of the record's zero-filled 4096-byte meta page
  char magic[8];
  uint32_t version;
  uint32_t reserved;
  int64_t block;
  int64_t record_bytes;
  uint64_t sequence;
  uint32_t checksum;
  uint32_t meta_crc;  // CRC32C of the bytes before this field
};
static_assert(offsetof(RecordMeta, meta_crc) == 44, "record meta layout changed");
constexpr char kRecordMagic[8] = {'P', 'S', 'R', 'E', 'C', 'O', 'R', 'D'};

int64_t round_up(int64_t n) { return (n + kStoreAlign - 1) / kStoreAlign * kStoreAlign; }

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kStoreAlign == 0; }

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

std::string hint(bool direct, int err) {
  return direct && err == EINVAL ? " [O_DIRECT needs 4096-aligned offset, size and buffer]" : "";
}

void pwrite_all(int fd, const char* buf, int64_t len, int64_t offset, const std::string& path, bool direct) {
  int64_t done = 0;
  while (done < len) {
    const ssize_t n = ::pwrite(fd, buf + done, static_cast<size_t>(len - done), offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : ENOSPC;  // a 0-byte write makes no progress: treat as full
      CopyFailure f = io_failure("write to", err, path, offset, len);
      f.message += hint(direct, err);
      if (done > 0) f.message += " (" + std::to_string(done) + " bytes were written first)";
      throw f;
    }
    done += n;
  }
}

void pread_all(int fd, char* buf, int64_t len, int64_t offset, const std::string& path, bool direct) {
  int64_t done = 0;
  while (done < len) {
    const ssize_t n = ::pread(fd, buf + done, static_cast<size_t>(len - done), offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      CopyFailure f = io_failure("read from", errno, path, offset, len);
      f.message += hint(direct, f.err);
      throw f;
    }
    if (n == 0) {
      CopyFailure f = io_failure("short read from", 0, path, offset, len);
      f.message += ": end of file after " + std::to_string(done) + " bytes (the file was truncated?)";
      throw f;
    }
    done += n;
  }
}

}  // namespace

void RecordFile::write_bytes(const char* host, int64_t len, int64_t file_offset, WorkerContext& ctx) {
  if (!direct_ || (aligned(host) && len % kStoreAlign == 0)) {
    pwrite_all(fd_, host, len, file_offset, path_, direct_);
    return;
  }
  const int64_t padded = round_up(len);
  char* bounce = static_cast<char*>(ctx.ensure_bounce(padded));
  std::memcpy(bounce, host, static_cast<size_t>(len));
  std::memset(bounce + len, 0, static_cast<size_t>(padded - len));
  pwrite_all(fd_, bounce, padded, file_offset, path_, direct_);
}

void RecordFile::read_bytes(char* host, int64_t len, int64_t file_offset, WorkerContext& ctx) {
  if (!direct_ || (aligned(host) && len % kStoreAlign == 0)) {
    pread_all(fd_, host, len, file_offset, path_, direct_);
    return;
  }
  const int64_t padded = round_up(len);
  char* bounce = static_cast<char*>(ctx.ensure_bounce(padded));
  pread_all(fd_, bounce, padded, file_offset, path_, direct_);
  std::memcpy(host, bounce, static_cast<size_t>(len));
}

void RecordFile::check_request(int64_t block, const RecordBuffer& buffer, const char* what) {
  const std::string who = std::string("FileStore.") + what + "(state '" + layout_.state + "', block " +
                          std::to_string(block) + ")";
  PS_CHECK(block >= 0 && block < layout_.num_blocks, who, ": block must be in [0, ", layout_.num_blocks - 1, "]");
  PS_CHECK(buffer.host_contiguous, who, ": the tensor must be a contiguous cpu tensor");
  PS_CHECK(buffer.nbytes == layout_.record_bytes, who, ": the tensor holds ", buffer.nbytes,
           " bytes, but records of this state hold ", layout_.record_bytes, " bytes");
  PS_CHECK(!closed_, who, ": the store is closed");
}

std::shared_ptr<Request> RecordFile::write(int64_t block, const RecordBuffer& src) {
  uint64_t sequence = 0;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    check_request(block, src, "write");
    PS_CHECK(read_only_reason_.empty(), "FileStore.write(state '", layout_.state, "', block ", block,
             "): the store is read-only (", read_only_reason_, ")");
    sequence = ++sequence_;
  }
  auto self = shared_from_this();
  const int64_t slot = layout_.slot_offset(block);
  const int64_t nseg = (layout_.record_bytes + layout_.segment_bytes - 1) / layout_.segment_bytes;
  auto segs = std::make_shared<std::vector<uint32_t>>(static_cast<size_t>(nseg), 0u);
  const char* host = static_cast<const char*>(src.data);
  auto req = std::make_shared<Request>();
  req->nbytes = layout_.record_bytes;
  req->chunk_bytes = layout_.segment_bytes;
  req->run_chunk = [self, segs, host, slot](int64_t offset, int64_t len, int64_t chunk, WorkerContext& ctx) {
    (*segs)[static_cast<size_t>(chunk)] = crc32c(host + offset, len);
    self->write_bytes(host + offset, len, slot + kStoreAlign + offset, ctx);
  };
  req->finalize = [self, segs, slot, block, sequence](WorkerContext& ctx) {
    RecordMeta meta{};
    std::memcpy(meta.magic, kRecordMagic, 8);
    meta.version = kStoreFormatVersion;
    meta.block = block;
    meta.record_bytes = self->layout_.record_bytes;
    meta.sequence = sequence;
    meta.checksum = crc32c(segs->data(), static_cast<int64_t>(segs->size() * sizeof(uint32_t)));
    meta.meta_crc = crc32c(&meta, offsetof(RecordMeta, meta_crc));
    char* page = static_cast<char*>(ctx.ensure_bounce(kStoreAlign));
    std::memset(page, 0, kStoreAlign);
    std::memcpy(page, &meta, sizeof(meta));
    pwrite_all(self->fd_, page, kStoreAlign, slot, self->path_, self->direct_);
  };
  req->keep_alive = src.keep_alive;
  return req;
}

std::shared_ptr<Request> RecordFile::read(int64_t block, const RecordBuffer& dst) {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    check_request(block, dst, "read");
  }
  auto self = shared_from_this();
  const int64_t slot = layout_.slot_offset(block);
  const int64_t nseg = (layout_.record_bytes + layout_.segment_bytes - 1) / layout_.segment_bytes;
  auto segs = std::make_shared<std::vector<uint32_t>>(static_cast<size_t>(nseg), 0u);
  char* host = static_cast<char*>(dst.data);
  auto req = std::make_shared<Request>();
  req->nbytes = layout_.record_bytes;
  req->chunk_bytes = layout_.segment_bytes;
  req->run_chunk = [self, segs, host, slot](int64_t offset, int64_t len, int64_t chunk, WorkerContext& ctx) {
    self->read_bytes(host + offset, len, slot + kStoreAlign + offset, ctx);
    (*segs)[static_cast<size_t>(chunk)] = crc32c(host + offset, len);
  };
  req->finalize = [self, segs, slot, block](WorkerContext& ctx) {
    const RecordLayout& layout = self->layout_;
    char* page = static_cast<char*>(ctx.ensure_bounce(kStoreAlign));
    pread_all(self->fd_, page, kStoreAlign, slot, self->path_, self->direct_);
    RecordMeta meta;
    std::memcpy(&meta, page, sizeof(meta));
    const std::string what = "record of state '" + layout.state + "', block " + std::to_string(block) +
                             ", in " + self->path_ + " at offset " + std::to_string(slot) + ", size " +
                             std::to_string(layout.record_bytes) + " bytes";
    auto failure = [&](const std::string& why) {
      return CopyFailure{"FileStore: " + what + ": " + why, 0, self->path_, slot, layout.record_bytes};
    };
    static const char zeros[sizeof(RecordMeta)] = {};
    if (std::memcmp(page, zeros, sizeof(RecordMeta)) == 0) throw failure("was never written");
    if (std::memcmp(meta.magic, kRecordMagic, 8) != 0 || meta.meta_crc != crc32c(&meta, offsetof(RecordMeta, meta_crc))) {
      throw failure("its record header is corrupt");
    }
    if (meta.block != block || meta.record_bytes != layout.record_bytes || meta.version != kStoreFormatVersion) {
      throw failure("its record header names block " + std::to_string(meta.block) + ", " +
                    std::to_string(meta.record_bytes) + " bytes, version " + std::to_string(meta.version));
    }
    const uint32_t got = crc32c(segs->data(), static_cast<int64_t>(segs->size() * sizeof(uint32_t)));
    if (got != meta.checksum) {
      throw failure("checksum mismatch (stored " + hex32(meta.checksum) + ", read " + hex32(got) +
                    "): the record is corrupt, the bytes read must not be used");
    }
  };
  req->keep_alive = dst.keep_alive;
  return req;
}

}  // namespace pystronghold
