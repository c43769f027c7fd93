// The TCP rendezvous and store (rendezvous.h). Frames on the wire are a 4-byte little-endian
// length and a payload whose first byte says what it is:
//   client -> rank 0:  'H' handshake
//   "strata-rendezvous/<version>\n<world>\n<rank>\n<token>\n<host>"
//                      'S' set: 4-byte key length, key, value
//                      'G' get: key
//                      'A' abort: this rank stopped, with why   'B' bye: an orderly exit
//   rank 0 -> client:  'R' ready (every rank has joined): one line per rank, "<host> (<address>)"
//                      'E' error text (the rendezvous failed)
//                      'V' the value a get waited for
// Rank 0's server is one thread polling its listening socket and every connection; rank 0's own
// requests reach it through a connection like the others', so there is one code path.
#include "comm/rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "comm/comm_internal.h"
#include "core/process.h"
#include "strata/error.h"
#include "strata/log.h"

namespace strata::comm {
namespace {

constexpr int kProtocolVersion = 1;
constexpr std::size_t kMaxFrame = std::size_t(64) << 20;

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::string errno_text(int err) { return std::strerror(err); }

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// Waits until `fd` is readable (or writable) or `deadline` passes; false on timeout.
bool wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, int(std::min<long long>(left.count(), 1000)));
    if (rc > 0) return true;
    if (rc < 0 && errno != EINTR)
      detail::throw_errno(__FILE__, __LINE__, "poll", errno, "rendezvous socket");
  }
}

// Whole-frame I/O on a blocking socket; false when the peer closed it or the deadline passed.
bool write_all(int fd, const char* p, std::size_t n) {
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= std::size_t(w);
  }
  return true;
}

// 1: read; 0: the peer closed the connection (or it failed); -1: the deadline passed.
int read_all(int fd, char* p, std::size_t n, Clock::time_point deadline) {
  while (n > 0) {
    if (!wait_fd(fd, POLLIN, deadline)) return -1;
    const ssize_t r = ::recv(fd, p, n, 0);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (r <= 0) return 0;
    p += r;
    n -= std::size_t(r);
  }
  return 1;
}

bool send_frame(int fd, char type, const std::string& body) {
  std::string f(5, '\0');
  const std::uint32_t n = std::uint32_t(body.size() + 1);
  std::memcpy(f.data(), &n, 4);
  f[4] = type;
  f += body;
  return write_all(fd, f.data(), f.size());
}

// The frame's type and body; type 0 when the peer closed or sent garbage, 'T' when the deadline
// passed.
std::pair<char, std::string> read_frame(int fd, Clock::time_point deadline) {
  std::uint32_t n = 0;
  int rc = read_all(fd, reinterpret_cast<char*>(&n), 4, deadline);
  if (rc < 0) return {'T', {}};
  if (rc == 0 || n == 0 || n > kMaxFrame) return {0, {}};
  std::string buf(n, '\0');
  rc = read_all(fd, buf.data(), n, deadline);
  if (rc <= 0) return {rc < 0 ? 'T' : char(0), {}};
  return {buf[0], buf.substr(1)};
}

std::string sockaddr_text(const sockaddr_storage& ss) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET)
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in&>(ss).sin_addr, buf, sizeof buf);
  else if (ss.ss_family == AF_INET6)
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6&>(ss).sin6_addr, buf, sizeof buf);
  std::string s = buf;
  // An IPv4 peer of the dual-stack listener: its plain IPv4 address.
  if (s.rfind("::ffff:", 0) == 0 && s.find('.') != std::string::npos) s = s.substr(7);
  return s;
}

// What a strata rendezvous already listening at o.port answers a join as o.rank ("" when
// nothing answers as one within a few seconds): rank 0's port in use is then named as that job's
// (its own rank 0 started twice, or another job), not only as a port in use.
std::string existing_rendezvous_says(const RendezvousOptions& o);

// The handshake a rank sends when it joins.
std::string hello_of(const RendezvousOptions& o) {
  return fmt::format("strata-rendezvous/{}\n{}\n{}\n{}\n{}", kProtocolVersion, o.world_size, o.rank,
                     o.token, this_host());
}

std::string ranks_text(const std::vector<int>& ranks) {
  std::string s;
  const std::size_t shown = std::min<std::size_t>(ranks.size(), 16);
  for (std::size_t i = 0; i < shown; ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > shown) s += fmt::format(" and {} more", ranks.size() - shown);
  return s;
}

}  // namespace

double rendezvous_timeout_s() {
  if (const char* env = std::getenv("STRATA_RENDEZVOUS_TIMEOUT_S"); env && *env)
    return timeout_from_env("STRATA_RENDEZVOUS_TIMEOUT_S", env);
  return 300.0;
}

// Rank 0's side: accepts world_size connections, checks their handshakes, then serves sets and
// gets until the store is destroyed.
class TcpStore::Server {
 public:
  Server(const RendezvousOptions& o) : o_(o) {
    // Two processes that listen on one port at the same instant may both be refused (the kernel
    // marks each listening before it checks the other: both see a listener): a refusal is tried
    // again, 5 to 80 ms apart (~150 ms in all), before the port is called in use.
    int refused = 0;
    bool bound = false;
    const std::size_t jitter =
        std::hash<std::thread::id>{}(std::this_thread::get_id()) ^ std::size_t(::getpid());
    for (int attempt = 0;; ++attempt) {
      std::tie(refused, bound) = try_listen();
      if (refused != EADDRINUSE || attempt == 4) break;
      std::this_thread::sleep_for(
          std::chrono::milliseconds((5 << attempt) + int((jitter >> attempt) % 5)));
    }
    if (refused != 0) {
      if (refused == EADDRINUSE)
        if (const std::string says = existing_rendezvous_says(o); !says.empty())
          STRATA_THROW(kIo,
                       "rank 0 cannot listen for the rendezvous on port {}: a strata rendezvous "
                       "is there, and says: {}",
                       o.port, says);
      detail::throw_error(
          ErrorKind::kIo, __FILE__, __LINE__,
          fmt::format("{}(port {})", bound ? "listen" : "bind", o.port),
          fmt::format("rank 0 cannot listen for the rendezvous on port {}{}", o.port,
                      refused == EADDRINUSE
                          ? ": the port is in use on this host (another job, or a previous run's "
                            "rank 0 still alive); give every rank another MASTER_PORT"
                          : ""),
          errno_text(refused));
    }
    if (::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
      const int err = errno;
      close_fd(listen_fd_);
      detail::throw_errno(__FILE__, __LINE__, "pipe2", err, "rendezvous server");
    }
    start_ = Clock::now();
    thread_ = std::thread([this] { run(); });
  }

  // Serves until every rank has closed its connection (they may still be reading keys rank 0
  // has long had), at most kDrainSeconds more; then ends.
  ~Server() {
    drain_until_ = Clock::now() + std::chrono::seconds(kDrainSeconds);
    stop_ = true;
    char c = 1;
    ssize_t unused = ::write(wake_[1], &c, 1);
    (void)unused;
    thread_.join();
    for (auto& c2 : conns_) close_fd(c2.fd);
    close_fd(listen_fd_);
    close_fd(wake_[0]);
    close_fd(wake_[1]);
  }

 private:
  // Opens listen_fd_ on o_.port, every address (IPv6 and IPv4 where it can): {0, true}, or the
  // errno and whether bind() got as far as succeeding (listen_fd_ then closed).
  std::pair<int, bool> try_listen() {
    listen_fd_ = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const bool v6 = listen_fd_ >= 0;
    if (!v6) listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    STRATA_CHECK_ERRNO(listen_fd_, "cannot create the rendezvous socket");
    const int one = 1, zero = 0;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int rc;
    if (v6) {
      ::setsockopt(listen_fd_, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);  // IPv4 too
      sockaddr_in6 a{};
      a.sin6_family = AF_INET6;
      a.sin6_addr = in6addr_any;
      a.sin6_port = htons(std::uint16_t(o_.port));
      rc = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    } else {
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_ANY);
      a.sin_port = htons(std::uint16_t(o_.port));
      rc = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    }
    // (Two binds with SO_REUSEADDR may both succeed; the second listen() then finds the port in
    // use.)
    const bool bound = rc == 0;
    if (bound) rc = ::listen(listen_fd_, 1024);
    if (rc == 0) return {0, true};
    const int err = errno;
    close_fd(listen_fd_);
    return {err, bound};
  }

  struct Conn {
    int fd = -1;
    int rank = -1;  // -1 until its handshake
    std::string host;
    bool bye = false;  // said it leaves in order
  };

  void run() {
    try {
      serve();
    } catch (const std::exception& e) {
      fail(fmt::format("rank 0's rendezvous server failed: {}", e.what()));
    }
  }

  // Ends the rendezvous: every connected rank (rank 0's own request among them) gets `message`.
  void fail(const std::string& message) {
    failed_ = true;
    failure_ = message;
    for (auto& c : conns_)
      if (c.fd >= 0) send_frame(c.fd, 'E', message);
  }

  void serve() {
    const auto deadline = start_ + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(o_.timeout_s));
    for (;;) {
      if (stop_ && (conns_.empty() || failed_ || !ready_ || Clock::now() > drain_until_)) break;
      std::vector<pollfd> fds;
      fds.push_back({wake_[0], POLLIN, 0});
      fds.push_back({listen_fd_, POLLIN, 0});  // after ready too: a late joiner hears why
      const std::size_t first_conn = fds.size();
      for (const auto& c : conns_) fds.push_back({c.fd, POLLIN, 0});
      int wait_ms = 1000;
      if (!ready_ && !failed_) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
        if (left <= 0) {
          fail(missing_message());
          continue;
        }
        wait_ms = int(std::min<long long>(left, 1000));
      }
      if (stop_) wait_ms = 100;
      const int rc = ::poll(fds.data(), fds.size(), wait_ms);
      if (rc < 0) {
        if (errno == EINTR) continue;
        detail::throw_errno(__FILE__, __LINE__, "poll", errno, "rendezvous server");
      }
      if (fds[0].revents & POLLIN) {
        char buf[16];
        while (::read(wake_[0], buf, sizeof buf) > 0) {
        }
      }
      if (fds[1].revents & POLLIN) accept_one();
      // Connections in order; a closed one is removed after the loop.
      for (std::size_t i = first_conn; i < fds.size(); ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        Conn& c = conns_[i - first_conn];
        auto [type, body] = read_frame(c.fd, Clock::now() + std::chrono::seconds(30));
        if (type == 0 || type == 'T') {
          on_closed(c);
          for (auto it = waiting_.begin(); it != waiting_.end();)
            it = it->second == c.fd ? waiting_.erase(it) : std::next(it);
          close_fd(c.fd);
          continue;
        }
        handle(c, type, body);
      }
      conns_.erase(
          std::remove_if(conns_.begin(), conns_.end(), [](const Conn& c) { return c.fd < 0; }),
          conns_.end());
    }
  }

  void accept_one() {
    sockaddr_storage peer{};
    socklen_t len = sizeof peer;
    const int fd = ::accept4(listen_fd_, reinterpret_cast<sockaddr*>(&peer), &len, SOCK_CLOEXEC);
    if (fd < 0) return;  // the peer went away between poll and accept
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (failed_) {  // a late rank (rank 0's own request among them) hears why at once
      send_frame(fd, 'E', failure_);
      ::close(fd);
      return;
    }
    if (ready_) {  // another job's rank on this port, or a rank started twice: it waited,
                   // unanswered
      send_frame(fd, 'E',
                 fmt::format("the rendezvous at port {} is a job whose {} ranks have all joined "
                             "(job '{}'): this process is another job's, or a rank started "
                             "twice; give each job its own MASTER_PORT, and every process its "
                             "own RANK",
                             o_.port, o_.world_size, o_.token));
      ::close(fd);
      return;
    }
    conns_.push_back(Conn{fd, -1, sockaddr_text(peer)});
  }

  void on_closed(const Conn& c) {
    if (failed_ || c.rank < 0) return;
    if (!ready_) {
      // A rank that joined and left before the others arrived: it has failed.
      joined_.erase(c.rank);
      log::warn("rendezvous: rank {} ({}) left before every rank had joined", c.rank, c.host);
      return;
    }
    if (!c.bye)
      rank_left(
          fmt::format("rank {} on {} left the job (its process ended) while the others "
                      "still needed the rendezvous",
                      c.rank, c.host));
  }

  // A rank has gone for good: a get waiting for a key (which it may be the one to set) fails now
  // with why, and so does any later get of a key not yet set.
  void rank_left(const std::string& why) {
    if (left_.empty()) left_ = why;
    for (const auto& [key, fd] : waiting_) send_frame(fd, 'E', left_);
    waiting_.clear();
  }

  void handle(Conn& c, char type, const std::string& body) {
    if (type == 'H') return handshake(c, body);
    if (c.rank < 0) {
      send_frame(c.fd, 'E', "the first frame on a rendezvous connection must be the handshake");
      close_fd(c.fd);
      return;
    }
    if (type == 'S' && body.size() >= 4) {
      std::uint32_t kn = 0;
      std::memcpy(&kn, body.data(), 4);
      if (kn > body.size() - 4) return;
      std::string key = body.substr(4, kn);
      std::string value = body.substr(4 + kn);
      auto [lo, hi] = waiting_.equal_range(key);
      for (auto it = lo; it != hi; ++it) send_frame(it->second, 'V', value);
      waiting_.erase(lo, hi);
      store_[std::move(key)] = std::move(value);
    } else if (type == 'G') {
      if (auto it = store_.find(body); it != store_.end())
        send_frame(c.fd, 'V', it->second);
      else if (!left_.empty())
        send_frame(c.fd, 'E', left_);
      else
        waiting_.emplace(body, c.fd);
    } else if (type == 'A') {
      rank_left(fmt::format("rank {} of {} stopped: {}", c.rank, o_.world_size, body));
    } else if (type == 'B') {
      c.bye = true;
    }
  }

  // "strata-rendezvous/<version>\n<world>\n<rank>\n<token>\n<host>"
  void handshake(Conn& c, const std::string& body) {
    std::vector<std::string> f;
    std::size_t at = 0;
    for (int i = 0; i < 4; ++i) {
      const std::size_t nl = body.find('\n', at);
      if (nl == std::string::npos) break;
      f.push_back(body.substr(at, nl - at));
      at = nl + 1;
    }
    f.push_back(body.substr(at));
    const std::string want = fmt::format("strata-rendezvous/{}", kProtocolVersion);
    if (f.size() != 5 || f[0].rfind("strata-rendezvous/", 0) != 0) {
      send_frame(c.fd, 'E',
                 fmt::format("{} connected to the rendezvous port {} and is not a strata rank; "
                             "is MASTER_PORT taken by another program?",
                             c.host, o_.port));
      close_fd(c.fd);
      return;
    }
    const int world = std::atoi(f[1].c_str()), rank = std::atoi(f[2].c_str());
    const std::string who = fmt::format("rank {} (host {}, {})", f[2], f[4], c.host);
    std::string why;
    if (f[0] != want)
      why = fmt::format("{} speaks {} and rank 0 speaks {}: run the same strata build everywhere",
                        who, f[0], want);
    else if (f[3] != o_.token)
      why = fmt::format(
          "{} belongs to job '{}' and rank 0 to job '{}' (STRATA_JOB_TOKEN, else the launcher's "
          "run "
          "id): two jobs share MASTER_ADDR:MASTER_PORT; give each its own MASTER_PORT",
          who, f[3], o_.token);
    else if (world != o_.world_size)
      why = fmt::format(
          "{} was started with WORLD_SIZE {} and rank 0 with {}: every rank needs the same", who,
          world, o_.world_size);
    else if (rank < 0 || rank >= world)
      why = fmt::format("{} is not a rank of a {}-rank job (RANK must be 0 to {})", who, world,
                        world - 1);
    else if (joined_.count(rank))
      why = fmt::format(
          "rank {} joined twice: from {} and from {} (host {}); every process needs its "
          "own RANK",
          rank, joined_[rank], c.host, f[4]);
    if (!why.empty()) {
      c.rank = rank;  // so the error reaches it with the others
      fail("the rendezvous failed: " + why);
      return;
    }
    c.rank = rank;
    c.host = f[4] + " (" + c.host + ")";
    joined_[rank] = c.host;
    if (int(joined_.size()) == o_.world_size) {
      ready_ = true;
      std::string table;
      for (const auto& [r, where] : joined_) table += where + "\n";
      for (const auto& k : conns_)
        if (k.fd >= 0) send_frame(k.fd, 'R', table);
      log::debug("rendezvous: {} ranks joined at port {} in {:.2f} s", o_.world_size, o_.port,
                 seconds_since(start_));
    }
  }

  std::string missing_message() const {
    std::vector<int> missing;
    for (int r = 0; r < o_.world_size; ++r)
      if (!joined_.count(r)) missing.push_back(r);
    return fmt::format(
        "rank 0 waited {:.0f} s for rank{} {} at {}:{} ({} of {} joined): start every rank with "
        "the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, and check that they can reach this host "
        "(firewall, interface); raise STRATA_RENDEZVOUS_TIMEOUT_S if ranks start slowly",
        o_.timeout_s, missing.size() == 1 ? "" : "s", ranks_text(missing), o_.addr, o_.port,
        joined_.size(), o_.world_size);
  }

  RendezvousOptions o_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};
  static constexpr int kDrainSeconds = 10;
  std::atomic<bool> stop_{false};
  Clock::time_point drain_until_;  // set before stop_
  bool ready_ = false, failed_ = false;
  std::string failure_;
  std::string left_;  // why the job lost a rank after it had assembled
  Clock::time_point start_;
  std::vector<Conn> conns_;
  std::map<int, std::string> joined_;  // rank -> where it connected from
  std::map<std::string, std::string> store_;
  std::multimap<std::string, int> waiting_;  // key -> connections whose get waits for it
  std::thread thread_;                       // last
};

namespace {

// connect() that gives up at `deadline`: 0, or the errno it failed with (ETIMEDOUT at the
// deadline). A host that drops SYNs (a firewall, a dead node) held a blocking connect for the
// kernel's retries, 135 s, whatever STRATA_RENDEZVOUS_TIMEOUT_S said.
int connect_until(int fd, const sockaddr* addr, socklen_t len, Clock::time_point deadline) {
  const int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  int err = ::connect(fd, addr, len) == 0 ? 0 : errno;
  while (err == EINPROGRESS || err == EINTR) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
    pollfd p{fd, POLLOUT, 0};
    const int n = ::poll(&p, 1, int(std::clamp<std::int64_t>(left, 0, 1000)));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      err = errno;
    } else if (n == 0) {
      if (left > 1000) continue;  // poll waits a second at a time
      err = ETIMEDOUT;
    } else {
      socklen_t l = sizeof err;
      if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &l) != 0) err = errno;
    }
  }
  ::fcntl(fd, F_SETFL, flags);
  return err;
}

// Connects to addr:port, retrying until `deadline`; the connected socket, or throws naming why.
// Each address gets at most 10 s a try: one that drops packets (an IPv6 address of the host
// without a route) does not keep the next one (its IPv4 address) from being tried.
int connect_with_retry(const RendezvousOptions& o, Clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string port = std::to_string(o.port);
  std::string last = "no attempt";
  auto pause = std::chrono::milliseconds(50);
  const auto start = Clock::now();
  for (;;) {
    addrinfo* res = nullptr;
    const int g = ::getaddrinfo(o.addr.c_str(), port.c_str(), &hints, &res);
    if (g != 0) {
      last = fmt::format("cannot resolve '{}': {}", o.addr, ::gai_strerror(g));
    } else {
      for (addrinfo* a = res; a; a = a->ai_next) {
        const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) continue;
        const int err = connect_until(fd, a->ai_addr, a->ai_addrlen,
                                      std::min(deadline, Clock::now() + std::chrono::seconds(10)));
        if (err == 0) {
          ::freeaddrinfo(res);
          const int one = 1;
          ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
          return fd;
        }
        last = errno_text(err);
        ::close(fd);
      }
      ::freeaddrinfo(res);
    }
    if (Clock::now() + pause > deadline) break;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(1000));
  }
  detail::throw_error(
      ErrorKind::kIo, __FILE__, __LINE__, fmt::format("connect({}:{})", o.addr, o.port),
      fmt::format("rank {} could not reach rank 0's rendezvous at {}:{} for {:.0f} s: is rank 0 "
                  "running, and MASTER_ADDR / MASTER_PORT the same for every rank and reachable "
                  "from this host? (STRATA_RENDEZVOUS_TIMEOUT_S sets the wait)",
                  o.rank, o.addr, o.port, seconds_since(start)),
      last);
}

std::string existing_rendezvous_says(const RendezvousOptions& o) {
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  RendezvousOptions local = o;
  local.addr = "127.0.0.1";  // the listener on this host
  int fd = -1;
  try {
    fd = connect_with_retry(local, deadline);
  } catch (const Error&) {
    return "";
  }
  std::string says;
  if (send_frame(fd, 'H', hello_of(o))) {
    auto [type, body] = read_frame(fd, deadline);
    if (type == 'E') says = body;
  }
  close_fd(fd);
  return says;
}

}  // namespace

TcpStore::TcpStore(const RendezvousOptions& options) : o_(options) {
  STRATA_REQUIRE(o_.world_size >= 1 && o_.rank >= 0 && o_.rank < o_.world_size,
                 "rendezvous: rank {} is not a rank of a {}-rank job", o_.rank, o_.world_size);
  STRATA_REQUIRE(o_.port > 0 && o_.port < 65536, "MASTER_PORT {} is not a TCP port (1 to 65535)",
                 o_.port);
  STRATA_REQUIRE(!o_.addr.empty(), "rendezvous: no MASTER_ADDR");
  const auto start = Clock::now();
  const auto after = [&](double s) {
    return start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  };
  try {
    if (o_.rank == 0) server_ = std::make_unique<Server>(o_);
    fd_ = connect_with_retry(o_, after(o_.timeout_s));
    sockaddr_storage me{};
    socklen_t len = sizeof me;
    if (::getsockname(fd_, reinterpret_cast<sockaddr*>(&me), &len) == 0)
      local_address_ = sockaddr_text(me);
    const std::string hello = hello_of(o_);
    STRATA_REQUIRE(send_frame(fd_, 'H', hello),
                   "rank {}: rank 0's rendezvous at {} closed the connection", o_.rank, endpoint());
    // Rank 0 reports missing ranks at its timeout: wait a little longer to hear it.
    auto [type, body] = read_frame(fd_, after(o_.timeout_s + 10));
    // (A message that names its rank already is not given this one's too: "rank 0: rank 0 ...".)
    if (type == 'E')
      STRATA_THROW(kIo, "{}",
                   body.starts_with("rank ") ? body : fmt::format("rank {}: {}", o_.rank, body));
    if (type == 'R') {
      std::size_t at = 0;
      while (at < body.size()) {
        const std::size_t nl = body.find('\n', at);
        where_.push_back(body.substr(at, nl - at));
        at = nl == std::string::npos ? body.size() : nl + 1;
      }
    }
    if (type != 'R')
      STRATA_THROW(kIo,
                   "rank {} joined rank 0's rendezvous at {} but {} after {:.0f} s; check rank 0's "
                   "output for why",
                   o_.rank, endpoint(),
                   type == 'T' ? "the job did not assemble (rank 0 stopped answering)"
                   : type == 0 ? "rank 0 closed the connection (it ended)"
                               : "got a frame it does not know",
                   seconds_since(start));
  } catch (...) {
    close_fd(fd_);
    server_.reset();
    throw;
  }
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) send_frame(fd_, 'B', "");
  close_fd(fd_);
  server_.reset();  // rank 0: after the other ranks have left, or 10 s
}

std::string TcpStore::endpoint() const { return fmt::format("{}:{}", o_.addr, o_.port); }

std::string TcpStore::where(int rank) const {
  return rank >= 0 && std::size_t(rank) < where_.size() ? where_[std::size_t(rank)] : "?";
}

void TcpStore::set(const std::string& key, const std::string& value) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string body(4, '\0');
  const std::uint32_t kn = std::uint32_t(key.size());
  std::memcpy(body.data(), &kn, 4);
  body += key;
  body += value;
  if (!send_frame(fd_, 'S', body))
    STRATA_THROW(kIo,
                 "rank {}: the rendezvous store at {} closed while setting '{}' (rank 0 ended?)",
                 o_.rank, endpoint(), key);
}

void TcpStore::abort(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ >= 0) send_frame(fd_, 'A', why);
}

std::string TcpStore::get(const std::string& key, double timeout_s) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto start = Clock::now();
  if (!send_frame(fd_, 'G', key))
    STRATA_THROW(kIo,
                 "rank {}: the rendezvous store at {} closed while asking for '{}' (rank 0 ended?)",
                 o_.rank, endpoint(), key);
  auto [type, body] = read_frame(fd_, start + std::chrono::duration_cast<Clock::duration>(
                                                  std::chrono::duration<double>(timeout_s)));
  if (type == 'V') return body;
  if (type == 'E') STRATA_THROW(kIo, "rank {}: {}", o_.rank, body);
  // The connection is now out of step (a late answer may still come): close it.
  close_fd(fd_);
  if (type == 'T')
    STRATA_THROW(kIo,
                 "rank {} waited {:.1f} s for '{}' from the rendezvous store at {}: the rank that "
                 "sets it has not (it failed or hangs, or the {:g} s it may take, "
                 "STRATA_COMM_TIMEOUT_S, are too few for the ranks' start: raise it)",
                 o_.rank, seconds_since(start), key, endpoint(), timeout_s);
  STRATA_THROW(
      kIo,
      "rank {} asked the rendezvous store at {} for '{}' and rank 0 closed it after {:.1f} "
      "s (rank 0 ended or failed)",
      o_.rank, endpoint(), key, seconds_since(start));
}

}  // namespace strata::comm
