// Placeholder until the adam benchmark lands in this change.
#include "bench_common.h"
void strata::bench::add_adam_command(CLI::App&) {}
