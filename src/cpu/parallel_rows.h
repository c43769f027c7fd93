// Row parallelism for the CPU kernels that sit between oneDNN matmuls (model_kernels.cpp,
// model_attention.cpp). OpenMP, not oneTBB: this build's oneDNN runs on libgomp's team, and
// two runtimes' workers spinning after their parallel regions take the cores from each other.
// Each calling thread (a stream worker) has its own team, as oneDNN's calls from it do.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>

namespace strata::cpu {

// Runs body(i) for i in [0, n) on the calling thread's OpenMP team (a static partition, so each
// index runs on a fixed thread), serially when n * work_per_row is too little to pay for it.
// An exception from body (a oneDNN primitive that cannot be made, say) must not leave the
// parallel region, where it would end the process with std::terminate and no message: the first
// is kept, the rows not yet started are skipped, and it is rethrown to the caller.
template <class Body>
void parallel_rows(std::int64_t n, std::int64_t work_per_row, Body body) {
  if (n * work_per_row < 32768 || n < 2) {
    for (std::int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  std::exception_ptr first;
  std::atomic<bool> failed{false};
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    if (failed.load(std::memory_order_relaxed)) continue;
    try {
      body(i);
    } catch (...) {
#pragma omp critical(strata_parallel_rows_error)
      if (!first) first = std::current_exception();
      failed.store(true, std::memory_order_relaxed);
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace strata::cpu
