// Shared by the moetrain CPU kernels: the thread count, an even split of work units, shape helpers.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
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

// How many parts to split `units` into: at most NumThreads(), at least `min_units` units a part.
inline int PartsFor(int64_t units, int64_t min_units) {
  return static_cast<int>(std::min<int64_t>(NumThreads(), std::max<int64_t>(1, units / min_units)));
}

// fn(part, begin, end) for `parts` even splits of [0, units); part 0 runs on the calling thread.
template <typename Fn>
void ParallelSplit(int64_t units, int parts, Fn fn) {
  if (parts <= 1) {
    fn(0, int64_t{0}, units);
    return;
  }
  std::vector<std::thread> workers;
  for (int p = 1; p < parts; ++p) workers.emplace_back(fn, p, units * p / parts, units * (p + 1) / parts);
  fn(0, int64_t{0}, units / parts);
  for (auto &w : workers) w.join();
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
