// Placeholder until the nvme benchmark lands in this change.
#include "bench_common.h"
void strata::bench::add_nvme_command(CLI::App&) {}
