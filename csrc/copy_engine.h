// The asynchronous copy engine: queues of requests served by worker threads, each request cut
// into chunks so a large copy uses every thread and a small one costs one queue hop.
//
// Threading model (no Python object is ever touched by a worker thread):
//   * One engine mutex guards the ready list, the per-queue tails and every request's scheduling
//     fields (pending, dependents, claimed/finished chunk counts).
//   * A request becomes ready when the previous request of its queue and every `after` request
//     have finished. Ready requests sit in one FIFO; a worker claims the next chunk of the front
//     request, runs it unlocked, and the worker that finishes the last chunk runs the request's
//     finaliser (if any), records the end time and wakes the waiters and dependents.
//   * Completion is signalled on the request's own mutex/condvar, so a handle can be waited on
//     after its engine is gone.
#pragma once

// NOTE: plain C++, no torch header: the scheduler and the file tier compile in seconds. The
// tensors a request moves are held by the binding (module.cpp) through `keep_alive`.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

// NOTE: hidden like pybind11's own types, so binding these classes raises no -Wattributes warning.
#pragma GCC visibility push(hidden)
namespace pystronghold {

// Seconds on CLOCK_MONOTONIC (the clock of Python's time.monotonic()).
double monotonic_s();

// An error of one request, with what the caller needs to find it: the file (or buffer), the byte
// offset in it and the size of the failed transfer. Thrown by chunk functions, stored on the request.
struct CopyFailure {
  std::string message;  // full human-readable message
  int err = 0;          // errno (0 when not a system call failure)
  std::string path;     // file path or buffer description
  int64_t offset = -1;  // byte offset in `path`, -1 when not applicable
  int64_t size = -1;    // bytes of the failed transfer, -1 when not applicable
};

// Builds a CopyFailure for a failed system call: "<what> <path> at offset X, size Y: strerror".
CopyFailure io_failure(const std::string& what, int err, const std::string& path, int64_t offset,
                       int64_t size);

// Per-worker-thread scratch: an aligned bounce buffer (file I/O with O_DIRECT on unaligned host
// memory) grown on demand, and an index the CUDA side uses to pick the worker's stream.
struct WorkerContext {
  int index = 0;
  void* bounce = nullptr;
  int64_t bounce_bytes = 0;
  void* cuda_state = nullptr;  // owned by the CUDA backend (streams, pinned staging)
  void* ensure_bounce(int64_t nbytes);  // >= nbytes, 4096-aligned
  ~WorkerContext();
};

struct Request {
  using ChunkFn = std::function<void(int64_t offset, int64_t len, int64_t chunk, WorkerContext&)>;
  using FinalFn = std::function<void(WorkerContext&)>;

  // Set at submission, then read-only.
  uint64_t engine_id = 0;
  int queue = 0;
  int64_t nbytes = 0;
  int64_t chunk_bytes = 1;
  int64_t nchunks = 1;
  ChunkFn run_chunk;
  FinalFn finalize;                   // runs once, after every chunk succeeded
  std::shared_ptr<void> keep_alive;   // what the request reads or writes (the binding's tensors)

  // Guarded by the engine mutex.
  int pending = 0;  // unfinished requests this one waits for
  // Requests waiting for this one; `true` marks an `after` dependency (a failure propagates),
  // `false` mere queue order (the next request still runs).
  std::vector<std::pair<std::shared_ptr<Request>, bool>> dependents;
  int64_t next_chunk = 0;
  int64_t chunks_finished = 0;
  bool finished = false;
  bool cancelled = false;

  // Written by the workers; read after `done`.
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  CopyFailure error;
  std::atomic<double> start_s{0.0};  // when the first chunk was claimed (0: not started)
  std::atomic<double> end_s{0.0};    // when the request finished (0: not finished)

  // Completion, on the request's own lock.
  std::mutex done_mutex;
  std::condition_variable done_cv;
  bool done = false;

  void fail(CopyFailure failure);       // keeps the first failure
  bool wait(double timeout_s);          // true when done; timeout_s < 0: no limit. GIL not touched.
  bool is_done();
};

class CopyEngine {
 public:
  CopyEngine(int threads, int queues, int64_t chunk_bytes);
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // Queues `req` after the last request of its queue and after `after`; returns it.
  std::shared_ptr<Request> submit(std::shared_ptr<Request> req,
                                  const std::vector<std::shared_ptr<Request>>& after);
  // wait=true: let every queued request run, then stop the threads. wait=false: requests not yet
  // started fail as cancelled; running chunks finish. Idempotent.
  void close(bool wait);
  bool closed() const { return closed_.load(); }

  int threads() const { return static_cast<int>(workers_.size()); }
  int queues() const { return queues_; }
  int64_t chunk_bytes() const { return chunk_bytes_; }
  uint64_t id() const { return id_; }

 private:
  void worker_main(int index);
  void finish_locked(const std::shared_ptr<Request>& req, std::unique_lock<std::mutex>& lock);
  void release_dependents_locked(const std::shared_ptr<Request>& req);

  const uint64_t id_;
  const int queues_;
  const int64_t chunk_bytes_;
  std::mutex close_mutex_;  // one close() at a time (joins the threads)
  std::mutex mutex_;
  std::condition_variable work_cv_;  // a request became ready, or stopping
  std::condition_variable idle_cv_;  // a request finished (close(wait) waits on it)
  std::deque<std::shared_ptr<Request>> ready_;
  std::vector<std::shared_ptr<Request>> tails_;  // last request submitted per queue
  int64_t in_flight_ = 0;                        // submitted, not finished
  std::unordered_set<Request*> live_;            // the same requests (close(wait=false) cancels)
  std::atomic<bool> closed_{false};
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

// Host-to-host copy request of `nbytes` from `src` to `dst` (raw pointers kept alive by tensors).
std::shared_ptr<Request> make_memcpy_request(void* dst, const void* src, int64_t nbytes,
                                             int64_t chunk_bytes);

}  // namespace pystronghold
#pragma GCC visibility pop
