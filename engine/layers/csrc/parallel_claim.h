// Shared by the CPU kernels (copied next to each source when it is built).
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

// The kernels' own thread pool.  An OpenMP region ends at a barrier that every
// thread of the team must reach, so on a small machine, where the frontend, the
// gRPC threads and the benchmark client share the cores, a step waits for the
// OS to schedule a thread it preempted even when the caller could have done
// that thread's share itself.  Here the caller claims pieces like any worker;
// once every piece is claimed and done it returns, waiting only for workers
// that are running a piece.  A worker that wakes late finds the job closed and
// goes back to sleep without touching it.
//
// Each thread of a job owns an even, contiguous share of [0, n) and claims its
// pieces from the front of it; a thread whose share is done claims the others'
// from their back ends.  So a thread walks its memory in order (a kernel's
// pieces are consecutive panels), and its claims touch a cache line no other
// core writes until the shares run out.  One counter for all (the pieces dealt
// out alternately) kept both cores' prefetchers on short, interleaved runs and
// moved that counter's line between them at every claim: on a Zen 4 (family 25
// model 17) a bfloat16 model's decode step of one sequence 0.97x, of 8 0.93x,
// of 32 0.97x the time (interleaved in one process).
//
// One pool per process, one job at a time: a second caller while a job runs
// (another Python thread) runs its job inline.  Each extension (.so) holds its
// own copy of this code, but the function-local statics below (the pool, the
// on switch, the spin time) are STB_GNU_UNIQUE symbols under GCC, which the
// dynamic linker makes one per process: the linear and the attention kernels
// share the workers (tests/unit/test_kernel_pool.py).  Two pools would each
// keep a worker spinning after its job on the core the other pool's job
// wants, and find it asleep by the next job (a layer's attention comes
// milliseconds after its projections).
// After fork() the child starts a new pool (the parent's threads are not in it).
// The loader enables it (engine/layers/cpu_attention.py) where OpenMP's idle
// threads sleep and SPLITSERVE_KERNEL_THREADS is not "omp" (an A/B); otherwise
// the jobs run on at::parallel_for.
// SPLITSERVE_KERNEL_SPIN_US sets how long an idle worker spins before it sleeps
// (200: a step's next kernel usually follows sooner).
namespace claim_pool {

using RunFn = void (*)(const void* ctx, int64_t begin, int64_t end);

// Pieces a thread took from another's share, since the process started
// (tests/unit/test_kernel_pool.py: a late worker's share is done by the caller).
inline std::atomic<uint64_t>& stolen() {
  static std::atomic<uint64_t> count{0};
  return count;
}

class Pool {
 public:
  static constexpr int kMaxThreads = 256;

  // Runs run(ctx, b, e) over [0, n) in pieces of `grain`, on up to `threads`
  // threads, the caller included.
  void run(int64_t n, int64_t grain, int threads, RunFn run, const void* ctx) {
    std::unique_lock<std::mutex> caller(caller_, std::try_to_lock);
    if (!caller.owns_lock() || n > kMaxTasks) {
      run(ctx, 0, n);
      return;
    }
    threads = std::min(threads, kMaxThreads);
    grow(threads - 1);
    fn_ = run;
    ctx_ = ctx;
    grain_ = grain;
    wanted_ = threads - 1;
    parts_ = threads;
    for (int i = 0; i < threads; ++i)  // thread i's share (the caller's is 0)
      shares_[i].range.store(pack(n * i / threads, n * (i + 1) / threads), std::memory_order_relaxed);
    open_.store(true, std::memory_order_seq_cst);
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      { std::lock_guard<std::mutex> lk(m_); }
      cv_.notify_all();
    }
    claim(0);
    open_.store(false, std::memory_order_seq_cst);
    // Only workers inside the job count here: each is running a piece.
    for (int spins = 0; active_.load(std::memory_order_acquire) != 0; ++spins) {
      if (spins < 4096) _mm_pause();
      else std::this_thread::yield();
    }
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  // A share's unclaimed pieces [front, back) in one word, so that its owner (at
  // the front) and a thief (at the back) never take the same piece.
  static constexpr int64_t kMaxTasks = 0xffffffff;
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | (static_cast<uint64_t>(back) << 32);
  }

  // A piece [lo, hi) of share i: from its front for its owner, else from its
  // back; false once the share is empty.
  bool take(int i, bool owner, int64_t& lo, int64_t& hi) {
    std::atomic<uint64_t>& range = shares_[i].range;
    uint64_t word = range.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(word & 0xffffffffu), back = static_cast<int64_t>(word >> 32);
      if (front >= back) return false;
      lo = owner ? front : std::max(back - grain_, front);
      hi = owner ? std::min(front + grain_, back) : back;
      const uint64_t rest = owner ? pack(hi, back) : pack(front, lo);
      if (range.compare_exchange_weak(word, rest, std::memory_order_acq_rel, std::memory_order_relaxed)) return true;
    }
  }

  // Thread `self`'s share in order, then the others' from their backs.  A piece
  // that throws stops the claiming; the caller rethrows the first error.
  void claim(int self) {
    try {
      int64_t lo = 0, hi = 0;
      for (int j = 0; j < parts_; ++j) {
        const int i = (self + j) % parts_;
        while (take(i, j == 0, lo, hi)) {
          if (j > 0) stolen().fetch_add(1, std::memory_order_relaxed);
          fn_(ctx_, lo, hi);
        }
      }
    } catch (...) {
      for (int i = 0; i < parts_; ++i) shares_[i].range.store(0, std::memory_order_relaxed);
      std::lock_guard<std::mutex> lk(error_m_);
      if (!error_) error_ = std::current_exception();
    }
  }

  void grow(int workers) {
    while (static_cast<int>(count_) < workers) {
      const int id = count_++;
      std::thread t([this, id] { work(id); });
      pthread_setname_np(t.native_handle(), "ss-kernel");  // in top, py-spy and /proc/PID/task
      t.detach();
    }
  }

  void work(int id) {
    uint64_t seen = epoch_.load(std::memory_order_acquire);
    for (;;) {
      // Spin a little (the next kernel of a step follows within microseconds),
      // then sleep until the next job.  The spin yields the core every few
      // microseconds: a serving thread waiting for one (SCHED_BATCH does not
      // preempt; services/sched_policy.py) runs in the gaps between a step's
      // kernels, where this worker has nothing to do, rather than at the next
      // tick on top of a kernel's piece.  With nothing else to run, the yield
      // returns at once.  Zen 4, decode32, alternating with the plain spin:
      // TPOT p50 median 38.8 against 39.4 ms and 39.7 against 40.9 over two
      // sets of runs; one stream 8.1 against 8.5 ms.
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us());
      uint64_t e = epoch_.load(std::memory_order_acquire);
      for (int i = 0; e == seen; ++i) {
        _mm_pause();
        e = epoch_.load(std::memory_order_acquire);
        if ((i & 63) == 63) {
          if (std::chrono::steady_clock::now() > until) break;
          sched_yield();
          e = epoch_.load(std::memory_order_acquire);
        }
      }
      if (e == seen) {
        std::unique_lock<std::mutex> lk(m_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait(lk, [&] { return epoch_.load(std::memory_order_seq_cst) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
        e = epoch_.load(std::memory_order_acquire);
      }
      seen = e;
      active_.fetch_add(1, std::memory_order_seq_cst);
      // Closed: the caller finished without this worker (its fields may already
      // be the next job's, which is fine to join once that one is open).
      if (open_.load(std::memory_order_seq_cst) && id < wanted_) claim(id + 1);
      active_.fetch_sub(1, std::memory_order_release);
    }
  }

  static int spin_us() {
    static const int us = [] {
      const char* v = std::getenv("SPLITSERVE_KERNEL_SPIN_US");
      return v ? std::atoi(v) : 200;
    }();
    return us;
  }
  std::mutex caller_;
  std::mutex m_, error_m_;
  std::exception_ptr error_;
  std::condition_variable cv_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<bool> open_{false};
  std::atomic<int> active_{0};
  std::atomic<int> sleepers_{0};
  struct alignas(64) Share {  // a line of its own: its owner's claims move no other core's line
    std::atomic<uint64_t> range{0};
  };
  Share shares_[kMaxThreads];
  RunFn fn_ = nullptr;
  const void* ctx_ = nullptr;
  int64_t grain_ = 1;
  int wanted_ = 0, parts_ = 1;
  unsigned count_ = 0;  // workers started (by the caller, under caller_)
};

inline Pool*& current() {
  static Pool* pool = nullptr;
  return pool;
}

inline void after_fork_in_child() { current() = nullptr; }  // the parent's pool is left as is

// Off until the loader turns it on (use_pool): only where OpenMP's idle threads
// sleep, or they spin on the cores the pool's workers need.
inline std::atomic<bool>& enabled() {
  static std::atomic<bool> on{false};
  return on;
}

inline Pool* pool() {
  if (!enabled().load(std::memory_order_relaxed)) return nullptr;
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(nullptr, nullptr, after_fork_in_child); });
  Pool*& p = current();
  if (p == nullptr) p = new Pool();  // never freed: detached workers use it until exit
  return p;
}

}  // namespace claim_pool

// Runs fn(begin, end) over [0, n) in pieces of `grain` that the threads claim
// as they go, rather than one fixed share each: a thread the OS preempts holds
// up the step by at most the piece it is running, not by its share.
template <typename F>
inline void parallel_claim(int64_t n, int64_t grain, const F& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  if (threads <= 1 || at::in_parallel_region()) {
    if (n > 0) fn(0, n);
    return;
  }
  if (claim_pool::Pool* p = claim_pool::pool()) {
    p->run(n, grain, static_cast<int>(threads),
           [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); }, &fn);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t begin = next.fetch_add(grain); begin < n; begin = next.fetch_add(grain))
      fn(begin, std::min(begin + grain, n));
  });
}
