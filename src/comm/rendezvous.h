// The TCP rendezvous of a launch without MPI (torchrun, srun without --mpi): rank 0 listens at
// MASTER_ADDR:MASTER_PORT, every rank (rank 0 too) connects to it, and once all world_size ranks
// have shaken hands the connection stays open as a small key-value store: the NCCL unique id
// and Gloo's pair addresses travel through it. src/comm only.
//
// Invariants:
//  - The handshake checks the protocol version, the job token (STRATA_JOB_TOKEN, else the
//    launcher's run id), the world size and that every rank is claimed once; a mismatch ends
//    the rendezvous on every rank that has joined, with a message naming both sides.
//  - Every wait has a deadline: rank 0 waits `timeout_s` for the others and then names the
//    missing ranks; the others retry their connection until `timeout_s` and then name the
//    address they could not reach. Nothing waits for ever.
//  - get() waits for a key that another rank sets; set() never blocks on the others. Once a rank
//    has stopped (abort(), or its process ended without destroying its store), every waiting
//    and later get of a missing key fails at once, naming it.
// Never: binds a port other than MASTER_PORT, or serves after the process's store is gone.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace strata::comm {

struct RendezvousOptions {
  std::string addr;  // MASTER_ADDR: rank 0's host, as the others reach it
  int port = 0;      // MASTER_PORT
  int rank = 0;
  int world_size = 1;
  double timeout_s = 300;  // STRATA_RENDEZVOUS_TIMEOUT_S
  std::string token;       // the job's identity: every rank must give the same
};

class TcpStore {
 public:
  // Collective: returns once all world_size ranks have joined, else throws kComm naming who is
  // missing, who disagreed, or what could not be reached.
  explicit TcpStore(const RendezvousOptions& options);
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, const std::string& value);
  // Waits up to timeout_s for `key` (set by any rank); throws kComm naming the key after that.
  std::string get(const std::string& key, double timeout_s);

  // Tells every rank waiting on the store (and every later get of a key not yet set) that this
  // rank stopped, and why: they end at once instead of at their timeout. A rank whose process
  // ends without an orderly destruction of its store counts as stopped too.
  void abort(const std::string& why);

  // This host's address on its route to rank 0 (what the others can reach it at).
  const std::string& local_address() const noexcept { return local_address_; }
  // "addr:port", for messages.
  std::string endpoint() const;
  // Where rank `rank` joined from: "<its host name> (<its address as rank 0 saw it>)".
  std::string where(int rank) const;
  const RendezvousOptions& options() const noexcept { return o_; }

 private:
  class Server;
  RendezvousOptions o_;
  std::unique_ptr<Server> server_;  // rank 0 only
  int fd_ = -1;
  std::string local_address_;
  std::vector<std::string> where_;  // by rank, from rank 0's table
  std::mutex mu_;                   // one request at a time on fd_
};

// Reads STRATA_RENDEZVOUS_TIMEOUT_S (seconds, > 0), else 300.
double rendezvous_timeout_s();

}  // namespace strata::comm
