// A whole buffer written to a file descriptor, as write(2) takes it: in as many calls as it
// accepts, again after a signal (EINTR).
#pragma once

#include <unistd.h>

#include <cerrno>
#include <cstddef>

namespace strata {

// 0 once all `n` bytes are written, else the errno of the write that failed (ENOSPC for one that
// wrote nothing).
inline int write_fd_fully(int fd, const void* data, std::size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return errno;
    if (w == 0) return ENOSPC;
    p += w;
    n -= std::size_t(w);
  }
  return 0;
}

}  // namespace strata
