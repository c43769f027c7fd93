// strata error handling: one exception type for the whole library.
//
// Library code reports failure by throwing strata::Error, which carries what kind of
// failure it was, the call that failed, file:line, and the system/CUDA/NCCL text.
// Tools catch it at main() and print one clear line with a non-zero exit.
// The STRATA_* check macros stay on in release builds: never use assert() for
// syscall results or for invariants the runtime depends on.
#pragma once

#include <fmt/format.h>

#include <cerrno>
#include <stdexcept>
#include <string>

namespace strata {

enum class ErrorKind {
  kInvalidArgument,  // the caller passed something wrong; the message names the fix
  kOutOfMemory,      // a budget or capacity was exceeded; message has requested/in-use/cap
  kIo,               // a file or syscall failed (errno text in detail)
  kCuda,             // a CUDA runtime / cuBLAS call failed
  kNccl,
  kMpi,
  kUnsupported,  // the build or the machine lacks a capability
  kInternal,     // an invariant of strata itself broke: a bug
};

const char* error_kind_name(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  // `message` says what went wrong and what to do; `call` is the failing expression or
  // API call; `detail` is the errno / CUDA / NCCL text where there is one.
  Error(ErrorKind kind, std::string message, std::string call, const char* file, int line,
        std::string detail = {});

  ErrorKind kind() const noexcept { return kind_; }
  // The line a tool prints: what() without the source location where the message says it all
  // (bad input, a budget, a missing capability, a file or I/O failure named with its path);
  // with it for bugs and CUDA / NCCL / MPI failures, where a report needs it.
  std::string user_message() const;
  const std::string& message() const noexcept { return message_; }
  const std::string& call() const noexcept { return call_; }
  const std::string& detail() const noexcept { return detail_; }
  const char* file() const noexcept { return file_; }
  int line() const noexcept { return line_; }

 private:
  ErrorKind kind_;
  std::string message_;
  std::string call_;
  std::string detail_;
  const char* file_;
  int line_;
};

namespace detail {
[[noreturn]] void throw_error(ErrorKind kind, const char* file, int line, std::string call,
                              std::string message, std::string detail = {});
[[noreturn]] void throw_errno(const char* file, int line, const char* call, int err,
                              std::string message);
}  // namespace detail

}  // namespace strata

// Argument validation: the message names the problem and the fix.
#define STRATA_REQUIRE(cond, ...)                                                              \
  do {                                                                                         \
    if (!(cond)) [[unlikely]]                                                                  \
      ::strata::detail::throw_error(::strata::ErrorKind::kInvalidArgument, __FILE__, __LINE__, \
                                    #cond, ::fmt::format(__VA_ARGS__));                        \
  } while (0)

// Internal invariant: stays on in release builds.
#define STRATA_CHECK(cond, ...)                                                                \
  do {                                                                                         \
    if (!(cond)) [[unlikely]]                                                                  \
      ::strata::detail::throw_error(::strata::ErrorKind::kInternal, __FILE__, __LINE__, #cond, \
                                    ::fmt::format(__VA_ARGS__));                               \
  } while (0)

#define STRATA_THROW(kind, ...)                                                    \
  ::strata::detail::throw_error(::strata::ErrorKind::kind, __FILE__, __LINE__, "", \
                                ::fmt::format(__VA_ARGS__))

// For syscalls that return -1 and set errno.
#define STRATA_CHECK_ERRNO(expr, ...)                                                              \
  do {                                                                                             \
    if ((expr) == -1) [[unlikely]]                                                                 \
      ::strata::detail::throw_errno(__FILE__, __LINE__, #expr, errno, ::fmt::format(__VA_ARGS__)); \
  } while (0)
