#include "strata/error.h"

#include <cstring>

namespace strata {

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument:
      return "invalid argument";
    case ErrorKind::kOutOfMemory:
      return "out of memory";
    case ErrorKind::kIo:
      return "I/O error";
    case ErrorKind::kCuda:
      return "CUDA error";
    case ErrorKind::kNccl:
      return "NCCL error";
    case ErrorKind::kMpi:
      return "MPI error";
    case ErrorKind::kUnsupported:
      return "unsupported";
    case ErrorKind::kInternal:
      return "internal error";
  }
  return "error";
}

static std::string format_what(ErrorKind kind, const std::string& message, const std::string& call,
                               const char* file, int line, const std::string& detail) {
  std::string s = fmt::format("{}: {}", error_kind_name(kind), message);
  if (!detail.empty()) s += fmt::format(" ({})", detail);
  const char* base = std::strrchr(file, '/');
  s += fmt::format(" [{}:{}", base ? base + 1 : file, line);
  if (!call.empty()) s += fmt::format(": {}", call);
  s += "]";
  return s;
}

std::string Error::user_message() const {
  if (kind_ == ErrorKind::kInternal || kind_ == ErrorKind::kCuda || kind_ == ErrorKind::kNccl ||
      kind_ == ErrorKind::kMpi)
    return what();
  std::string s = fmt::format("{}: {}", error_kind_name(kind_), message_);
  if (!detail_.empty()) s += fmt::format(" ({})", detail_);
  return s;
}

Error::Error(ErrorKind kind, std::string message, std::string call, const char* file, int line,
             std::string detail)
    : std::runtime_error(format_what(kind, message, call, file, line, detail)),
      kind_(kind),
      message_(std::move(message)),
      call_(std::move(call)),
      detail_(std::move(detail)),
      file_(file),
      line_(line) {}

namespace detail {

void throw_error(ErrorKind kind, const char* file, int line, std::string call, std::string message,
                 std::string detail) {
  throw Error(kind, std::move(message), std::move(call), file, line, std::move(detail));
}

void throw_errno(const char* file, int line, const char* call, int err, std::string message) {
  char buf[256];
  // GNU strerror_r returns the message pointer (which may or may not be buf).
  const char* text = strerror_r(err, buf, sizeof buf);
  throw Error(ErrorKind::kIo, std::move(message), call, file, line,
              fmt::format("errno {}: {}", err, text));
}

}  // namespace detail
}  // namespace strata
