// The files and folders a program reads and writes, checked before any work: a file it reads is
// there and is a file, a folder is a folder, and what it writes replaces nothing the user keeps:
// no file it reads, no other output of its own, no file of the user's without their word
// (--overwrite). strata::train makes these checks itself; the tools make them for their own
// flags. Each failure is a strata::Error whose message names the flag, the path and the fix.
//
//   require_input_file("--data", "corpus.bin");
//   NamedPaths ins = model_files_in_folder("--model", "llama/");
//   ins.push_back({"--data", "corpus.bin"});
//   require_outputs_apart("strata-prep", {{"-o", "out.bin"}}, ins);
//   require_output_file("-o", "out.bin", /*overwrite=*/false);
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace strata {

// Flags and the paths they name.
using NamedPaths = std::vector<std::pair<std::string, std::string>>;

// Whether `path` is a stream to write into as it is, never a file to replace by renaming a
// finished one over it (run as root, that put a regular file in place of /dev/null, or of the
// /dev/stdout link, for every program on the machine): a device, a pipe or a socket, a path in
// /proc (/dev/fd/N too), or a link into /proc or /dev (/dev/stdout, whatever its stream is now).
bool written_in_place(const std::string& path);
// Whether `path` is the null device (a character device 1:3): what is written there is dropped.
bool null_device(const std::string& path);
// `n` bytes written into the stream at `path` (written_in_place): opened without creating
// anything, appended (a link to a redirected stdout keeps what is there), without waiting for a
// FIFO's reader (ENXIO when there is none), a reader gone said as EPIPE rather than ending the
// process by SIGPIPE. 0, or the errno of what failed.
int write_into(const std::string& path, const void* data, std::size_t n);
// `n` bytes written to `fd` with SIGPIPE held back in this thread: a pipe's reader gone is EPIPE,
// not the end of the process. 0, or the errno of what failed.
int write_holding_sigpipe(int fd, const void* data, std::size_t n);
// The bytes of the open file `from_fd` (from its start) written into the stream at `path` as
// write_into does, except that a FIFO's reader is waited for and a reader gone raises SIGPIPE (a
// one-shot tool's output, as `cat > fifo`). 0, or the errno of what failed.
int copy_into(int from_fd, const std::string& path);
// An output the user named, opened for writing from its start: a stream (written_in_place) as
// copy_into opens one (its own descriptor where the path names one, else appended to by name,
// creating nothing), a file created or emptied. The descriptor (close-on-exec), or -1 with errno.
// (A std::ofstream of /dev/stdout opens the redirected file again, emptied, at an offset of its
// own: the console's lines were written over.)
int open_output(const std::string& path);
// `text` written as the whole output at `path` (write_into for a stream, else open_output): 0, or
// the errno of what failed.
int write_output(const std::string& path, std::string_view text);

// The path as one key for the file it names: absolute, with links, "." and ".." resolved as far
// as the path exists (a file not made yet keeps its own name); where the folders cannot be read,
// absolute and lexically normal. Two names of one file by a link give one key; hard links do not
// (same_file sees those).
std::string canonical_path(const std::string& path);

// Whether two paths name one file: the same path once links, "." and ".." are resolved, or one
// file under two names (hard links). An empty path names none.
bool same_file(const std::string& x, const std::string& y);

// An exclusive flock on the open file `fd`, taken without waiting: false only when another open
// of the file holds it (EWOULDBLOCK); true when taken, and where the file system has no locks
// (the caller goes on unlocked there). How a run holds what it writes into (its --out, its log)
// for its life, released when `fd` is closed:
//   if (!lock_unless_held(fd)) throw ...("in use by another running strata-train ...");
bool lock_unless_held(int fd);

// A file read is there and is a file (a folder named by mistake is said as one). `flag` may be
// empty (a positional argument).
void require_input_file(const std::string& flag, const std::string& path);

// A folder read or written in is there and is a folder (a file named by mistake is said as one);
// `what` is what the flag wants, for the message ("the model's Hugging Face folder").
void require_input_folder(const std::string& flag, const std::string& path,
                          const std::string& what);

// A folder the work writes files in leaves room for their names: `path` plus `longest_below`
// bytes (the longest name the work makes under it, e.g. a checkpoint's
// step-<N>.tmp-<tag>/rank<R>.json) fits the system's limit for a path (PATH_MAX), and no name in
// `path` passes the limit for one name (NAME_MAX). Checked before any work: such a folder was
// refused at the first checkpoint, or when the model was written at the end.
void require_room_for_names(const std::string& flag, const std::string& path,
                            std::size_t longest_below);

// A file of the user's at `path` (a regular file, or a link to none: a folder, a device or a pipe
// is no file to replace) is replaced only with `overwrite` (--overwrite).
void require_overwrite_to_replace(const std::string& flag, const std::string& path, bool overwrite);

// A file written when the work is done (a recommendation, a picture, a trace), checked before
// anything is measured, so a run of minutes does not end in "cannot be written": its folder
// exists and takes a new file, and a file already there is replaced only with `overwrite`. A
// device or a pipe holds nothing to replace. An empty path is no file.
void require_output_file(const std::string& flag, const std::string& path, bool overwrite);

// Refuses `flag path` whose folder `folder` does not exist, saying how to make it.
[[noreturn]] void throw_folder_missing(const std::string& flag, const std::string& path,
                                       const std::string& folder);

// What `who` writes (`outs`), against itself and what it reads (`ins`): no file named twice (the
// later write would replace the earlier), and no file read (a corpus, a config, a model's
// weights), overwrite or not. A device or a pipe holds nothing to replace. Empty paths are none.
void require_outputs_apart(const std::string& who, const NamedPaths& outs, const NamedPaths& ins);

// The files of a Hugging Face folder strata reads (config, weights and their index, tokenizer,
// chat template, generation settings) that are in `folder`, each named "<flag> folder's <name>";
// none where it is no folder. Other files there (a log kept beside the model) are the user's.
NamedPaths model_files_in_folder(const std::string& flag, const std::string& folder);

}  // namespace strata
