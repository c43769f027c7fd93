// page-runs: how a fresh 32 MiB buffer of 4 KiB pages lies in physical memory, faulted in one
// of two ways: "touch" (a write to every page, as memset, mlock or MAP_POPULATE fault them) or
// "register" (an io_uring buffer registration, as fio --fixedbufs and strata's pinned pool fault
// them: a long-term pin, allocated outside the kernel's movable page lists). Prints the number
// of physically contiguous runs in the buffer's 8,192 pages (a virtio disk takes one segment per
// run; fewer runs, faster O_DIRECT reads). Root only (/proc/self/pagemap hides frame numbers
// from others). Tooling, not part of strata; docs/nvme.md has the command.
//
//   cc -O2 tools/page-runs.c -o /tmp/page-runs -luring && /tmp/page-runs register
#define _GNU_SOURCE
#include <fcntl.h>
#include <liburing.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int main(int argc, char** argv) {
  if (argc != 2 || (strcmp(argv[1], "touch") != 0 && strcmp(argv[1], "register") != 0)) {
    fprintf(stderr, "usage: %s touch|register\n", argv[0]);
    return 2;
  }
  const size_t bytes = (size_t)32 << 20, pages = bytes / 4096;
  char* p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return perror("mmap"), 1;
  madvise(p, bytes, MADV_NOHUGEPAGE);
  if (strcmp(argv[1], "touch") == 0) {
    for (size_t i = 0; i < bytes; i += 4096) p[i] = 1;
  } else {
    struct io_uring ring;
    if (io_uring_queue_init(8, &ring, 0) != 0) return fprintf(stderr, "io_uring refused\n"), 1;
    struct iovec v[32];
    for (int i = 0; i < 32; ++i) v[i] = (struct iovec){p + ((size_t)i << 20), (size_t)1 << 20};
    const int rc = io_uring_register_buffers(&ring, v, 32);
    if (rc != 0) return fprintf(stderr, "io_uring_register_buffers: %s\n", strerror(-rc)), 1;
    io_uring_unregister_buffers(&ring);
    io_uring_queue_exit(&ring);
  }
  const int fd = open("/proc/self/pagemap", O_RDONLY);
  uint64_t* e = malloc(pages * 8);
  if (fd < 0 || !e ||
      pread(fd, e, pages * 8, (off_t)((uintptr_t)p / 4096 * 8)) != (ssize_t)(pages * 8))
    return perror("pagemap"), 1;
  const uint64_t frame = ((uint64_t)1 << 55) - 1;
  if ((e[0] & frame) == 0) return fprintf(stderr, "frame numbers hidden: run as root\n"), 1;
  size_t runs = 1;
  for (size_t i = 1; i < pages; ++i)
    if ((e[i] & frame) != (e[i - 1] & frame) + 1) ++runs;
  printf("%s: %zu physically contiguous runs in %zu pages\n", argv[1], runs, pages);
  return 0;
}
