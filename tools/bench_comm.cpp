// Placeholder until the comm benchmark lands in this change.
#include "bench_common.h"
void strata::bench::add_comm_command(CLI::App&) {}
