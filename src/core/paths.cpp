#include "strata/paths.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <vector>

#include "core/utf8.h"
#include "core/write_fd.h"
#include "strata/error.h"

namespace strata {

namespace fs = std::filesystem;

namespace {

// A path in /proc by its name or its folder's (/dev/fd/N: /dev/fd is a link to /proc/self/fd).
bool in_proc(const fs::path& p) {
  if (p.lexically_normal().string().starts_with("/proc/")) return true;
  std::error_code ec;
  const fs::path folder = fs::weakly_canonical(fs::absolute(p, ec).parent_path(), ec);
  return !ec && folder.string().starts_with("/proc/");
}

}  // namespace

bool written_in_place(const std::string& path) {
  if (path.empty()) return false;
  // A process's streams (/proc/<pid>/fd/N, by its own name or through /dev/fd), and a link into
  // them, directly or by way of others (/dev/stdout -> /proc/self/fd/1, a link of the user's to
  // /dev/stdout or /dev/fd/1): whatever the stream is now, a redirected file among them. A link
  // to a file elsewhere (/dev/shm/x included) is that file.
  std::error_code ec;
  struct stat st {};
  fs::path at = path;
  for (int hops = 0; hops < 8; ++hops) {
    if (in_proc(at)) return true;
    if (::lstat(at.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) break;
    const fs::path to = fs::read_symlink(at, ec);
    if (ec) break;
    at = to.is_absolute() ? to : at.parent_path() / to;
  }
  return ::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode);
}

bool null_device(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISCHR(st.st_mode) && st.st_rdev == ::makedev(1, 3);
}

namespace {

// This process's descriptor N when `path` names it (/dev/stdout, /dev/fd/N, /proc/self/fd/N, or
// a link to one of those), else -1. Written through a copy of it, the bytes land where the
// process's own writes do (a file opened again by name has an offset of its own: a redirected
// stdout's first lines were written over).
int own_descriptor(std::string path) {
  static const std::string self = fmt::format("/proc/{}/fd/", ::getpid());
  for (int hops = 0; hops < 8; ++hops) {
    if (path == "/dev/stdin") return 0;
    if (path == "/dev/stdout") return 1;
    if (path == "/dev/stderr") return 2;
    for (const std::string& dir : {std::string("/dev/fd/"), std::string("/proc/self/fd/"), self})
      if (path.starts_with(dir) && path.size() > dir.size() &&
          path.find_first_not_of("0123456789", dir.size()) == std::string::npos &&
          path.size() - dir.size() < 10)
        return std::stoi(path.substr(dir.size()));
    std::error_code ec;
    const fs::path to = fs::read_symlink(path, ec);
    if (ec) return -1;
    path = to.is_absolute() ? to.string() : (fs::path(path).parent_path() / to).string();
  }
  return -1;
}

// `path` opened for writing as a stream: a copy of this process's own descriptor `own` where it
// names one (own_descriptor), else opened by name (appending, creating nothing).
int open_stream(const std::string& path, int own, int extra_flags) {
  if (own >= 0) {
    std::fflush(nullptr);  // what stdio holds goes first
    return ::fcntl(own, F_DUPFD_CLOEXEC, 0);
  }
  return ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC | extra_flags);
}

}  // namespace

int write_holding_sigpipe(int fd, const void* data, std::size_t n) {
  // SIGPIPE held back in this thread while it writes: a reader gone is EPIPE, and the signal it
  // raised is taken off the thread before it is let through again.
  sigset_t pipe, was;
  ::sigemptyset(&pipe);
  ::sigaddset(&pipe, SIGPIPE);
  ::pthread_sigmask(SIG_BLOCK, &pipe, &was);
  const int err = write_fd_fully(fd, data, n);
  if (err == EPIPE) {
    const timespec now{};
    while (::sigtimedwait(&pipe, nullptr, &now) == SIGPIPE) {
    }
  }
  ::pthread_sigmask(SIG_SETMASK, &was, nullptr);
  return err;
}

int write_into(const std::string& path, const void* data, std::size_t n) {
  const int own = own_descriptor(path);
  const int fd = open_stream(path, own, O_NONBLOCK);
  if (fd < 0) return errno;
  // Opened by name: blocking again once open. (A copy of a descriptor shares its flags: left.)
  if (own < 0) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  int err = write_holding_sigpipe(fd, data, n);
  if (::close(fd) != 0 && err == 0) err = errno;
  return err;
}

int copy_into(int from_fd, const std::string& path) {
  const int out = open_stream(path, own_descriptor(path), 0);
  if (out < 0) return errno;
  std::vector<char> buf(std::size_t(1) << 20);
  int err = 0;
  for (off_t at = 0;;) {
    const ssize_t n = ::pread(from_fd, buf.data(), buf.size(), at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      err = n < 0 ? errno : 0;
      break;
    }
    if ((err = write_fd_fully(out, buf.data(), std::size_t(n))) != 0) break;
    at += n;
  }
  if (::close(out) != 0 && err == 0) err = errno;
  return err;
}

namespace {

// An output that is a file, made anew.
int open_file_output(const std::string& path) {
  return ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
}

}  // namespace

int open_output(const std::string& path) {
  if (written_in_place(path)) return open_stream(path, own_descriptor(path), 0);
  return open_file_output(path);
}

int write_output(const std::string& path, std::string_view text) {
  if (written_in_place(path)) return write_into(path, text.data(), text.size());
  const int fd = open_file_output(path);  // (written_in_place asked once)
  if (fd < 0) return errno;
  int err = write_fd_fully(fd, text.data(), text.size());
  if (::close(fd) != 0 && err == 0) err = errno;
  return err;
}

std::string canonical_path(const std::string& path) {
  std::error_code ec;
  const fs::path abs = fs::absolute(path, ec);
  if (ec) return path;
  const fs::path k = fs::weakly_canonical(abs, ec);
  return ec ? abs.lexically_normal().string() : k.string();
}

bool same_file(const std::string& x, const std::string& y) {
  if (x.empty() || y.empty()) return false;
  std::error_code ec;
  return canonical_path(x) == canonical_path(y) || (fs::equivalent(x, y, ec) && !ec);
}

bool lock_unless_held(int fd) {
  return ::flock(fd, LOCK_EX | LOCK_NB) == 0 || errno != EWOULDBLOCK;
}

void require_input_file(const std::string& flag, const std::string& path) {
  std::error_code ec;
  const std::string named = flag.empty() ? path : flag + " " + path;
  STRATA_REQUIRE(!fs::is_directory(path, ec), "{} is a folder, not a file: give the file itself",
                 named);
  STRATA_REQUIRE(fs::exists(path, ec), "{}: no such file", named);
  STRATA_REQUIRE(fs::is_regular_file(path, ec), "{} is not a regular file (a device or a pipe)",
                 named);
}

void require_input_folder(const std::string& flag, const std::string& path,
                          const std::string& what) {
  std::error_code ec;
  const std::string named = flag.empty() ? path : flag + " " + path;
  STRATA_REQUIRE(!fs::exists(path, ec) || fs::is_directory(path, ec),
                 "{} is a file, not a folder: give {}", named, what);
  STRATA_REQUIRE(fs::is_directory(path, ec), "{}: no such folder", named);
}

void require_overwrite_to_replace(const std::string& flag, const std::string& path,
                                  bool overwrite) {
  std::error_code ec;
  if (path.empty() || overwrite || written_in_place(path) ||
      !fs::exists(fs::symlink_status(path, ec)))
    return;
  const fs::file_status st = fs::status(path, ec);
  STRATA_REQUIRE(fs::exists(st) && !fs::is_regular_file(st),
                 "{} {} exists: pass --overwrite to replace it", flag, path);
}

void require_room_for_names(const std::string& flag, const std::string& path,
                            std::size_t longest_below) {
  if (path.empty()) return;
  // The start of a long path, for the message (a path of thousands of bytes is no help there).
  const auto start = [](const std::string& p) {
    return p.size() <= 80 ? p : std::string(utf8::prefix(p, 80)) + "...";
  };
  for (const fs::path& part : fs::path(path)) {
    const std::string name = part.string();
    STRATA_REQUIRE(name.size() <= NAME_MAX,
                   "{} {}: the name {} is {} bytes, and a file system takes at most {} for one "
                   "name (NAME_MAX): give a shorter one",
                   flag, start(path), start(name), name.size(), NAME_MAX);
  }
  STRATA_REQUIRE(path.size() + longest_below < PATH_MAX,
                 "{} {}: the path is {} bytes, and with the names written under it (up to {} "
                 "bytes more) it would pass the system's limit for a path, {} bytes (PATH_MAX): "
                 "give a shorter path",
                 flag, start(path), path.size(), longest_below, PATH_MAX);
}

void throw_folder_missing(const std::string& flag, const std::string& path,
                          const std::string& folder) {
  STRATA_THROW(kInvalidArgument,
               "{} {}: the folder {} does not exist: create it first (mkdir -p {})", flag, path,
               folder, folder);
}

void require_output_file(const std::string& flag, const std::string& path, bool overwrite) {
  if (path.empty()) return;
  std::error_code ec;
  STRATA_REQUIRE(!fs::is_directory(path, ec), "{} {} is a folder: give a file name", flag, path);
  if (fs::exists(fs::symlink_status(path, ec))) {
    require_overwrite_to_replace(flag, path, overwrite);
    if (::access(path.c_str(), W_OK) != 0)
      STRATA_THROW(kIo, "{} {}: cannot be replaced: {}", flag, path, std::strerror(errno));
    return;
  }
  const fs::path dir = fs::path(path).parent_path();
  const std::string where = dir.empty() ? std::string(".") : dir.string();
  // "DIR/.": a file where the folder should be is ENOTDIR, not a writable file.
  if (::access((where + "/.").c_str(), W_OK) != 0) {
    const int err = errno;
    if (err == ENOENT && !fs::exists(fs::symlink_status(where, ec)))
      throw_folder_missing(flag, path, where);
    STRATA_THROW(kIo, "{} {}: cannot be written in {}: {}", flag, path, where, std::strerror(err));
  }
}

void require_outputs_apart(const std::string& who, const NamedPaths& outs, const NamedPaths& ins) {
  for (std::size_t i = 0; i < outs.size(); ++i) {
    std::error_code ec;
    const fs::file_status st = fs::status(outs[i].second, ec);
    if (written_in_place(outs[i].second) || (fs::exists(st) && !fs::is_regular_file(st))) continue;
    for (std::size_t k = i + 1; k < outs.size(); ++k)
      STRATA_REQUIRE(!same_file(outs[i].second, outs[k].second),
                     "{} and {} both name {}: give each its own file", outs[i].first, outs[k].first,
                     outs[i].second);
    for (const auto& [flag, path] : ins)
      STRATA_REQUIRE(!same_file(outs[i].second, path),
                     "{} {} is the {} file: {} would replace it; write it elsewhere", outs[i].first,
                     outs[i].second, flag, who);
  }
}

NamedPaths model_files_in_folder(const std::string& flag, const std::string& folder) {
  static const char* const kRead[] = {"config.json",           "generation_config.json",
                                      "tokenizer.json",        "tokenizer.model",
                                      "tokenizer_config.json", "special_tokens_map.json",
                                      "chat_template.jinja",   "chat_template.json"};
  NamedPaths out;
  std::error_code ec;
  if (folder.empty() || !fs::is_directory(folder, ec)) return out;
  for (const auto& e : fs::directory_iterator(folder, ec)) {
    const std::string name = e.path().filename().string();
    const bool read = name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json") ||
                      std::find(std::begin(kRead), std::end(kRead), name) != std::end(kRead);
    if (read && e.is_regular_file(ec))
      out.push_back({flag + " folder's " + name, e.path().string()});
  }
  return out;
}

}  // namespace strata
