// strata-bench: benchmark programs. Each subcommand measures one subsystem, prints a table
// with a ratio to a bound measured in the same run (memory bandwidth, fio, link speed),
// and with --json prints, last, one JSON object of its figures.
#include <cstdio>

#include "bench_common.h"
#include "strata/device.h"
#include "strata/error.h"
#include "tool_main.h"

int main(int argc, char** argv) {
  strata::reexec_with_passive_openmp(argv);  // before libgomp's first team: see device.h
  CLI::App app{"strata-bench: measure strata's subsystems against the machine's own bounds"};
  app.require_subcommand(1);
  strata::bench::add_nvme_command(app);
  strata::bench::add_adam_command(app);
  strata::bench::add_comm_command(app);
  strata::bench::add_model_command(app);
  strata::bench::add_tp_command(app);
  strata::bench::add_engine_command(app);
  strata::bench::add_gpu_command(app);
  strata::bench::add_tokenize_command(app);
  return strata::tools::run_tool("strata-bench", app, argc, argv, strata::tools::ToolRuns::kernels,
                                 [] { return strata::bench::exit_code(); });
}
