// Cost of recording a tracer span, enabled and disabled (Google Benchmark).
#include <benchmark/benchmark.h>

#include "strata/trace.h"

static void BM_TraceScopeDisabled(benchmark::State& state) {
  strata::Tracer::global().set_enabled(false);
  for (auto _ : state) {
    strata::TraceScope s("copy_h2d", "copy", 4096);
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_TraceScopeDisabled);

static void BM_TraceScopeEnabled(benchmark::State& state) {
  strata::Tracer& t = strata::Tracer::global();
  t.set_enabled(true);
  std::int64_t n = 0;
  for (auto _ : state) {
    strata::TraceScope s("copy_h2d", "copy", 4096);
    if (++n % 100000 == 0) {
      state.PauseTiming();
      t.clear();
      state.ResumeTiming();
    }
  }
  t.set_enabled(false);
  t.clear();
}
BENCHMARK(BM_TraceScopeEnabled)->Threads(1)->Threads(2);
