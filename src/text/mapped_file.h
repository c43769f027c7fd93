// Data files read through a read-only mapping, said by name when one shrinks under it.
//
// A file truncated or written over in place while it is mapped (`cp new.bin train.bin` opens the
// old file with O_TRUNC) takes the mapped pages past its new end away: the next read of one is a
// SIGBUS, which ended a run with "Bus error" and nothing else. map_data_file() records each
// mapping in fixed slots a signal handler can read without a lock or an allocation; the handler
// (installed with the first mapping) writes which file changed and what to do, then hands the
// signal on to the handler it replaced (strata-train's, which removes the swap files), or ends
// the process by it as before.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace strata::text {

// Maps all `size` (> 0) bytes of the open file `fd` read-only and private, for `path`; throws
// kIo naming `path` when it cannot. The caller closes `fd` (the mapping stays).
const std::uint8_t* map_data_file(int fd, std::size_t size, const std::string& path);

// Unmaps what map_data_file returned (null: nothing).
void unmap_data_file(const std::uint8_t* base, std::size_t size) noexcept;

}  // namespace strata::text
