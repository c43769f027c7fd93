// Files strata is writing that an interrupted process removes: a temporary file renamed into place
// when complete (a prepared corpus), which Ctrl-C or a scheduler's SIGTERM would otherwise leave,
// as large as the corpus, beside its output. Fixed slots a signal handler reads without a lock or
// an allocation; the handler is remove_swap_files_on_interrupt()'s (strata/nvme.h), which removes
// these with the swap files.
#pragma once

#include <string>

namespace strata::core {

// Removes `path` when the process is interrupted until `forget_interrupt_file` of the returned
// slot (-1, and then the file stays as before, when every slot is taken or the path is too long).
int remove_file_on_interrupt(const std::string& path);
void forget_interrupt_file(int slot) noexcept;

// Unlinks every registered file (async-signal-safe).
void remove_interrupt_files() noexcept;

}  // namespace strata::core
