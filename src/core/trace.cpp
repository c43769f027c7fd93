// Tracer implementation. Each recording thread owns a buffer registered once in the
// tracer's list; record() touches only that buffer (its lock is uncontended unless a
// reader is copying spans out). Buffers outlive their threads so no span is lost.
#include "strata/trace.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>

#include "core/utf8.h"
#include "strata/error.h"
#include "strata/paths.h"

namespace strata {

struct ThreadBuffer {
  std::mutex mu;
  std::vector<TraceSpan> spans;
};

struct Tracer::Impl {
  std::atomic<bool> enabled{false};
  std::chrono::steady_clock::time_point epoch = std::chrono::steady_clock::now();
  std::mutex mu;
  std::vector<std::shared_ptr<ThreadBuffer>> buffers;
};

Tracer::Tracer() : impl_(new Impl) {}
Tracer::~Tracer() { delete impl_; }

Tracer& Tracer::global() {
  static Tracer* t = new Tracer;  // never destroyed: threads may record during exit
  return *t;
}

void Tracer::set_enabled(bool on) { impl_->enabled.store(on, std::memory_order_relaxed); }
bool Tracer::enabled() const { return impl_->enabled.load(std::memory_order_relaxed); }

std::int64_t Tracer::now_ns() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                              impl_->epoch)
      .count();
}

void Tracer::record(std::string_view name, std::string_view lane, std::int64_t start_ns,
                    std::int64_t end_ns, std::uint64_t bytes) {
  if (!enabled()) return;
  thread_local const Impl* owner = nullptr;
  thread_local std::shared_ptr<ThreadBuffer> buf;
  if (owner != impl_ || !buf) {
    buf = std::make_shared<ThreadBuffer>();
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->buffers.push_back(buf);
    owner = impl_;
  }
  std::lock_guard<std::mutex> lock(buf->mu);
  buf->spans.push_back(TraceSpan{std::string(name), std::string(lane), start_ns, end_ns, bytes});
}

std::vector<TraceSpan> Tracer::spans() const {
  std::vector<TraceSpan> out;
  std::lock_guard<std::mutex> lock(impl_->mu);
  for (const auto& b : impl_->buffers) {
    std::lock_guard<std::mutex> bl(b->mu);
    out.insert(out.end(), b->spans.begin(), b->spans.end());
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const TraceSpan& a, const TraceSpan& b) { return a.start_ns < b.start_ns; });
  return out;
}

void Tracer::clear() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  for (const auto& b : impl_->buffers) {
    std::lock_guard<std::mutex> bl(b->mu);
    b->spans.clear();
  }
}

// Names come from anywhere (file names, user strings): invalid UTF-8 is replaced, never copied,
// so the trace is always valid JSON.
static void append_json_string(std::string& out, std::string_view s) {
  out.push_back('"');
  for (std::size_t i = 0; i < s.size();) {
    const char c = s[i];
    if (static_cast<unsigned char>(c) >= 0x80) {
      std::size_t bad = 0;
      const std::size_t n = utf8::sequence_length(s, i, &bad);
      if (n > 0)
        out.append(s.substr(i, n));
      else
        out += "\xEF\xBF\xBD";  // U+FFFD
      i += n > 0 ? n : bad;
      continue;
    }
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20)
          out += fmt::format("\\u{:04x}", static_cast<unsigned>(static_cast<unsigned char>(c)));
        else
          out.push_back(c);
    }
    ++i;
  }
  out.push_back('"');
}

void Tracer::write_chrome_trace(const std::string& path) const {
  write_chrome_trace(path, INT64_MIN, INT64_MAX);
}

void Tracer::write_chrome_trace(const std::string& path, std::int64_t from_ns,
                                std::int64_t to_ns) const {
  std::vector<TraceSpan> all;
  for (TraceSpan& s : spans()) {
    const bool overlaps = s.start_ns < to_ns &&
                          (s.end_ns > from_ns || (s.end_ns == s.start_ns && s.start_ns >= from_ns));
    if (!overlaps) continue;
    s.start_ns = std::max(s.start_ns, from_ns);
    s.end_ns = std::min(s.end_ns, to_ns);
    all.push_back(std::move(s));
  }
  std::map<std::string, int> lanes;
  for (const auto& s : all) lanes.emplace(s.lane, 0);
  int next = 1;
  for (auto& [name, id] : lanes) id = next++;

  std::string out = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  bool first = true;
  for (const auto& [name, id] : lanes) {
    if (!first) out += ",\n";
    first = false;
    out += fmt::format(
        "{{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":1,\"tid\":{},\"args\":{{\"name\":", id);
    append_json_string(out, name);
    out += "}}";
  }
  for (const auto& s : all) {
    if (!first) out += ",\n";
    first = false;
    out += "{\"name\":";
    append_json_string(out, s.name);
    out += fmt::format(
        ",\"cat\":\"strata\",\"ph\":\"X\",\"pid\":1,\"tid\":{},\"ts\":{:.3f},\"dur\":{:.3f},"
        "\"args\":{{\"bytes\":{}}}}}",
        lanes[s.lane], s.start_ns / 1e3, (s.end_ns - s.start_ns) / 1e3, s.bytes);
  }
  out += "\n]}\n";

  // (a stream such as /dev/stdout is written into: strata/paths.h)
  if (const int err = write_output(path, out); err != 0)
    detail::throw_errno(__FILE__, __LINE__, "write", err,
                        fmt::format("writing trace to '{}' failed", path));
}

TraceScope::TraceScope(std::string_view name, std::string_view lane, std::uint64_t bytes)
    : name_(name), lane_(lane), bytes_(bytes), start_ns_(0), on_(Tracer::global().enabled()) {
  if (on_) start_ns_ = Tracer::global().now_ns();
}

TraceScope::~TraceScope() {
  if (on_) Tracer::global().record(name_, lane_, start_ns_, Tracer::global().now_ns(), bytes_);
}

}  // namespace strata
