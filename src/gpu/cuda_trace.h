// GPU-timed spans for strata's tracer (strata/trace.h), inside the CUDA module.
//
// While Tracer::global() is enabled, each piece of work queued on a CUDA stream (a Stream
// op of CudaDevice, or a model kernel launched through the module's table) is bracketed by
// two timing events on that stream. Once the end event has completed, the span is recorded
// in the tracer with host times, under the stream's name as its lane, the same lanes the
// CPU-emulated device writes; so a Chrome trace of a CUDA run shows when the GPU really
// worked, not when the host queued it.
//
// GPU times become host times through an anchor per device: an event recorded on an idle
// private stream and waited for, its host time taken as the midpoint of the record and the
// wait (error: half that interval, a few microseconds). A span is its events' elapsed time
// from the anchor; the anchor is renewed when older than 5 s (cudaEventElapsedTime is a
// float in ms).
//
// Spans are recorded by flush_gpu_spans(), which CudaStream / CudaDevice synchronize call;
// spans whose work completes after the tracer was disabled are dropped. Off (the tracer
// disabled), a span costs one relaxed atomic load.
#pragma once

#include <cstdint>
#include <string>

namespace strata::gpu {

class GpuSpan {
 public:
  // `stream` is a cudaStream_t of the calling thread's current device; `name` a string with
  // static lifetime.
  GpuSpan(const char* name, void* stream, std::uint64_t bytes = 0);
  ~GpuSpan();  // records the end event; abandons the span while an exception unwinds
  GpuSpan(const GpuSpan&) = delete;
  GpuSpan& operator=(const GpuSpan&) = delete;

 private:
  const char* name_;
  void* stream_;
  std::uint64_t bytes_;
  void* start_ = nullptr;  // cudaEvent_t; null when not tracing
  int uncaught_ = 0;
};

// The lane of `stream`'s spans (CudaStream registers its name; unknown streams are "cuda").
void name_gpu_stream(void* stream, const std::string& name);
void forget_gpu_stream(void* stream);

// Records every span whose work has completed; keeps the others for a later call.
void flush_gpu_spans() noexcept;

}  // namespace strata::gpu
