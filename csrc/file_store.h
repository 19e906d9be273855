// The file tier: one preallocated file of fixed-size records per state (master, exp_avg, ...),
// one record per block, read and written as copy-engine requests.
//
// On-disk layout of one file (all integers little-endian; every offset a multiple of 4096):
//   [0, 4096)            header: magic "PSTRSTOR", format version, layout (num_blocks,
//                        record_bytes, slot_bytes, data_offset, segment_bytes, checksum kind),
//                        state name, CRC32C of the header
//   data_offset + i * slot_bytes, for block i:
//     [+0, +4096)         record meta: magic "PSRECORD", block, record_bytes, write sequence,
//                         record checksum, CRC32C of the meta. All zero until the first write.
//     [+4096, +slot)      payload: record_bytes bytes, zero-padded to a multiple of 4096
// Record checksum: the payload is cut into segments of segment_bytes; each segment's CRC32C is
// computed by the worker that moves it, and the record checksum is the CRC32C of the array of
// segment CRCs (so a record's chunks are checksummed in parallel). The meta is written after the
// whole payload, by the worker that finishes the request; reads verify it after the payload.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "copy_engine.h"
#include "file_store_crc.h"

// NOTE: hidden like pybind11's own types, so binding these classes raises no -Wattributes warning.
#pragma GCC visibility push(hidden)
namespace pystronghold {

constexpr uint32_t kStoreFormatVersion = 1;
constexpr int64_t kStoreAlign = 4096;

struct RecordLayout {
  int64_t num_blocks = 0;
  int64_t record_bytes = 0;
  int64_t segment_bytes = 0;
  int64_t slot_bytes = 0;   // 4096 (meta) + record_bytes rounded up to 4096
  int64_t data_offset = kStoreAlign;
  std::string state;
  int64_t file_bytes() const { return data_offset + num_blocks * slot_bytes; }
  int64_t slot_offset(int64_t block) const { return data_offset + block * slot_bytes; }
};

// The host buffer of one record read or write, as the binding found it (a tensor, in module.cpp):
// `host_contiguous` when it is one contiguous run of host memory; `keep_alive` holds it until the
// request ends.
struct RecordBuffer {
  void* data = nullptr;
  int64_t nbytes = 0;
  bool host_contiguous = false;
  std::shared_ptr<void> keep_alive;
};

class RecordFile : public std::enable_shared_from_this<RecordFile> {
 public:
  // Creates `path` (must not exist), writes the header, preallocates (or sizes sparsely) the file.
  // direct: "auto" (O_DIRECT when the file system takes it, else buffered with a reason),
  // "always" (O_DIRECT or fail), "never".
  static std::shared_ptr<RecordFile> create(const std::string& path, const RecordLayout& layout,
                                            const std::string& direct, bool preallocate);
  // Opens an existing file; refuses a foreign or incompatible header with a clear message. Where
  // the file cannot be opened for writing (read-only file system or permissions) it opens
  // read-only: reads work, writes are refused naming the reason.
  static std::shared_ptr<RecordFile> open(const std::string& path, const std::string& direct);
  ~RecordFile();

  std::shared_ptr<Request> write(int64_t block, const RecordBuffer& src);
  std::shared_ptr<Request> read(int64_t block, const RecordBuffer& dst);
  void flush();  // fsync: every completed write becomes durable
  void close();  // refuses further requests; the descriptor closes when the last request ends

  const RecordLayout& layout() const { return layout_; }
  const std::string& path() const { return path_; }
  bool direct() const { return direct_; }
  const std::string& direct_note() const { return direct_note_; }
  const std::string& read_only_reason() const { return read_only_reason_; }  // empty: writable

  // I/O helpers used by the request chunks (throw CopyFailure naming path, offset, size).
  void write_bytes(const char* host, int64_t len, int64_t file_offset, WorkerContext& ctx);
  void read_bytes(char* host, int64_t len, int64_t file_offset, WorkerContext& ctx);

 private:
  RecordFile(std::string path, int fd, bool direct, std::string note, RecordLayout layout,
             std::string read_only_reason)
      : path_(std::move(path)), fd_(fd), direct_(direct), direct_note_(std::move(note)),
        layout_(std::move(layout)), read_only_reason_(std::move(read_only_reason)) {}
  void check_request(int64_t block, const RecordBuffer& buffer, const char* what);

  const std::string path_;
  const int fd_;
  const bool direct_;
  const std::string direct_note_;
  const RecordLayout layout_;
  const std::string read_only_reason_;
  std::mutex mutex_;
  bool closed_ = false;
  uint64_t sequence_ = 0;  // writes issued, stored in each record's meta
};

}  // namespace pystronghold
#pragma GCC visibility pop
