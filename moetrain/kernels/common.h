// Shared by the moetrain CPU kernels: the thread count, a persistent worker pool that hands out tasks
// dynamically, even splits of work units, shape helpers.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

namespace moetrain {

// MOETRAIN_KERNEL_THREADS, default: the hardware threads.
inline int NumThreads() {
  static const int threads = [] {
    const char *env = std::getenv("MOETRAIN_KERNEL_THREADS");
    int n = env ? std::atoi(env) : static_cast<int>(std::thread::hardware_concurrency());
    return std::max(1, n);
  }();
  return threads;
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// NumThreads() - 1 workers started once per process; the calling thread is the last participant. A
// call hands out tasks 0..n-1 through an atomic counter, so a thread slowed by something else on its
// core (another process, the MindSpore runtime's own threads) takes fewer tasks instead of holding the
// others up, and no thread is created per call. Which thread runs a task never changes a result: a
// task writes only its own outputs (partial sums are kept per task and added in task order), and
// per-thread scratch is indexed by `slot`. Waiting threads spin a few microseconds, then sleep.
class Pool {
 public:
  using Invoke = void (*)(void *context, int64_t task, int slot);

  // The pool of this process (a child of fork() gets a fresh one: the parent's workers are not there).
  static Pool &Instance() {
    static std::atomic<Pool *> pool{nullptr};
    static std::mutex creating;
    Pool *p = pool.load(std::memory_order_acquire);
    if (p == nullptr || p->pid_ != getpid()) {
      std::lock_guard<std::mutex> lock(creating);
      p = pool.load(std::memory_order_acquire);
      if (p == nullptr || p->pid_ != getpid()) {
        p = new Pool(NumThreads());   // never deleted: workers must not outlive it at process exit
        pool.store(p, std::memory_order_release);
      }
    }
    return *p;
  }

  int slots() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs invoke(context, task, slot) for every task in [0, tasks), slot in [0, slots()); returns
  // when all are done. A call made while another is running (two MindSpore threads at once, or from
  // inside a task) runs its tasks on the calling thread, slot 0 of its own scratch.
  void Run(int64_t tasks, Invoke invoke, void *context) {
    if (tasks <= 0) return;
    std::unique_lock<std::mutex> busy(run_mutex_, std::defer_lock);
    if (tasks == 1 || workers_.empty() || InTask() || !busy.try_lock()) {
      for (int64_t t = 0; t < tasks; ++t) invoke(context, t, 0);
      return;
    }
    invoke_ = invoke;
    context_ = context;
    tasks_ = tasks;
    next_.store(0, std::memory_order_relaxed);
    pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(wake_mutex_);
      wake_.notify_all();
    }
    Work(static_cast<int>(workers_.size()));   // the caller is the last slot
    // Wait for every worker to leave this job (they read its fields until then).
    if (!SpinUntil([&] { return pending_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock<std::mutex> lock(done_mutex_);
      done_.wait(lock, [&] { return pending_.load(std::memory_order_acquire) == 0; });
    }
  }

 private:
  explicit Pool(int threads) : pid_(getpid()) {
    for (int i = 0; i + 1 < threads; ++i) workers_.emplace_back(&Pool::Loop, this, i);
    for (auto &w : workers_) w.detach();
  }

  // Spins a few microseconds (64 pauses); false if `ready` did not become true. A 50 us spin made no
  // measurable difference to one process's step (paired ratios 0.977 and 1.013, both libraries
  // alternating), and a spinning worker takes the core from whatever else is runnable: MindSpore's
  // threads, other ranks on the same host.
  template <typename Ready>
  static bool SpinUntil(Ready ready) {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return true;
      CpuRelax();
    }
    return ready();
  }

  // True on a thread running a task of this pool (a nested call then runs inline).
  static bool &InTask() {
    static thread_local bool in_task = false;
    return in_task;
  }

  void Work(int slot) {
    InTask() = true;
    for (int64_t t; (t = next_.fetch_add(1, std::memory_order_relaxed)) < tasks_;) invoke_(context_, t, slot);
    InTask() = false;
  }

  void Loop(int slot) {
    uint64_t seen = 0;
    for (;;) {
      auto started = [&] { return generation_.load(std::memory_order_seq_cst) != seen; };
      if (!SpinUntil(started)) {
        std::unique_lock<std::mutex> lock(wake_mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, started);
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      seen = generation_.load(std::memory_order_acquire);
      Work(slot);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(done_mutex_);   // the caller may be about to sleep on `done_`
        done_.notify_one();
      }
    }
  }

  const pid_t pid_;
  std::vector<std::thread> workers_;
  std::mutex run_mutex_, wake_mutex_, done_mutex_;
  std::condition_variable wake_, done_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleepers_{0}, pending_{0};
  std::atomic<int64_t> next_{0};
  Invoke invoke_ = nullptr;
  void *context_ = nullptr;
  int64_t tasks_ = 0;
};

// Threads that may run a ParallelFor at once (per-slot scratch is sized by this).
inline int Slots() { return Pool::Instance().slots(); }

// fn(task, slot) for every task in [0, tasks), on the pool; see Pool for what may depend on `slot`.
template <typename Fn>
void ParallelFor(int64_t tasks, Fn fn) {
  Pool::Instance().Run(
      tasks, [](void *context, int64_t task, int slot) { (*static_cast<Fn *>(context))(task, slot); }, &fn);
}

// How many parts to split `units` into: at most NumThreads(), at least `min_units` units a part.
inline int PartsFor(int64_t units, int64_t min_units) {
  return static_cast<int>(std::min<int64_t>(NumThreads(), std::max<int64_t>(1, units / min_units)));
}

// Tasks for `units` of work to balance over the threads: about `per_thread` a thread, each of at
// least `min_units` units.
inline int TasksFor(int64_t units, int64_t min_units, int per_thread = 4) {
  return static_cast<int>(std::min<int64_t>(int64_t{NumThreads()} * per_thread, std::max<int64_t>(1, units / min_units)));
}

// fn(part, begin, end) for `parts` even splits of [0, units), run as pool tasks (part = task).
template <typename Fn>
void ParallelSplit(int64_t units, int parts, Fn fn) {
  ParallelFor(parts, [&](int64_t part, int) { fn(static_cast<int>(part), units * part / parts, units * (part + 1) / parts); });
}

inline bool Float32(const char *dtype) { return std::strcmp(dtype, "float32") == 0; }

// Rows of a tensor whose leading dimensions are flattened: the product of all but the last.
inline int64_t Rows(int ndim, const int64_t *shape) {
  int64_t rows = 1;
  for (int i = 0; i + 1 < ndim; ++i) rows *= shape[i];
  return rows;
}

// Elements of a tensor.
inline int64_t Size(int ndim, const int64_t *shape) {
  int64_t size = 1;
  for (int i = 0; i < ndim; ++i) size *= shape[i];
  return size;
}

}  // namespace moetrain
