// Work spread over threads the way the host kernels share: included by host_adam.cpp and low_bit_adam.cpp (each
// defines it in its own anonymous namespace).
//
// parallel_range(n, nthreads, min_per_thread, grain, body) runs body(begin, end) over [0, n) on up to nthreads
// threads (the calling thread one of them), at least min_per_thread elements each: on torch's OpenMP runtime where
// the library is built with it (host_adam_ext.build_on_torchs_openmp), else on threads started for the call. The
// threads take ranges of `grain` elements in turn from a shared counter rather than fixed shares, so that on a
// shared machine a thread whose core is busy with another process does less of the work instead of holding
// everyone up; every range but the last starts and ends at a multiple of `grain`.
#pragma once

#include <atomic>
#include <cstdint>
#include <pthread.h>
#include <thread>
#include <vector>

namespace {

#ifdef _OPENMP
// In a child forked from a process that has run OpenMP regions the runtime still counts the parent's
// threads, which the fork did not copy: a parallel region there can wait for them forever. A forked
// child runs its updates on threads of its own.
std::atomic<bool> forked_child{false};
const int at_fork_registered = pthread_atfork(nullptr, nullptr, [] { forked_child = true; });
#endif

template <typename Body>
void parallel_range(int64_t n, int nthreads, int64_t min_per_thread, int64_t grain, Body body) {
  int64_t t = nthreads < 1 ? 1 : nthreads;
  if (min_per_thread < 1) min_per_thread = 1;
  if (n / min_per_thread < t) t = n / min_per_thread;
  if (t <= 1 || n <= grain) {
    body(int64_t(0), n);
    return;
  }
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t b; (b = next.fetch_add(grain, std::memory_order_relaxed)) < n;)
      body(b, b + grain < n ? b + grain : n);
  };
#ifdef _OPENMP
  if (!forked_child.load(std::memory_order_relaxed)) {
    // the OpenMP runtime torch runs its operators on (the library is loaded once per process): its
    // threads are started already, and none of them spins on a core this update needs, as the threads
    // of a pool other than torch's would for a while after each torch operator
#pragma omp parallel num_threads(int(t))
    work();
    return;
  }
#endif
  std::vector<std::thread> workers;
  workers.reserve(size_t(t - 1));
  try {
    for (int64_t i = 1; i < t; ++i) workers.emplace_back(work);
  } catch (...) {  // could not start a thread: the ones running (and this one) do the work
  }
  work();
  for (auto& th : workers) th.join();
}

}  // namespace
