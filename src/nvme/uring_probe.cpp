// The io_uring probe: one small ring, created and destroyed once per process, tells whether
// the NVMe engine can use io_uring here or must fall back to the pread/pwrite thread pool.
// Kernels before 5.1 lack the syscall (ENOSYS); container seccomp profiles and
// kernel.io_uring_disabled forbid it (EPERM); RLIMIT_MEMLOCK may be too small on old
// kernels (ENOMEM).
#include <fmt/format.h>
#include <liburing.h>

#include <cstring>
#include <mutex>

#include "strata/system_info.h"

#ifndef STRATA_LIBURING_VERSION
#define STRATA_LIBURING_VERSION "unknown"
#endif

namespace strata::nvme {
namespace {

std::string liburing_version() {
#if defined(IO_URING_VERSION_MAJOR) && defined(IO_URING_VERSION_MINOR)
  return fmt::format("{}.{}", IO_URING_VERSION_MAJOR, IO_URING_VERSION_MINOR);
#else
  return STRATA_LIBURING_VERSION;
#endif
}

std::string explain(int err) {
  char buf[256];
  const std::string text = strerror_r(err, buf, sizeof buf);
  switch (err) {
    case ENOSYS:
      return fmt::format("io_uring_setup: {} (kernel too old, needs Linux 5.1+)", text);
    case EPERM:
      return fmt::format(
          "io_uring_setup: {} (blocked by a seccomp profile or "
          "kernel.io_uring_disabled)",
          text);
    case ENOMEM:
      return fmt::format(
          "io_uring_setup: {} (RLIMIT_MEMLOCK too small for the ring; raise ulimit -l)", text);
    default:
      return fmt::format("io_uring_setup: {} (errno {})", text, err);
  }
}

UringProbe run_probe() {
  UringProbe p;
  p.version = liburing_version();
  io_uring ring;
  const int rc = io_uring_queue_init(8, &ring, 0);
  if (rc < 0) {
    p.available = false;
    p.reason = explain(-rc);
    return p;
  }
  // Kernels 5.1-5.5 set up a ring but lack IORING_OP_READ / WRITE, which every request uses:
  // there the thread pool must take over, not every I/O fail with EINVAL.
  io_uring_probe* ops = io_uring_get_probe_ring(&ring);
  const bool rw = ops && io_uring_opcode_supported(ops, IORING_OP_READ) &&
                  io_uring_opcode_supported(ops, IORING_OP_WRITE);
  if (ops) io_uring_free_probe(ops);
  io_uring_queue_exit(&ring);
  p.available = rw;
  if (!rw)
    p.reason =
        "the kernel's io_uring lacks IORING_OP_READ / IORING_OP_WRITE (Linux 5.6 or newer has "
        "them)";
  return p;
}

}  // namespace

UringProbe probe_io_uring() {
  static const UringProbe probe = run_probe();
  return probe;
}

}  // namespace strata::nvme
