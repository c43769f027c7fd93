// CollectiveWorker (comm_internal.h): the stream and thread plumbing the MPI and Gloo backends
// share; each supplies only how one collective is executed.
#include <chrono>

#include "comm/comm_internal.h"
#include "strata/log.h"

namespace strata::comm {

// One issued collective, shared by the stream's host step and the worker.
struct CollectiveWorker::Pending {
  Communicator::Collective c;
  std::string what;
  std::mutex mu;
  std::condition_variable cv;
  bool ready = false;  // the stream has reached it
  bool done = false;

  void set(bool Pending::*flag) {
    {
      std::lock_guard<std::mutex> lock(mu);
      this->*flag = true;
    }
    cv.notify_all();
  }
  void wait(bool Pending::*flag) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return this->*flag; });
  }
};

CollectiveWorker::CollectiveWorker(int rank, int world_size, double timeout_s, Execute execute,
                                   std::string context)
    : rank_(rank),
      world_size_(world_size),
      execute_(std::move(execute)),
      watchdog_(
          rank, world_size, timeout_s,
          [context = std::move(context)](const std::string& msg) { abort_job(msg + context); }) {
  thread_ = std::thread([this] { run(); });
}

CollectiveWorker::~CollectiveWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
  watchdog_.stop();
}

void CollectiveWorker::enqueue(const Communicator::Collective& c, Stream& stream) {
  auto op = std::make_shared<Pending>();
  op->c = c;
  op->what = c.describe();
  // One lock over both steps: the worker's order is the streams' issue order.
  std::lock_guard<std::mutex> issue(issue_mu_);
  stream.host_fn(
      [op] {
        op->set(&Pending::ready);
        op->wait(&Pending::done);
      },
      c.name(), c.bytes());  // the span: from the stream reaching it to the collective's end
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(op));
  }
  cv_.notify_all();
}

void CollectiveWorker::run() {
  for (;;) {
    std::shared_ptr<Pending> op;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      op = std::move(queue_.front());
      queue_.pop_front();
    }
    op->wait(&Pending::ready);
    note_in_flight(op->what);
    const auto t0 = std::chrono::steady_clock::now();
    const std::uint64_t id = watchdog_.begin(op->what);
    try {
      execute_(op->c);
    } catch (const std::exception& e) {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      abort_job(
          fmt::format("collective {} failed on rank {} of {} after {:.3f} s: {}; ending the job",
                      op->what, rank_, world_size_, s, e.what()));
    }
    watchdog_.end(id);
    note_done();
    op->set(&Pending::done);
  }
}

}  // namespace strata::comm
