// safetensors reading (mmap) and writing, and the Hugging Face directory layout around it.
//
// The header is untrusted input: its length, every tensor's offsets and its shape are
// checked against the file size and each other before a byte of data is touched, so a
// truncated or corrupt file is an error naming the file and offset, never a crash.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/file_kind.h"
#include "core/interrupt_files.h"
#include "core/json_config.h"
#include "core/write_fd.h"
#include "strata/error.h"
#include "strata/log.h"
#include "strata/model_io.h"
#include "strata/paths.h"

namespace strata {
namespace fs = std::filesystem;
namespace {

std::size_t st_dtype_size(const std::string& d) {
  if (d == "F32") return 4;
  if (d == "BF16" || d == "F16") return 2;
  if (d == "F64") return 8;
  return 0;
}

const char* st_dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kBF16:
      return "BF16";
    case DType::kF16:
      return "F16";
    case DType::kF64:
      return "F64";
  }
  return "?";
}

float load_elem(const std::string& d, const std::uint8_t* p, std::size_t i) {
  if (d == "F32") {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  if (d == "F64") {
    double f;
    std::memcpy(&f, p + 8 * i, 8);
    return static_cast<float>(f);
  }
  std::uint16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return d == "BF16" ? bf16_to_f32(h) : f16_to_f32(h);
}

std::string shape_str(const std::vector<std::int64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  // Non-blocking: a pipe named like a weights file is refused below, not waited on.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0)
    detail::throw_errno(__FILE__, __LINE__, "open", errno, fmt::format("cannot open {}", path));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    detail::throw_errno(__FILE__, __LINE__, "fstat", err, fmt::format("cannot stat {}", path));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    STRATA_THROW(kInvalidArgument, "{} is {}, not a safetensors file: give the model's weights",
                 path,
                 S_ISDIR(st.st_mode) ? "a folder" : "not a regular file (a device or a pipe)");
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ < 8) {
    ::close(fd);
    STRATA_THROW(kInvalidArgument,
                 "{}: truncated safetensors file ({} bytes; the 8-byte header length is missing)",
                 path, size_);
  }
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);
  if (p == MAP_FAILED)
    detail::throw_errno(__FILE__, __LINE__, "mmap", err, fmt::format("cannot map {}", path));
  base_ = static_cast<const std::uint8_t*>(p);
  try {
    std::uint64_t hlen;
    std::memcpy(&hlen, base_, 8);
    // A header that cannot be one (past the file, or not a JSON object): what the file is instead,
    // where its first bytes say (a header's length can begin with any bytes).
    if (hlen > size_ - 8 || size_ < 9 || base_[8] != '{') {
      const std::string kind = foreign_file_kind(
          std::string_view(reinterpret_cast<const char*>(base_), std::min<std::size_t>(size_, 64)));
      STRATA_REQUIRE(kind.empty(), "{} {}", path, kind);
    }
    STRATA_REQUIRE(hlen <= size_ - 8,
                   "{}: truncated safetensors file: the header claims {} bytes at offset 8 but the "
                   "file has {} bytes",
                   path, hlen, size_);
    // A tensor named twice is refused by name (the last entry won, and the first one's bytes
    // then belonged to no tensor).
    const nlohmann::json h =
        config::parse(std::string_view(reinterpret_cast<const char*>(base_) + 8, hlen),
                      fmt::format("{}: the safetensors header (offset 8, {} bytes)", path, hlen));
    STRATA_REQUIRE(h.is_object(), "{}: the safetensors header is not a JSON object", path);
    const std::size_t data0 = 8 + hlen;
    for (auto it = h.begin(); it != h.end(); ++it) {
      if (it.key() == "__metadata__") continue;
      const auto& v = it.value();
      SafetensorsInfo t;
      t.name = it.key();
      STRATA_REQUIRE(
          v.is_object() && v.contains("dtype") && v["dtype"].is_string() && v.contains("shape") &&
              v["shape"].is_array() && v.contains("data_offsets") && v["data_offsets"].is_array() &&
              v["data_offsets"].size() == 2,
          "{}: header entry of tensor '{}' needs dtype, shape and data_offsets [begin, end]", path,
          t.name);
      t.dtype = v["dtype"].get<std::string>();
      // Every number checked before it is used: a hostile header must not wrap an offset round
      // into the header or overflow an element count.
      std::size_t numel = 1;
      for (const auto& d : v["shape"]) {
        STRATA_REQUIRE(d.is_number_unsigned() && d.get<std::uint64_t>() <= (std::uint64_t(1) << 48),
                       "{}: tensor '{}' has a bad shape {}", path, t.name, v["shape"].dump());
        const std::size_t n = d.get<std::size_t>();
        STRATA_REQUIRE(n == 0 || numel <= size_ / n,
                       "{}: tensor '{}' has a shape {} larger than the file", path, t.name,
                       v["shape"].dump());
        t.shape.push_back(std::int64_t(n));
        numel *= n;
      }
      const auto& off = v["data_offsets"];
      STRATA_REQUIRE(off[0].is_number_unsigned() && off[1].is_number_unsigned(),
                     "{}: tensor '{}' has bad data_offsets {}", path, t.name, off.dump());
      const std::uint64_t o0 = off[0].get<std::uint64_t>(), o1 = off[1].get<std::uint64_t>();
      STRATA_REQUIRE(o0 <= o1 && o1 <= size_ - data0,
                     "{}: truncated or corrupt: tensor '{}' spans data bytes [{}, {}) but the file "
                     "has {} bytes ({} "
                     "after its header)",
                     path, t.name, o0, o1, size_, size_ - data0);
      t.data_begin = data0 + o0;
      t.data_end = data0 + o1;
      const std::size_t es = st_dtype_size(t.dtype);
      STRATA_REQUIRE(
          es == 0 || numel * es == t.data_end - t.data_begin,
          "{}: tensor '{}' ({} {}) needs {} bytes but its data_offsets (from offset {}) span {}",
          path, t.name, t.dtype, shape_str(t.shape), numel * es, t.data_begin,
          t.data_end - t.data_begin);
      tensors_.push_back(std::move(t));
    }
    // The data is wholly the tensors', without holes, as the format asks (Hugging Face's loader
    // refuses anything else): bytes past the last tensor are a file written over a longer one,
    // or a header that lost entries; either way not the file its writer meant.
    std::vector<std::pair<std::size_t, std::size_t>> spans;
    for (const SafetensorsInfo& t : tensors_) spans.emplace_back(t.data_begin, t.data_end);
    std::sort(spans.begin(), spans.end());
    std::size_t at = data0;
    for (const auto& [b, e] : spans) {
      STRATA_REQUIRE(
          b == at, "{}: corrupt: {}", path,
          b > at ? fmt::format(
                       "bytes [{}, {}) of the file belong to no tensor (the format has no holes)",
                       at, b)
                 : fmt::format("two tensors share the bytes from offset {}", b));
      at = e;
    }
    STRATA_REQUIRE(at == size_,
                   "{}: {} bytes after the last tensor's data (the tensors end at offset {}, the "
                   "file at {}): a file "
                   "written over a longer one, or a header that lost entries; write it again",
                   path, size_ - at, at, size_);
  } catch (...) {
    ::munmap(const_cast<std::uint8_t*>(base_), size_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() { ::munmap(const_cast<std::uint8_t*>(base_), size_); }

const SafetensorsInfo* SafetensorsFile::find(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

void SafetensorsFile::read_f32(const SafetensorsInfo& t, std::size_t first, std::size_t count,
                               float* out) const {
  const std::size_t es = st_dtype_size(t.dtype);
  STRATA_REQUIRE(es != 0, "{}: tensor '{}' has dtype {}; strata reads F32, BF16, F16 and F64",
                 path_, t.name, t.dtype);
  STRATA_REQUIRE(first + count <= (t.data_end - t.data_begin) / es,
                 "{}: elements [{}, {}) of tensor '{}', which has {}", path_, first, first + count,
                 t.name, (t.data_end - t.data_begin) / es);
  const std::uint8_t* p = data(t) + first * es;
  for (std::size_t i = 0; i < count; ++i) out[i] = load_elem(t.dtype, p, i);
  // The pages just read: out of this process's memory (the page cache keeps them for the next).
  const std::size_t page = std::size_t(::sysconf(_SC_PAGESIZE));
  const std::size_t lo = (t.data_begin + first * es) / page * page,
                    hi = t.data_begin + (first + count) * es;
  if (hi > lo) (void)::madvise(const_cast<std::uint8_t*>(base_) + lo, hi - lo, MADV_DONTNEED);
}

std::vector<float> SafetensorsFile::read_f32(const std::string& name) const {
  const SafetensorsInfo* t = find(name);
  STRATA_REQUIRE(t != nullptr, "{}: no tensor '{}'", path_, name);
  const std::size_t es = st_dtype_size(t->dtype);
  STRATA_REQUIRE(es != 0, "{}: tensor '{}' has dtype {}; strata reads F32, BF16, F16 and F64",
                 path_, name, t->dtype);
  std::vector<float> out((t->data_end - t->data_begin) / es);
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = load_elem(t->dtype, data(*t), i);
  return out;
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors) {
  nlohmann::ordered_json h = nlohmann::ordered_json::object();
  h["__metadata__"] = {{"format", "pt"}};
  std::size_t off = 0;
  std::vector<std::size_t> sizes;
  for (const auto& t : tensors) {
    std::size_t numel = 1;
    for (auto d : t.shape) numel *= static_cast<std::size_t>(d);
    const std::size_t bytes = numel * dtype_size(t.dtype);
    h[t.name] = {{"dtype", st_dtype_name(t.dtype)},
                 {"shape", t.shape},
                 {"data_offsets", {off, off + bytes}}};
    off += bytes;
    sizes.push_back(bytes);
  }
  std::string hs = h.dump();
  hs.append((8 - hs.size() % 8) % 8, ' ');
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f)
    detail::throw_errno(__FILE__, __LINE__, "fopen", errno, fmt::format("cannot create {}", path));
  const std::uint64_t hlen = hs.size();
  bool ok =
      std::fwrite(&hlen, 8, 1, f) == 1 && std::fwrite(hs.data(), 1, hs.size(), f) == hs.size();
  for (std::size_t i = 0; ok && i < tensors.size(); ++i)
    ok = sizes[i] == 0 || std::fwrite(tensors[i].data, 1, sizes[i], f) == sizes[i];
  const int err = errno;
  if (std::fclose(f) != 0) ok = false;
  if (!ok) {
    std::remove(path.c_str());
    detail::throw_errno(__FILE__, __LINE__, "fwrite", err, fmt::format("cannot write {}", path));
  }
}

namespace {

// Tensors Hugging Face checkpoints carry that are buffers, not parameters: GPT-2's causal mask
// (attn.bias, attn.masked_bias) and the rotary inverse frequencies of older Llama saves.
bool is_known_buffer(const std::string& name) {
  return name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias") ||
         name.ends_with("rotary_emb.inv_freq");
}

// One warning naming (up to five of) the tensors of `files` that no parameter took: a config
// that does not describe the weights (a bias it does not enable) would otherwise drop them
// silently.
void warn_unused(const std::string& dir, const ModelConfig& cfg,
                 const std::map<std::string, std::unique_ptr<SafetensorsFile>>& files,
                 const std::set<std::string>& used) {
  std::vector<std::string> unused;
  for (const auto& [name, f] : files)
    for (const SafetensorsInfo& t : f->tensors())
      if (!used.contains(t.name) && !is_known_buffer(t.name)) unused.push_back(t.name);
  if (unused.empty()) return;
  constexpr std::size_t kNamed = 5;
  std::string names;
  for (std::size_t i = 0; i < std::min(unused.size(), kNamed); ++i)
    names += (i ? ", " : "") + unused[i];
  if (unused.size() > kNamed) names += fmt::format(" and {} more", unused.size() - kNamed);
  log::warn(
      "{}: {} tensor{} in the weights {} not used by this {} config ({} layers) and {} skipped: "
      "{}; check "
      "that config.json describes these weights (a bias or head it does not enable?)",
      dir, unused.size(), unused.size() == 1 ? "" : "s", unused.size() == 1 ? "is" : "are",
      cfg.model_type, cfg.num_layers, unused.size() == 1 ? "was" : "were", names);
}

}  // namespace

struct HfWeightsReader::Impl {
  std::map<std::string, std::unique_ptr<SafetensorsFile>> open;  // file name -> file
  std::map<std::string, std::pair<const SafetensorsFile*, const SafetensorsInfo*>>
      of;  // parameter -> tensor
  const std::pair<const SafetensorsFile*, const SafetensorsInfo*>& at(const ParamSpec& p) const {
    const auto it = of.find(p.name);
    STRATA_REQUIRE(it != of.end(),
                   "HfWeightsReader: '{}' is not a parameter of the model it was opened for",
                   p.name);
    return it->second;
  }
};

HfWeightsReader::~HfWeightsReader() = default;

HfWeightsReader::HfWeightsReader(const std::string& dir, const ModelConfig& cfg)
    : impl_(std::make_unique<Impl>()) {
  const fs::path d(dir);
  std::map<std::string, std::string> file_of;  // tensor -> file name
  std::vector<std::string> files;
  const fs::path index = d / "model.safetensors.index.json";
  // model.safetensors first, as transformers takes it: an index beside it is an older sharded
  // save's (commit_hf_files removes it; a folder copied over another may still hold one).
  if (!fs::exists(d / "model.safetensors") && fs::exists(index)) {
    require_input_file("", index.string());
    std::ifstream in(index, std::ios::binary);
    if (!in)
      detail::throw_errno(__FILE__, __LINE__, "open", errno,
                          fmt::format("cannot read {}", index.string()));
    std::stringstream text;
    text << in.rdbuf();
    const nlohmann::json j =
        config::parse(text.str(), index.string(), /*duplicates_last_wins=*/true);
    STRATA_REQUIRE(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object() &&
                       !j["weight_map"].empty(),
                   "{}: needs a non-empty object 'weight_map' (tensor name -> shard file)",
                   index.string());
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      STRATA_REQUIRE(it.value().is_string(), "{}: weight_map['{}'] must be a file name",
                     index.string(), it.key());
      // A shard is a file of the folder (a subfolder of it too), never one outside it.
      const fs::path shard(it.value().get<std::string>());
      STRATA_REQUIRE(
          !shard.is_absolute() && std::find(shard.begin(), shard.end(), "..") == shard.end(),
          "{}: weight_map['{}'] is {}, outside the model folder: the shards are files "
          "of {}; copy them into it and name them from there",
          index.string(), it.key(), it.value().dump(), dir);
      file_of[it.key()] = it.value().get<std::string>();
      if (std::find(files.begin(), files.end(), file_of[it.key()]) == files.end())
        files.push_back(file_of[it.key()]);
    }
  } else {
    if (!fs::exists(d / "model.safetensors")) {
      // PyTorch's pickle files (pytorch_model.bin and its shards): weights strata does not read.
      std::error_code ec;
      std::string pickle;
      for (const auto& e : fs::directory_iterator(d, ec))
        if (const std::string n = e.path().filename().string();
            n.starts_with("pytorch_model") && n.ends_with(".bin"))
          pickle = n;
      STRATA_REQUIRE(pickle.empty(),
                     "{}: the weights are in {} (PyTorch's pickle format), which strata does not "
                     "read: save them as safetensors (transformers: "
                     "model.save_pretrained(dir, safe_serialization=True))",
                     dir, pickle);
      STRATA_THROW(kInvalidArgument,
                   "{}: neither model.safetensors nor model.safetensors.index.json exists: give a "
                   "Hugging Face model folder with its weights",
                   dir);
    }
    files.push_back("model.safetensors");
  }
  std::map<std::string, std::unique_ptr<SafetensorsFile>>& open = impl_->open;
  for (const auto& f : files) {
    if (!file_of.empty()) {  // a shard the index names, which is not there (a download cut short?)
      std::error_code ec;
      std::string some;
      for (const auto& [tensor, file] : file_of)
        if (file == f) some = tensor;
      STRATA_REQUIRE(fs::exists(d / f, ec),
                     "{}: {} names the shard {} (for '{}' and others), which is not there: "
                     "copy the model's every shard into {}",
                     (d / f).string(), index.filename().string(), f, some, dir);
    }
    open[f] = std::make_unique<SafetensorsFile>((d / f).string());
  }
  auto locate =
      [&](const std::string& name) -> std::pair<const SafetensorsFile*, const SafetensorsInfo*> {
    for (const std::string& n :
         {name, name.starts_with("transformer.") ? name.substr(12) : std::string()}) {
      if (n.empty()) continue;
      if (!file_of.empty()) {  // sharded: the index says where (never empty, checked above)
        auto it = file_of.find(n);
        if (it == file_of.end()) continue;
        const SafetensorsFile* f = open.at(it->second).get();
        const SafetensorsInfo* t = f->find(n);
        STRATA_REQUIRE(t != nullptr,
                       "{}: tensor '{}' is listed in the index but missing from the file",
                       f->path(), n);
        return {f, t};
      }
      const SafetensorsFile* f = open.begin()->second.get();
      if (const SafetensorsInfo* t = f->find(n)) return {f, t};
    }
    return {nullptr, nullptr};
  };
  // Check everything before anything is read.
  std::set<std::string> used;
  for (const UnitSpec& u : model_units(cfg))
    for (const ParamSpec& p : u.params) {
      auto [f, t] = locate(p.name);
      if (t == nullptr) {
        // In a shard the index does not list it for; a head the config unties and the weights
        // do not have (a tied model's folder, or config.json wrong).
        std::string held;
        if (!file_of.empty())
          for (const auto& [name, file] : open)
            if (file->find(p.name) != nullptr) held = name;
        STRATA_REQUIRE(held.empty(),
                       "{}: tensor '{}' is in {} but not in model.safetensors.index.json's "
                       "weight_map: add it there (\"{}\": \"{}\")",
                       dir, p.name, held, p.name, held);
        STRATA_THROW(kInvalidArgument,
                     "{}: tensor '{}' is missing (expected {} for {} with {} layers){}", dir,
                     p.name, shape_str(p.shape), cfg.model_type, cfg.num_layers,
                     p.name == "lm_head.weight"
                         ? "; config.json says tie_word_embeddings false (a separate head): where "
                           "the head is the embedding, it says true"
                         : "");
      }
      STRATA_REQUIRE(t->shape == p.shape, "{}: tensor '{}' has shape {}, the config needs {}",
                     f->path(), t->name, shape_str(t->shape), shape_str(p.shape));
      STRATA_REQUIRE(t->dtype == "F32" || t->dtype == "BF16" || t->dtype == "F16",
                     "{}: tensor '{}' has dtype {}; strata loads F32, BF16 and F16", f->path(),
                     t->name, t->dtype);
      impl_->of[p.name] = {f, t};
      used.insert(t->name);
    }
  warn_unused(dir, cfg, open, used);
  // A tensor in more than one shard: the one the index names is read; the others are said (a
  // loader that reads every shard whole could take another's values).
  if (!file_of.empty()) {
    std::map<std::string, std::vector<std::string>> shards_of;
    for (const auto& [name, file] : open)
      for (const SafetensorsInfo& t : file->tensors()) shards_of[t.name].push_back(name);
    std::vector<std::string> twice;
    for (const auto& [tensor, shards] : shards_of)
      if (shards.size() > 1)
        twice.push_back(fmt::format("'{}' in {} (read from {})", tensor, fmt::join(shards, " and "),
                                    file_of.contains(tensor) ? file_of.at(tensor) : shards[0]));
    if (!twice.empty())
      log::warn(
          "{}: {} tensor{} in more than one shard: {}{}; keep each in the shard the index "
          "names",
          dir, twice.size(), twice.size() == 1 ? " is" : "s are",
          fmt::join(twice.begin(),
                    twice.begin() + std::ptrdiff_t(std::min<std::size_t>(3, twice.size())), ", "),
          twice.size() > 3 ? fmt::format(" and {} more", twice.size() - 3) : "");
  }
}

void HfWeightsReader::read(const ParamSpec& p, std::size_t first, std::size_t count,
                           float* out) const {
  const auto [f, t] = impl_->at(p);
  f->read_f32(*t, first, count, out);
  // A weight that is not finite makes every step's loss or gradient norm NaN from the first, and
  // the run stops after three of them blaming the learning rate: named here instead.
  bool finite = true;
  for (std::size_t i = 0; i < count; ++i) finite &= std::isfinite(out[i]);
  if (finite) return;
  const std::size_t i =
      std::size_t(std::find_if(out, out + count, [](float v) { return !std::isfinite(v); }) - out);
  STRATA_THROW(kInvalidArgument,
               "{}: tensor '{}' holds {} (element {}): the model's weights are not finite; "
               "it was saved from a run whose weights overflowed, or the file is damaged: use a "
               "good copy of the model",
               f->path(), p.name,
               std::isnan(out[i]) ? "NaN"
               : out[i] > 0       ? "+Inf"
                                  : "-Inf",
               first + i);
}

std::pair<std::string, const std::uint8_t*> HfWeightsReader::raw(const ParamSpec& p) const {
  const auto [f, t] = impl_->at(p);
  return {t->dtype, f->data(*t)};
}

void load_hf_weights(const std::string& dir, ResidentWeights& w) {
  const HfWeightsReader reader(dir, w.config());
  const DType wd = w.dtype();
  for (const UnitSpec& u : w.units())
    for (const ParamSpec& p : u.params) {
      const auto [dtype, bytes] = reader.raw(p);
      if (dtype == st_dtype_name(wd)) {
        w.set_bytes(p.name, bytes, p.numel * dtype_size(wd));
        continue;
      }
      std::vector<float> v(p.numel);
      reader.read(p, 0, p.numel, v.data());
      w.set(p.name, v);
    }
}

// The shards are planned from the tensors' sizes (cut before a tensor that would take a shard past
// max_shard_bytes; one larger than that gets a shard of its own), and each shard's header written
// when the shard is opened; tensors then stream into it in order.
struct HfWeightsWriter::Impl {
  struct Tensor {
    const ParamSpec* p;
    std::size_t shard;
  };
  fs::path dir;
  ModelConfig cfg;
  DType dtype;
  std::vector<UnitSpec> units;
  std::vector<std::vector<Tensor>> shards;                   // in write order
  std::vector<std::string> names;                            // shard file names
  std::vector<std::pair<std::string, std::string>> renames;  // tmp -> final, of what was written
  std::FILE* f = nullptr;                                    // the shard being written
  std::size_t shard = SIZE_MAX, next_unit = 0, total = 0;
  bool finished = false;

  std::vector<int> slots;  // the temporary files, removed if the process is interrupted

  std::string tmp_of(const std::string& name) {
    const fs::path fin = dir / name, tmp = dir / (".strata-tmp-" + name);
    renames.emplace_back(tmp.string(), fin.string());
    slots.push_back(core::remove_file_on_interrupt(tmp.string()));
    return tmp.string();
  }
  void forget_temporaries() {
    for (const int slot : slots) core::forget_interrupt_file(slot);
    slots.clear();
  }
  void check(bool ok, int err) {
    if (!ok)
      detail::throw_errno(__FILE__, __LINE__, "fwrite", err,
                          fmt::format("cannot write {}", renames.back().first));
  }
  void close_shard() {
    if (!f) return;
    const bool ok = std::fclose(f) == 0;  // the buffered tail is written here (ENOSPC, EIO)
    const int err = errno;
    f = nullptr;
    check(ok, err);
  }
  void open_shard(std::size_t s) {
    close_shard();
    shard = s;
    nlohmann::ordered_json h = nlohmann::ordered_json::object();
    h["__metadata__"] = {{"format", "pt"}};
    std::size_t off = 0;
    for (const Tensor& t : shards[s]) {
      const std::size_t bytes = t.p->numel * dtype_size(dtype);
      h[t.p->name] = {{"dtype", st_dtype_name(dtype)},
                      {"shape", t.p->shape},
                      {"data_offsets", {off, off + bytes}}};
      off += bytes;
    }
    std::string hs = h.dump();
    hs.append((8 - hs.size() % 8) % 8, ' ');
    const std::string path = tmp_of(names[s]);
    f = std::fopen(path.c_str(), "wb");
    if (!f)
      detail::throw_errno(__FILE__, __LINE__, "fopen", errno,
                          fmt::format("cannot create {}", path));
    const std::uint64_t hlen = hs.size();
    const bool ok =
        std::fwrite(&hlen, 8, 1, f) == 1 && std::fwrite(hs.data(), 1, hs.size(), f) == hs.size();
    check(ok, errno);  // errno read after the writes (an argument's order is unspecified)
  }
  // `n` fp32 values as `dtype`, a few MiB at a time.
  void put(const float* v, std::size_t n) {
    constexpr std::size_t kChunk = std::size_t(1) << 20;
    if (dtype == DType::kF32) {
      const bool ok = n == 0 || std::fwrite(v, 4, n, f) == n;
      check(ok, errno);
      return;
    }
    std::vector<std::uint16_t> h(std::min(n, kChunk));
    for (std::size_t at = 0; at < n; at += kChunk) {
      const std::size_t k = std::min(kChunk, n - at);
      for (std::size_t i = 0; i < k; ++i) h[i] = f32_to_bf16(v[at + i]);
      const bool ok = std::fwrite(h.data(), 2, k, f) == k;
      check(ok, errno);
    }
  }
};

HfWeightsWriter::HfWeightsWriter(const std::string& dir, const ModelConfig& cfg, DType dtype,
                                 std::size_t max_shard_bytes)
    : impl_(std::make_unique<Impl>()) {
  STRATA_REQUIRE(max_shard_bytes > 0, "save: max_shard_bytes must be > 0");
  STRATA_REQUIRE(dtype == DType::kF32 || dtype == DType::kBF16,
                 "save: weights are written as fp32 or bf16, not {}", dtype_name(dtype));
  Impl& w = *impl_;
  w.dir = dir;
  w.cfg = cfg;
  w.dtype = dtype;
  w.units = model_units(cfg);
  std::error_code ec;
  fs::create_directories(w.dir, ec);
  STRATA_REQUIRE(!ec, "cannot create the directory {}: {}", dir, ec.message());
  w.shards.emplace_back();
  std::size_t cur = 0;
  for (std::size_t u = 0; u < w.units.size(); ++u)
    for (const ParamSpec& p : w.units[u].params) {
      const std::size_t bytes = p.numel * dtype_size(dtype);
      if (!w.shards.back().empty() && cur + bytes > max_shard_bytes) {
        w.shards.emplace_back();
        cur = 0;
      }
      cur += bytes;
      w.total += bytes;
      w.shards.back().push_back({&p, w.shards.size() - 1});
    }
  const std::size_t n = w.shards.size();
  for (std::size_t s = 0; s < n; ++s)
    w.names.push_back(n == 1 ? "model.safetensors"
                             : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, n));
}

HfWeightsWriter::~HfWeightsWriter() {
  Impl& w = *impl_;
  if (w.f) std::fclose(w.f);
  if (!w.finished) {
    std::error_code ec;
    for (const auto& [tmp, fin] : w.renames) fs::remove(tmp, ec);
  }
  w.forget_temporaries();
}

void HfWeightsWriter::write_unit(std::size_t unit, const float* flat) {
  Impl& w = *impl_;
  STRATA_REQUIRE(!w.finished && unit == w.next_unit && unit < w.units.size(),
                 "HfWeightsWriter: unit {} written out of order (next: {} of {})", unit,
                 w.next_unit, w.units.size());
  for (const ParamSpec& p : w.units[unit].params) {
    std::size_t s = w.shard == SIZE_MAX ? 0 : w.shard;
    while (std::none_of(w.shards[s].begin(), w.shards[s].end(),
                        [&](const Impl::Tensor& t) { return t.p == &p; }))
      ++s;
    if (s != w.shard) w.open_shard(s);
    w.put(flat + p.offset, p.numel);
  }
  ++w.next_unit;
}

std::vector<std::string> HfWeightsWriter::finish(const std::string& side_files_from) {
  Impl& w = *impl_;
  STRATA_REQUIRE(w.next_unit == w.units.size(), "HfWeightsWriter: {} of {} units written",
                 w.next_unit, w.units.size());
  w.close_shard();
  const std::size_t n = w.shards.size();
  if (n > 1) {
    nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
    for (std::size_t s = 0; s < n; ++s)
      for (const Impl::Tensor& t : w.shards[s]) weight_map[t.p->name] = w.names[s];
    nlohmann::ordered_json idx = {{"metadata", {{"total_size", w.total}}},
                                  {"weight_map", weight_map}};
    write_hf_text_file(w.tmp_of("model.safetensors.index.json"), idx.dump(2) + "\n",
                       (w.dir / "model.safetensors.index.json").string());
  }
  ModelConfig cfg = w.cfg;
  if (cfg.raw.is_object()) {
    // And "dtype", where newer transformers wrote it: it reads that one first, so a stale
    // "bfloat16" beside fp32 weights would load them as bf16.
    const char* dtype = w.dtype == DType::kBF16 ? "bfloat16" : "float32";
    cfg.raw["torch_dtype"] = dtype;
    if (cfg.raw.contains("dtype")) cfg.raw["dtype"] = dtype;
  }
  std::string text = model_config_json(cfg);
  if (!cfg.raw.is_object() && w.dtype == DType::kBF16) {
    auto j = nlohmann::json::parse(text);
    j["torch_dtype"] = "bfloat16";
    text = j.dump(2);
  }
  write_hf_text_file(w.tmp_of("config.json"), text + "\n", (w.dir / "config.json").string());
  // The model folder's tokenizer, chat template and generation settings, copied to temporary
  // names too: the whole folder is moved into place at once (copied after the weights were,
  // a run stopped between left a model without its tokenizer).
  std::vector<std::string> copied;
  std::error_code ec;
  if (!side_files_from.empty() && !fs::equivalent(side_files_from, w.dir, ec))
    for (const std::string& name : hf_side_files()) {
      const fs::path src = fs::path(side_files_from) / name;
      if (!fs::is_regular_file(src, ec)) continue;
      const std::string tmp = w.tmp_of(name);
      fs::copy_file(src, tmp, fs::copy_options::overwrite_existing, ec);
      if (ec) STRATA_THROW(kIo, "cannot copy {} to {}: {}", src.string(), tmp, ec.message());
      copied.push_back(name);
    }
  // The weights take their names last: a folder with them holds the rest.
  std::stable_partition(w.renames.begin(), w.renames.end(), [](const auto& r) {
    return !fs::path(r.second).filename().string().starts_with("model");
  });
  commit_hf_files(w.dir.string(), w.renames, n > 1);
  w.finished = true;
  w.forget_temporaries();
  return copied;
}

std::size_t HfWeightsWriter::files() const { return impl_->shards.size(); }

void save_hf_weights(const std::string& dir, const ResidentWeights& w,
                     std::size_t max_shard_bytes) {
  HfWeightsWriter out(dir, w.config(), w.dtype(), max_shard_bytes);
  for (std::size_t u = 0; u < w.units().size(); ++u) {
    std::vector<float> flat(w.units()[u].numel, 0.0f);
    for (const ParamSpec& p : w.units()[u].params) {
      const std::vector<float> v =
          w.get(p.name);  // bf16 weights widened exactly: written back the same
      std::copy(v.begin(), v.end(), flat.begin() + std::ptrdiff_t(p.offset));
    }
    out.write_unit(u, flat.data());
  }
  out.finish();
}

void fsync_path(const std::string& path, bool folder, const char* what) {
  const int fd = ::open(path.c_str(), (folder ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0)
    STRATA_THROW(kIo, "{}: cannot open {} to fsync it: {}", what, path, std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) STRATA_THROW(kIo, "{}: fsync {} failed: {}", what, path, std::strerror(err));
}

void write_hf_text_file(const std::string& path, const std::string& text,
                        const std::string& shown) {
  const auto fail = [&](int err) {
    std::error_code ec;
    if (fs::is_regular_file(path, ec)) fs::remove(path, ec);
    STRATA_THROW(kIo, "cannot write {}: {}{}", shown, std::strerror(err),
                 err == ENOSPC || err == EDQUOT ? ": free space there, or save elsewhere" : "");
  };
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(errno);
  int err = write_fd_fully(fd, text.data(), text.size());
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err != 0) fail(err);
}

void commit_hf_files(const std::string& dir,
                     const std::vector<std::pair<std::string, std::string>>& renames,
                     bool sharded) {
  const fs::path d(dir);
  std::error_code ec;
  // A single-file save must not leave an older index pointing at stale shards, nor a sharded one
  // an older model.safetensors (loaders take it before the index); and no older shard stays.
  // On the drive before they take the final names, and the names on the drive after: a power
  // loss must not leave a model.safetensors that is empty or partial (checkpoints do the same).
  for (const auto& [tmp, fin] : renames) fsync_path(tmp, false, "model save");
  fs::remove(d / (sharded ? "model.safetensors" : "model.safetensors.index.json"), ec);
  for (const auto& [tmp, fin] : renames) {
    fs::rename(tmp, fin, ec);
    STRATA_REQUIRE(!ec, "cannot rename {} to {}: {}", tmp, fin, ec.message());
  }
  fsync_path(dir, true, "model save");
  std::vector<fs::path> stale;
  for (fs::directory_iterator it(d, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string f = it->path().filename().string();
    const bool old_shard = f.starts_with("model-") && f.ends_with(".safetensors") &&
                           f.find("-of-") != std::string::npos;
    if (!old_shard && !f.starts_with(".strata-tmp-")) continue;
    bool ours = false;
    for (const auto& [tmp, fin] : renames) ours = ours || fs::path(fin).filename() == f;
    if (!ours) stale.push_back(it->path());
  }
  for (const fs::path& p : stale) fs::remove(p, ec);
}

const std::vector<std::string>& hf_side_files() {
  static const std::vector<std::string> names = {"tokenizer.json",
                                                 "tokenizer_config.json",
                                                 "special_tokens_map.json",
                                                 "tokenizer.model",
                                                 "added_tokens.json",
                                                 "vocab.json",
                                                 "merges.txt",
                                                 "chat_template.jinja",
                                                 "chat_template.json",
                                                 "generation_config.json"};
  return names;
}

}  // namespace strata
