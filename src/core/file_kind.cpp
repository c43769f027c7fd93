#include "core/file_kind.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>

#include "strata/corpus.h"

namespace strata {

std::string foreign_file_kind(std::string_view head) {
  const auto starts = [&](std::string_view magic) { return head.substr(0, magic.size()) == magic; };
  if (starts("version https://git-lfs.github.com/spec/"))
    return "is a Git LFS pointer, not the file itself (the repository was cloned without "
           "git-lfs): fetch it with `git lfs install && git lfs pull` in the repository, or "
           "download the model with `huggingface-cli download`";
  if (starts("\x1f\x8b\x08"))  // (gzip's magic and its one method, deflate)
    return "is gzip-compressed: decompress it first (gunzip -k) and give the result";
  if (starts("\x28\xb5\x2f\xfd"))
    return "is zstd-compressed: decompress it first (zstd -d) and give the result";
  if (starts("\xfd"
             "7zXZ"))
    return "is xz-compressed: decompress it first (xz -dk) and give the result";
  // (bzip2's "BZh", its block size digit and its block magic; Parquet's "PAR1" then binary bytes:
  // a text that begins with those letters is text.)
  const auto binary = [&] {
    return std::any_of(head.begin(), head.end(), [](char c) {
      const auto u = static_cast<unsigned char>(c);
      return u < 0x09 || (u > 0x0d && u < 0x20);
    });
  };
  if (head.size() >= 10 && starts("BZh") && head[3] >= '1' && head[3] <= '9' &&
      head.substr(4, 6) == "\x31\x41\x59\x26\x53\x59")
    return "is bzip2-compressed: decompress it first (bunzip2 -k) and give the result";
  if (starts("PK\x03\x04"))
    return "is a zip archive (or a PyTorch .bin / .pt file): unpack it, or for weights give "
           "safetensors";
  if (starts("PAR1") && binary())
    return "is a Parquet table: strata reads text (.txt) and JSON lines (.jsonl); write it out "
           "as JSON lines first (e.g. pandas: read_parquet(...).to_json(path, orient=\"records\", "
           "lines=True))";
  if (starts(std::string_view(kPreparedMagic, sizeof kPreparedMagic)))
    return "is a corpus strata-prep already prepared (tokenized): give it to strata-train --data";
  return "";
}

std::string foreign_file_kind_of(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  char buf[64] = {};
  if (!f.read(buf, sizeof buf) && f.gcount() <= 0) return "";
  return foreign_file_kind(std::string_view(buf, std::size_t(f.gcount())));
}

}  // namespace strata
