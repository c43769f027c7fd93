// Where this process sits in the job, from its launcher's variables alone (launch_env.cpp:
// pure functions of the environment, unit tested with made-up ones).
//
// Precedence, when several launchers' variables are present (the launcher that started this
// process is the innermost, and its variables are the ones that describe this job):
//  1. MPI's (OMPI_COMM_WORLD_*, PMIX_RANK, PMI_RANK): only MPI's launchers set them, and they are
//     inherited into what mpirun starts even inside a Slurm allocation (whose SLURM_* describe
//     the allocation or mpirun's own daemons, not this job's ranks). torchrun's variables beside
//     them (torchrun started under mpirun, or a stale RANK in a login shell) are ignored when
//     they agree, refused when they describe another world.
//  2. torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
//     GROUP_RANK, GROUP_WORLD_SIZE): `srun torchrun ...`, the usual way to run torchrun across
//     nodes, starts its workers with Slurm's variables too, and the workers are torchrun's.
//  3. A Slurm step's (srun without --mpi): SLURM_PROCID with SLURM_STEP_NUM_TASKS (or
//     SLURM_NTASKS with a step id). A batch script's own environment (sbatch: SLURM_NTASKS but
//     no step) is not a launch: it is one process, as a plain shell is.
#include <cstdlib>
#include <string>
#include <string_view>

#include "comm/comm_internal.h"
#include "strata/error.h"

namespace strata::comm {
namespace {

// A non-negative integer, else -1 (unset, empty or not a number).
int to_int(const char* v) {
  if (!v || !*v) return -1;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || x < 0 || x > 1 << 30) return -1;
  return int(x);
}

}  // namespace

std::vector<std::string> expand_slurm_nodelist(std::string_view list) {
  std::vector<std::string> out;
  // Split at the commas outside brackets.
  std::vector<std::string_view> items;
  int depth = 0;
  std::size_t start = 0;
  for (std::size_t i = 0; i <= list.size(); ++i) {
    if (i == list.size() || (list[i] == ',' && depth == 0)) {
      if (i > start) items.push_back(list.substr(start, i - start));
      start = i + 1;
    } else if (list[i] == '[') {
      STRATA_REQUIRE(depth == 0, "Slurm node list '{}' nests brackets", list);
      ++depth;
    } else if (list[i] == ']') {
      STRATA_REQUIRE(depth == 1, "Slurm node list '{}' closes a bracket it did not open", list);
      --depth;
    }
  }
  STRATA_REQUIRE(depth == 0, "Slurm node list '{}' leaves a bracket open", list);
  for (std::string_view item : items) {
    const std::size_t open = item.find('[');
    if (open == std::string_view::npos) {
      out.emplace_back(item);
      continue;
    }
    const std::size_t close = item.find(']', open);
    const std::string prefix(item.substr(0, open));
    const std::string_view ranges = item.substr(open + 1, close - open - 1);
    // The rest may hold another bracket group ("rack[1-2]-n[01-02]"): expand it too.
    const std::vector<std::string> suffixes = close + 1 < item.size()
                                                  ? expand_slurm_nodelist(item.substr(close + 1))
                                                  : std::vector<std::string>{""};
    std::size_t at = 0;
    while (at <= ranges.size()) {
      std::size_t comma = ranges.find(',', at);
      if (comma == std::string_view::npos) comma = ranges.size();
      const std::string_view r = ranges.substr(at, comma - at);
      at = comma + 1;
      const std::size_t dash = r.find('-');
      const std::string_view lo_s = r.substr(0, dash);
      const std::string_view hi_s = dash == std::string_view::npos ? lo_s : r.substr(dash + 1);
      const std::string lo_str(lo_s), hi_str(hi_s);
      const int lo = to_int(lo_str.c_str()), hi = to_int(hi_str.c_str());
      STRATA_REQUIRE(lo >= 0 && hi >= lo && hi - lo < 100000,
                     "Slurm node list '{}': '{}' is not a number or a range lo-hi", list, r);
      const std::size_t width = lo_s.size();  // "01-03": zero-padded to the low bound's width
      for (int n = lo; n <= hi; ++n) {
        std::string num = std::to_string(n);
        if (num.size() < width) num.insert(0, width - num.size(), '0');
        for (const auto& s : suffixes) out.push_back(prefix + num + s);
      }
    }
  }
  return out;
}

int slurm_tasks_on_node(std::string_view tasks_per_node, int node_id) {
  // "2(x3),1": nodes 0-2 run 2 tasks, node 3 runs 1.
  int node = 0;
  std::size_t at = 0;
  while (at < tasks_per_node.size()) {
    std::size_t comma = tasks_per_node.find(',', at);
    if (comma == std::string_view::npos) comma = tasks_per_node.size();
    const std::string item(tasks_per_node.substr(at, comma - at));
    at = comma + 1;
    int count = 0, repeat = 1;
    const std::size_t x = item.find("(x");
    count = to_int(item.substr(0, x).c_str());
    if (x != std::string::npos) {
      const std::size_t end = item.find(')', x);
      if (end == std::string::npos) return -1;
      repeat = to_int(item.substr(x + 2, end - x - 2).c_str());
    }
    if (count < 0 || repeat < 1) return -1;
    if (node_id < node + repeat) return count;
    node += repeat;
  }
  return -1;
}

EnvLaunch launch_from_env(const EnvLookup& lookup) {
  auto get = [&](const char* n) -> const char* {
    const char* v = lookup(n);
    return v && *v ? v : nullptr;
  };
  auto first_int = [&](std::initializer_list<const char*> names) {
    for (const char* n : names)
      if (const int x = to_int(get(n)); x >= 0) return x;
    return -1;
  };
  EnvLaunch e;
  LaunchInfo& li = e.info;
  // A variable that is set but no whole number >= 0 is refused, naming it: MASTER_PORT=abc
  // silently became the default port (two jobs believing they had their own could meet).
  auto not_a_number = [&](std::initializer_list<const char*> names) -> bool {
    for (const char* n : names)
      if (get(n) && to_int(get(n)) < 0) {
        e.refusal = fmt::format(
            "{}='{}' is not a whole number {}: set it as the launcher would, "
            "or unset it",
            n, get(n),
            std::string_view(n) == "MASTER_PORT" ? "(a TCP port, 1 to 65535)" : "of 0 or more");
        return true;
      }
    return false;
  };
  const bool torch = get("RANK") || get("WORLD_SIZE");
  const int torch_world = to_int(get("WORLD_SIZE"));

  if (get("OMPI_COMM_WORLD_RANK")) {
    li.launcher = "openmpi";
    li.rank = first_int({"OMPI_COMM_WORLD_RANK"});
    li.world_size = first_int({"OMPI_COMM_WORLD_SIZE"});
    li.local_rank = first_int({"OMPI_COMM_WORLD_LOCAL_RANK"});
    li.local_size = first_int({"OMPI_COMM_WORLD_LOCAL_SIZE"});
  } else if (get("PMIX_RANK")) {
    // srun --mpi=pmix: PMIx gives the rank, Slurm the step's sizes.
    li.launcher = "pmix";
    li.rank = first_int({"PMIX_RANK"});
    li.world_size = first_int({"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "PMIX_SIZE"});
    li.local_rank = first_int({"SLURM_LOCALID", "PMIX_LOCAL_RANK"});
    li.local_size = first_int({"PMIX_LOCAL_SIZE"});
    li.num_nodes = first_int({"SLURM_STEP_NUM_NODES", "SLURM_NNODES"});
    li.node_rank = first_int({"SLURM_NODEID"});
  } else if (get("PMI_RANK")) {
    li.launcher = "pmi";  // MPICH hydra, srun --mpi=pmi2
    li.rank = first_int({"PMI_RANK"});
    li.world_size = first_int({"PMI_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"});
    li.local_rank = first_int({"MPI_LOCALRANKID", "SLURM_LOCALID"});
    li.local_size = first_int({"MPI_LOCALNRANKS"});
  }
  if (li.launcher != "none") {
    li.under_mpi = true;
    if (li.rank < 0) li.rank = 0;
    if (li.world_size < 1) li.world_size = 1;
    if (li.local_rank < 0) li.local_rank = 0;
    if (li.local_size < 1) li.local_size = 1;  // refined by MPI once it is up
    if (li.num_nodes < 1) li.num_nodes = 1;    // counted by MPI once it is up
    if (li.node_rank < 0) li.node_rank = 0;
    if (torch && torch_world > 1 && torch_world != li.world_size)
      e.refusal = fmt::format(
          "this process sees two launchers: {} started it as rank {} of {}, and torchrun's "
          "variables say rank {} of {} (RANK, WORLD_SIZE); start it with one of them, or unset "
          "RANK and WORLD_SIZE under mpirun",
          li.launcher, li.rank, li.world_size, get("RANK") ? get("RANK") : "?", torch_world);
    return e;
  }

  if (torch) {
    li.launcher = "torchrun";
    const int rank = to_int(get("RANK"));
    if (torch_world < 1 || rank < 0 || rank >= torch_world) {
      e.refusal = fmt::format(
          "this process has torchrun's variables but not a valid rank: RANK={} WORLD_SIZE={}; a "
          "launcher sets both (RANK from 0 to WORLD_SIZE-1), or neither for one process",
          get("RANK") ? get("RANK") : "(unset)", get("WORLD_SIZE") ? get("WORLD_SIZE") : "(unset)");
      return e;
    }
    if (not_a_number(
            {"LOCAL_WORLD_SIZE", "LOCAL_RANK", "GROUP_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT"}))
      return e;
    // A Slurm step of more tasks than torchrun's world: variables left from another launch (srun
    // running torchrun has one task a node, WORLD_SIZE at least that many), and each task would
    // train alone.
    const int step_tasks = first_int({"SLURM_STEP_NUM_TASKS"});
    if (get("SLURM_PROCID") && step_tasks > 1 && torch_world < step_tasks) {
      e.refusal = fmt::format(
          "this process is task {} of a {}-task Slurm step, and torchrun's variables say rank {} "
          "of {} (RANK, WORLD_SIZE): left from another launch? Unset RANK and WORLD_SIZE for srun "
          "to start the ranks, or run torchrun under srun with one task a node",
          get("SLURM_PROCID"), step_tasks, rank, torch_world);
      return e;
    }
    li.rank = rank;
    li.world_size = torch_world;
    // Without LOCAL_*: every rank on this one node (documented).
    li.local_size = first_int({"LOCAL_WORLD_SIZE"});
    if (li.local_size < 1) li.local_size = torch_world;
    li.local_rank = first_int({"LOCAL_RANK"});
    if (li.local_rank < 0) li.local_rank = rank % li.local_size;
    li.num_nodes = first_int({"GROUP_WORLD_SIZE"});
    if (li.num_nodes < 1) li.num_nodes = (torch_world + li.local_size - 1) / li.local_size;
    li.node_rank = first_int({"GROUP_RANK"});
    if (li.node_rank < 0) li.node_rank = rank / li.local_size;
    if (li.local_size > torch_world || li.local_rank >= li.local_size) {
      e.refusal = fmt::format(
          "LOCAL_RANK {} of LOCAL_WORLD_SIZE {} with WORLD_SIZE {}: a launcher sets LOCAL_RANK "
          "below LOCAL_WORLD_SIZE and LOCAL_WORLD_SIZE at most WORLD_SIZE (the ranks on this "
          "node); set them so, or unset both",
          li.local_rank, li.local_size, torch_world);
      return e;
    }
    if (const char* a = get("MASTER_ADDR")) li.master_addr = a;
    li.master_port = first_int({"MASTER_PORT"});
    if (li.master_port < 0) li.master_port = kDefaultMasterPort;
    if (torch_world > 1 && li.master_addr.empty())
      e.refusal = fmt::format(
          "this process was started as rank {} of {} by a torchrun-style launcher (RANK, "
          "WORLD_SIZE) but has no MASTER_ADDR: the ranks meet at rank 0's MASTER_ADDR:MASTER_PORT "
          "(torchrun sets both; by hand, give every rank MASTER_ADDR=<rank 0's host> and "
          "MASTER_PORT=<a free port>); alone it would train as a 1-rank job",
          rank, torch_world);
    return e;
  }

  const bool step = get("SLURM_STEP_NUM_TASKS") || get("SLURM_STEP_ID") || get("SLURM_STEPID");
  if (get("SLURM_PROCID") && step) {
    li.launcher = "slurm";
    li.rank = std::max(0, first_int({"SLURM_PROCID"}));
    li.world_size = std::max(1, first_int({"SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"}));
    li.local_rank = std::max(0, first_int({"SLURM_LOCALID"}));
    li.node_rank = std::max(0, first_int({"SLURM_NODEID"}));
    li.num_nodes = std::max(1, first_int({"SLURM_STEP_NUM_NODES", "SLURM_NNODES"}));
    const char* per_node = get("SLURM_STEP_TASKS_PER_NODE");
    if (!per_node) per_node = get("SLURM_TASKS_PER_NODE");
    li.local_size = per_node ? slurm_tasks_on_node(per_node, li.node_rank) : -1;
    if (li.local_size <= li.local_rank) li.local_size = li.local_rank + 1;
    if (li.rank >= li.world_size) {
      e.refusal =
          fmt::format("SLURM_PROCID {} is not a task of a {}-task step", li.rank, li.world_size);
      return e;
    }
    if (const char* a = get("MASTER_ADDR")) {
      li.master_addr = a;
    } else {
      const char* nodes = get("SLURM_STEP_NODELIST");
      if (!nodes) nodes = get("SLURM_JOB_NODELIST");
      if (!nodes) nodes = get("SLURM_NODELIST");
      if (nodes) {
        try {
          const auto hosts = expand_slurm_nodelist(nodes);
          if (!hosts.empty()) li.master_addr = hosts.front();
        } catch (const Error& err) {
          e.refusal = err.message();
          return e;
        }
      }
    }
    if (not_a_number({"MASTER_PORT"})) return e;
    li.master_port = first_int({"MASTER_PORT"});
    if (li.master_port < 0) {
      // One port per job, so that two jobs sharing a first node do not collide.
      const int job = first_int({"SLURM_JOB_ID", "SLURM_JOBID"});
      li.master_port = job >= 0 ? kSlurmBasePort + job % kSlurmPortSpan : kDefaultMasterPort;
    }
    if (li.world_size > 1 && li.master_addr.empty())
      e.refusal = fmt::format(
          "this process is task {} of a {}-task Slurm step without MPI, and neither MASTER_ADDR "
          "nor a node list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST) names rank 0's host: set "
          "MASTER_ADDR, or run srun with --mpi=pmix",
          li.rank, li.world_size);
    return e;
  }
  return e;
}

}  // namespace strata::comm
