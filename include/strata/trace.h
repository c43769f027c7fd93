// The tracer: spans (name, lane, start, end, bytes) recorded cheaply from any thread and
// written as a Chrome trace (chrome://tracing, Perfetto) so overlap is something a user sees.
//
// Recording appends to a per-thread buffer (no lock on the hot path once a thread has
// registered); when tracing is disabled, record() is one relaxed atomic load.
// Lanes are the rows of the timeline: a stream name, "nvme", "adam", "comm".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace strata {

struct TraceSpan {
  std::string name;
  std::string lane;
  std::int64_t start_ns = 0;  // since the tracer's epoch (steady clock)
  std::int64_t end_ns = 0;
  std::uint64_t bytes = 0;
};

class Tracer {
 public:
  // The process-wide tracer that every subsystem records into.
  static Tracer& global();

  void set_enabled(bool on);
  bool enabled() const;
  std::int64_t now_ns() const;

  void record(std::string_view name, std::string_view lane, std::int64_t start_ns,
              std::int64_t end_ns, std::uint64_t bytes = 0);

  // A copy of every span recorded so far (all threads), sorted by start time.
  std::vector<TraceSpan> spans() const;
  void clear();
  // Writes the Chrome trace-event JSON (one "X" event per span, lanes as named threads).
  // Throws strata::Error (kIo) naming the path when it cannot be written.
  void write_chrome_trace(const std::string& path) const;
  // The same for the spans that overlap [from_ns, to_ns), cut to it: one step of a longer
  // recording, with the work that crossed its edges (begun in the step before, still running
  // after) shown for the part inside.
  void write_chrome_trace(const std::string& path, std::int64_t from_ns, std::int64_t to_ns) const;

  struct Impl;
  Tracer();
  ~Tracer();

 private:
  Impl* impl_;
};

// Records a span from construction to destruction when the tracer is enabled.
class TraceScope {
 public:
  TraceScope(std::string_view name, std::string_view lane, std::uint64_t bytes = 0);
  ~TraceScope();
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;
  void set_bytes(std::uint64_t bytes) { bytes_ = bytes; }

 private:
  std::string_view name_, lane_;
  std::uint64_t bytes_;
  std::int64_t start_ns_;
  bool on_;
};

}  // namespace strata
