// Files users meet in place of the one a flag asks for, told by their first bytes: a Git LFS
// pointer (a model repository cloned without git-lfs), a compressed file, a Parquet table, a
// strata prepared file. Each read path names what the file is and what to do, where it said
// only "truncated", "not UTF-8" or "format unknown".
#pragma once

#include <string>
#include <string_view>

namespace strata {

// What the file whose first bytes are `head` (at least its first 64 when it has them) is and
// the fix, as a sentence's end after its path ("is a Git LFS pointer ..."); "" for none of them.
std::string foreign_file_kind(std::string_view head);

// The same for the file at `path` (its first bytes read); "" when it cannot be read.
std::string foreign_file_kind_of(const std::string& path);

}  // namespace strata
