// A check of the kernel thread pool (common.h) that tests call through ctypes: `callers` threads at
// once each run ParallelFor over `tasks` tasks; every task must run exactly once per call and report
// a slot in [0, Slots()). Returns 0 when that held for every call, else the number of failed calls.
#include <atomic>
#include <thread>
#include <vector>

#include "common.h"

extern "C" int MoetrainPoolCheck(int callers, int tasks, int rounds) {
  std::atomic<int> failed{0};
  auto call = [&] {
    for (int r = 0; r < rounds; ++r) {
      std::vector<std::atomic<int>> runs(tasks);
      std::atomic<int> bad_slot{0};
      const int slots = moetrain::Slots();
      moetrain::ParallelFor(tasks, [&](int64_t t, int slot) {
        runs[t].fetch_add(1);
        if (slot < 0 || slot >= slots) bad_slot.fetch_add(1);
      });
      bool ok = bad_slot.load() == 0;
      for (auto &n : runs) ok = ok && n.load() == 1;
      if (!ok) failed.fetch_add(1);
    }
  };
  std::vector<std::thread> threads;
  for (int c = 1; c < callers; ++c) threads.emplace_back(call);
  call();
  for (auto &t : threads) t.join();
  return failed.load();
}
