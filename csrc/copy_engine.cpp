// The copy engine's scheduler: submission, dependencies, chunk claiming, completion, shutdown.
// See copy_engine.h for the threading model.
#include "copy_engine.h"

#include "check.h"

#if defined(PYSTRONGHOLD_WITH_CUDA)
#include "copy_engine_cuda.h"
#endif

#include <time.h>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>

namespace pystronghold {

double monotonic_s() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

CopyFailure io_failure(const std::string& what, int err, const std::string& path, int64_t offset,
                       int64_t size) {
  // NOTE: std::string and std::to_string, never a stream (docs/DESIGN.md, "No iostreams in csrc/").
  std::string msg = what + " " + path + " at offset " + std::to_string(offset) + ", size " +
                    std::to_string(size) + " bytes";
  if (err != 0) msg += std::string(": ") + std::strerror(err) + " (errno " + std::to_string(err) + ")";
  return CopyFailure{msg, err, path, offset, size};
}

// ---- worker scratch

void* WorkerContext::ensure_bounce(int64_t nbytes) {
  if (bounce_bytes >= nbytes) return bounce;
  std::free(bounce);
  bounce = nullptr;
  bounce_bytes = 0;
  const int64_t rounded = (nbytes + 4095) / 4096 * 4096;
  void* p = nullptr;
  if (posix_memalign(&p, 4096, static_cast<size_t>(rounded)) != 0) {
    throw CopyFailure{"copy engine: could not allocate a " + std::to_string(rounded) +
                      "-byte aligned bounce buffer", ENOMEM, "", -1, rounded};
  }
  bounce = p;
  bounce_bytes = rounded;
  return bounce;
}

WorkerContext::~WorkerContext() {
#if defined(PYSTRONGHOLD_WITH_CUDA)
  cuda::release_worker_state(&cuda_state);
#endif
  std::free(bounce);
}

// ---- request

void Request::fail(CopyFailure failure) {
  std::lock_guard<std::mutex> guard(error_mutex);
  if (failed.load()) return;  // the first failure is the one reported
  error = std::move(failure);
  failed.store(true);
}

bool Request::wait(double timeout_s) {
  std::unique_lock<std::mutex> lock(done_mutex);
  if (timeout_s < 0) {
    done_cv.wait(lock, [&] { return done; });
    return true;
  }
  return done_cv.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return done; });
}

bool Request::is_done() {
  std::lock_guard<std::mutex> guard(done_mutex);
  return done;
}

// ---- engine

static std::atomic<uint64_t> next_engine_id{1};

CopyEngine::CopyEngine(int threads, int queues, int64_t chunk_bytes)
    : id_(next_engine_id.fetch_add(1)), queues_(queues), chunk_bytes_(chunk_bytes) {
  PS_CHECK(threads >= 1 && threads <= 256, "CopyEngine: threads must be in [1, 256], got ", threads);
  PS_CHECK(queues >= 1 && queues <= 4096, "CopyEngine: queues must be in [1, 4096], got ", queues);
  PS_CHECK(chunk_bytes >= 4096, "CopyEngine: chunk_bytes must be >= 4096 bytes, got ", chunk_bytes);
  tails_.resize(static_cast<size_t>(queues));
  workers_.reserve(static_cast<size_t>(threads));
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this, i] { worker_main(i); });
}

CopyEngine::~CopyEngine() { close(/*wait=*/true); }

std::shared_ptr<Request> CopyEngine::submit(std::shared_ptr<Request> req,
                                            const std::vector<std::shared_ptr<Request>>& after) {
  PS_CHECK(req->queue >= 0 && req->queue < queues_, "CopyEngine: queue must be in [0, ",
           queues_ - 1, "], got ", req->queue);
  PS_CHECK(req->nbytes >= 0, "CopyEngine: negative request size ", req->nbytes);
  PS_CHECK(req->chunk_bytes >= 1, "CopyEngine: chunk size must be >= 1 byte");
  req->nchunks = std::max<int64_t>(1, (req->nbytes + req->chunk_bytes - 1) / req->chunk_bytes);
  std::unique_lock<std::mutex> lock(mutex_);
  PS_CHECK(!closed_.load(), "CopyEngine is closed: it accepts no new requests");
  req->engine_id = id_;
  req->pending = 0;
  for (const auto& dep : after) {
    PS_CHECK(dep != nullptr, "CopyEngine: `after` holds a null handle");
    PS_CHECK(dep->engine_id == id_, "CopyEngine: an `after` handle belongs to another engine");
    if (!dep->finished) {
      dep->dependents.emplace_back(req, true);
      ++req->pending;
    } else if (dep->failed.load()) {
      req->fail(CopyFailure{"not run: a request it waits for (`after`) failed: " + dep->error.message,
                            dep->error.err, dep->error.path, dep->error.offset, dep->error.size});
    }
  }
  auto& tail = tails_[static_cast<size_t>(req->queue)];
  if (tail && !tail->finished) {
    tail->dependents.emplace_back(req, false);
    ++req->pending;
  }
  tail = req;
  ++in_flight_;
  live_.insert(req.get());
  if (req->pending == 0) {
    ready_.push_back(req);
    if (req->nchunks > 1) work_cv_.notify_all(); else work_cv_.notify_one();
  }
  return req;
}

void CopyEngine::release_dependents_locked(const std::shared_ptr<Request>& req) {
  bool woke = false;
  for (auto& [dep, strict] : req->dependents) {
    if (strict && req->failed.load()) {
      dep->fail(CopyFailure{"not run: a request it waits for (`after`) failed: " + req->error.message,
                            req->error.err, req->error.path, req->error.offset, req->error.size});
    }
    if (--dep->pending == 0) {
      ready_.push_back(dep);
      woke = true;
    }
  }
  req->dependents.clear();
  if (woke) work_cv_.notify_all();
}

void CopyEngine::finish_locked(const std::shared_ptr<Request>& req, std::unique_lock<std::mutex>& lock) {
  req->finished = true;
  req->end_s.store(monotonic_s());
  if (req->start_s.load() == 0.0) req->start_s.store(req->end_s.load());
  release_dependents_locked(req);
  auto& tail = tails_[static_cast<size_t>(req->queue)];
  if (tail == req) tail.reset();
  live_.erase(req.get());
  // NOTE: the tensors are released outside the engine lock (a storage deleter may take the GIL)
  // and before `done`, so a waiter that returns knows the request holds nothing any more.
  std::shared_ptr<void> held;
  held.swap(req->keep_alive);
  Request::ChunkFn chunk_fn;
  Request::FinalFn final_fn;
  chunk_fn.swap(req->run_chunk);
  final_fn.swap(req->finalize);
  lock.unlock();
  held.reset();
  chunk_fn = nullptr;
  final_fn = nullptr;
  {
    std::lock_guard<std::mutex> guard(req->done_mutex);
    req->done = true;
  }
  req->done_cv.notify_all();
  lock.lock();
  --in_flight_;
  idle_cv_.notify_all();
}

void CopyEngine::worker_main(int index) {
  WorkerContext ctx;
  ctx.index = index;
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    work_cv_.wait(lock, [&] { return stopping_ || !ready_.empty(); });
    if (ready_.empty()) break;  // stopping and nothing left
    std::shared_ptr<Request> req = ready_.front();
    const int64_t chunk = req->next_chunk++;
    if (chunk == 0) req->start_s.store(monotonic_s());
    if (req->next_chunk >= req->nchunks) ready_.pop_front();
    lock.unlock();
    if (!req->failed.load()) {
      const int64_t offset = chunk * req->chunk_bytes;
      const int64_t len = std::min(req->chunk_bytes, req->nbytes - offset);
      try {
        req->run_chunk(offset, len, chunk, ctx);
      } catch (const CopyFailure& failure) {
        req->fail(failure);
      } catch (const std::exception& exc) {
        req->fail(CopyFailure{exc.what(), 0, "", offset, len});
      }
    }
    lock.lock();
    if (++req->chunks_finished == req->nchunks) {
      if (req->finalize && !req->failed.load()) {
        lock.unlock();
        try {
          req->finalize(ctx);
        } catch (const CopyFailure& failure) {
          req->fail(failure);
        } catch (const std::exception& exc) {
          req->fail(CopyFailure{exc.what(), 0, "", -1, req->nbytes});
        }
        lock.lock();
      }
      finish_locked(req, lock);
    }
  }
}

void CopyEngine::close(bool wait) {
  std::lock_guard<std::mutex> closing(close_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  closed_.store(true);
  if (!wait) {
    for (Request* req : live_) {
      req->fail(CopyFailure{"cancelled: CopyEngine.close(wait=False) was called before the request ran",
                            ECANCELED, "", -1, req->nbytes});
    }
  }
  idle_cv_.wait(lock, [&] { return in_flight_ == 0; });
  stopping_ = true;
  lock.unlock();
  work_cv_.notify_all();
  for (auto& worker : workers_) {
    if (worker.joinable()) worker.join();
  }
}

// ---- host-to-host chunk copy

#if defined(__x86_64__)
// Large chunks: non-temporal (streaming) stores, so the destination is not read into the cache
// before being overwritten (no read-for-ownership) and the copy does not evict the working set.
// glibc's memcpy does the same only above a size threshold larger than our chunks.
static void copy_streaming(char* dst, const char* src, int64_t n) {
  const int64_t head = static_cast<int64_t>((16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15);
  std::memcpy(dst, src, static_cast<size_t>(head));
  dst += head;
  src += head;
  n -= head;
  const int64_t body = n & ~int64_t{63};
  for (int64_t i = 0; i < body; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  _mm_sfence();  // streaming stores are weakly ordered: complete them before the chunk counts as done
  std::memcpy(dst + body, src + body, static_cast<size_t>(n - body));
}
#endif

// Copies n bytes (no overlap): streaming stores from 1 MiB up on x86-64, memcpy below.
static void copy_bytes(void* dst, const void* src, int64_t n) {
#if defined(__x86_64__)
  constexpr int64_t kStreamingFrom = 1 << 20;
  if (n >= kStreamingFrom) {
    copy_streaming(static_cast<char*>(dst), static_cast<const char*>(src), n);
    return;
  }
#endif
  std::memcpy(dst, src, static_cast<size_t>(n));
}

std::shared_ptr<Request> make_memcpy_request(void* dst, const void* src, int64_t nbytes,
                                             int64_t chunk_bytes) {
  auto req = std::make_shared<Request>();
  req->nbytes = nbytes;
  req->chunk_bytes = chunk_bytes;
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  req->run_chunk = [d, s](int64_t offset, int64_t len, int64_t, WorkerContext&) {
    copy_bytes(d + offset, s + offset, len);
  };
  return req;
}

}  // namespace pystronghold
