// GPU-timed spans (see cuda_trace.h).
#include "gpu/cuda_trace.h"

#include <cuda_runtime_api.h>

#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "strata/trace.h"

namespace strata::gpu {
namespace {

constexpr std::int64_t kAnchorMaxAgeNs = 5'000'000'000;

struct Anchor {
  cudaEvent_t event = nullptr;
  std::int64_t host_ns = 0;  // the tracer's clock when `event` completed
  ~Anchor() {
    if (event && cudaEventDestroy(event) != cudaSuccess) (void)cudaGetLastError();
  }
};

struct Pending {
  const char* name;
  std::string lane;
  cudaEvent_t start, end;
  std::uint64_t bytes;
  std::shared_ptr<Anchor> anchor;
};

struct State {
  std::mutex mu;
  std::map<void*, std::string> lanes;
  std::map<int, std::shared_ptr<Anchor>> anchors;  // by device ordinal
  std::map<int, cudaStream_t> quiet;               // an idle private stream per device
  std::vector<Pending> pending;
};

State& state() {
  static State* s = new State;  // never destroyed: spans may be flushed during exit
  return *s;
}

void destroy(cudaEvent_t e) {
  if (e && cudaEventDestroy(e) != cudaSuccess) (void)cudaGetLastError();
}

// The current anchor of `device`, renewed when missing or old; null when CUDA refuses (the
// span is then not recorded). Called with st.mu held.
std::shared_ptr<Anchor> anchor_of(State& st, int device) {
  Tracer& tr = Tracer::global();
  auto& a = st.anchors[device];
  if (a && tr.now_ns() - a->host_ns < kAnchorMaxAgeNs) return a;
  cudaStream_t& q = st.quiet[device];
  if (q == nullptr && cudaStreamCreateWithFlags(&q, cudaStreamNonBlocking) != cudaSuccess) {
    (void)cudaGetLastError();
    q = nullptr;
    return nullptr;
  }
  auto fresh = std::make_shared<Anchor>();
  if (cudaEventCreate(&fresh->event) != cudaSuccess) {
    (void)cudaGetLastError();
    fresh->event = nullptr;
    return nullptr;
  }
  const std::int64_t t0 = tr.now_ns();
  if (cudaEventRecord(fresh->event, q) != cudaSuccess ||
      cudaEventSynchronize(fresh->event) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  fresh->host_ns = (t0 + tr.now_ns()) / 2;
  a = fresh;
  return a;
}

}  // namespace

GpuSpan::GpuSpan(const char* name, void* stream, std::uint64_t bytes)
    : name_(name), stream_(stream), bytes_(bytes) {
  if (!Tracer::global().enabled()) return;
  cudaEvent_t e = nullptr;
  if (cudaEventCreate(&e) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  if (cudaEventRecord(e, static_cast<cudaStream_t>(stream)) != cudaSuccess) {
    (void)cudaGetLastError();
    destroy(e);
    return;
  }
  start_ = e;
  uncaught_ = std::uncaught_exceptions();
}

GpuSpan::~GpuSpan() {
  if (start_ == nullptr) return;
  auto* start = static_cast<cudaEvent_t>(start_);
  cudaEvent_t end = nullptr;
  int device = -1;
  // While an exception unwinds, the work may not have been queued: no span, and no call that
  // could clear the error the exception reports.
  if (std::uncaught_exceptions() > uncaught_ || cudaGetDevice(&device) != cudaSuccess ||
      cudaEventCreate(&end) != cudaSuccess ||
      cudaEventRecord(end, static_cast<cudaStream_t>(stream_)) != cudaSuccess) {
    if (std::uncaught_exceptions() <= uncaught_) (void)cudaGetLastError();
    destroy(start);
    destroy(end);
    return;
  }
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  std::shared_ptr<Anchor> anchor = anchor_of(st, device);
  if (!anchor) {
    destroy(start);
    destroy(end);
    return;
  }
  auto lane = st.lanes.find(stream_);
  st.pending.push_back({name_, lane == st.lanes.end() ? std::string("cuda") : lane->second, start,
                        end, bytes_, std::move(anchor)});
}

void name_gpu_stream(void* stream, const std::string& name) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  st.lanes[stream] = name;
}

void forget_gpu_stream(void* stream) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  st.lanes.erase(stream);
}

void flush_gpu_spans() noexcept {
  State& st = state();
  std::vector<Pending> done;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    if (st.pending.empty()) return;
    std::vector<Pending> keep;
    for (Pending& p : st.pending) {
      const cudaError_t q = cudaEventQuery(p.end);
      if (q == cudaErrorNotReady) {
        // Not a failure, but the runtime keeps it as this thread's last error, and every kernel
        // launcher returns cudaGetLastError(): the next launch would "fail" with it.
        (void)cudaGetLastError();
        keep.push_back(std::move(p));
        continue;
      }
      // Failed work (q != cudaSuccess) is dropped; the stream's own synchronize reports it.
      if (q == cudaSuccess)
        done.push_back(std::move(p));
      else {
        destroy(p.start);
        destroy(p.end);
      }
    }
    st.pending = std::move(keep);
  }
  Tracer& tr = Tracer::global();
  for (Pending& p : done) {
    float t0 = 0, t1 = 0;
    if (tr.enabled()) {
      if (cudaEventElapsedTime(&t0, p.anchor->event, p.start) == cudaSuccess &&
          cudaEventElapsedTime(&t1, p.anchor->event, p.end) == cudaSuccess) {
        const auto ns = [&](float ms) {
          return p.anchor->host_ns + std::int64_t(double(ms) * 1e6);
        };
        tr.record(p.name, p.lane, ns(t0), ns(t1), p.bytes);
      } else {
        (void)cudaGetLastError();  // our events' error, not the work's (it completed)
      }
    }
    destroy(p.start);
    destroy(p.end);
  }
}

}  // namespace strata::gpu
