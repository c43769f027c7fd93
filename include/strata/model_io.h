// Weights in and out in the Hugging Face layout: config.json plus model.safetensors, or
// shards model-0000k-of-0000n.safetensors with model.safetensors.index.json.
//
// Reading memory-maps each file and converts bf16 / fp16 / fp32 tensors to the weights'
// dtype on load (a tensor already in that dtype is copied bit for bit). Every failure —
// a missing or malformed file, a truncated header or data, a missing tensor, a wrong shape
// or an unsupported dtype — throws strata::Error naming the file, the tensor and the offset.
// Writing goes to temporary names that are renamed into place only once every file is
// complete, so a failed save leaves nothing behind.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "strata/dtype.h"
#include "strata/model.h"

namespace strata {

struct SafetensorsInfo {
  std::string name;
  std::string dtype;  // as in the file: "F32", "BF16", "F16", ...
  std::vector<std::int64_t> shape;
  std::size_t data_begin = 0;  // absolute file offsets
  std::size_t data_end = 0;
};

// One memory-mapped .safetensors file.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsInfo>& tensors() const { return tensors_; }
  const SafetensorsInfo* find(const std::string& name) const;  // nullptr when absent
  const std::uint8_t* data(const SafetensorsInfo& t) const { return base_ + t.data_begin; }
  // The tensor converted to fp32 (F32 / BF16 / F16 / F64); throws naming it when absent.
  std::vector<float> read_f32(const std::string& name) const;
  // Elements [first, first + count) of tensor `t` converted to fp32 into `out`, then the pages
  // they were read from dropped from this process's memory (read from the file again if touched
  // later): a reader taking a model a slice at a time holds no more of the file than one slice.
  void read_f32(const SafetensorsInfo& t, std::size_t first, std::size_t count, float* out) const;

 private:
  std::string path_;
  std::vector<SafetensorsInfo> tensors_;
  const std::uint8_t* base_ = nullptr;
  std::size_t size_ = 0;
};

// A tensor to write: `data` holds numel(shape) elements of `dtype`.
struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<std::int64_t> shape;
  const void* data = nullptr;
};
// Writes one .safetensors file (header padded to 8 bytes, tensors in the given order).
void write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors);

// The weights of a Hugging Face folder (model.safetensors.index.json when present, else
// model.safetensors) for the parameters of a model config, read a slice at a time. Opening it
// checks every parameter first — a shard missing, a tensor missing or of another shape or dtype,
// a truncated or corrupt file: strata::Error naming the file and the tensor — so nothing is
// placed from a folder that cannot be read whole. Tensors no parameter takes are skipped with one
// warning naming them (known buffers — GPT-2's attn.bias / attn.masked_bias, rotary_emb.inv_freq —
// silently); GPT-2 names are accepted with or without the "transformer." prefix.
class HfWeightsReader {
 public:
  HfWeightsReader(const std::string& dir, const ModelConfig& cfg);
  ~HfWeightsReader();
  HfWeightsReader(const HfWeightsReader&) = delete;
  HfWeightsReader& operator=(const HfWeightsReader&) = delete;
  // Elements [first, first + count) of parameter `p` (model_units(cfg)'s) in fp32.
  void read(const ParamSpec& p, std::size_t first, std::size_t count, float* out) const;
  // The parameter's tensor as stored, for a bit-exact copy: its dtype ("F32", "BF16", "F16") and
  // bytes (mapped; valid while the reader lives).
  std::pair<std::string, const std::uint8_t*> raw(const ParamSpec& p) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Loads every parameter of `weights` from `dir` through an HfWeightsReader (a tensor already in
// the weights' dtype is copied bit for bit).
void load_hf_weights(const std::string& dir, ResidentWeights& weights);

// Writes a model to a folder as save_hf_weights does, one unit at a time: write_unit() takes
// each unit's flat fp32 values (model_units: parameters at their offsets) in order and writes its
// tensors in `dtype` (rounded to nearest even) into the shard they go to; finish() writes the
// index (sharded) and config.json and moves everything into place (commit_hf_files). The shards'
// layout is planned from the sizes alone, so no more than one unit's values (the caller's) and a
// few MiB of converted bytes are held at once. Destroyed unfinished, or its process interrupted
// (Ctrl-C, SIGTERM: where remove_swap_files_on_interrupt is installed) before finish(), it
// removes its temporary files and leaves the folder as it was.
class HfWeightsWriter {
 public:
  HfWeightsWriter(const std::string& dir, const ModelConfig& cfg, DType dtype,
                  std::size_t max_shard_bytes = std::size_t(5) << 30);
  ~HfWeightsWriter();
  HfWeightsWriter(const HfWeightsWriter&) = delete;
  HfWeightsWriter& operator=(const HfWeightsWriter&) = delete;
  void write_unit(std::size_t unit, const float* flat);
  // With `side_files_from` (a Hugging Face folder), its hf_side_files() are copied beside the
  // weights, moved into place with them (nothing when it is the folder written). Returns the
  // names copied, in hf_side_files()' order.
  std::vector<std::string> finish(const std::string& side_files_from = "");
  // How many safetensors files the weights go to (1: model.safetensors).
  std::size_t files() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Writes config.json and the weights (in the weights' dtype) to `dir` (created if needed),
// in shards of at most max_shard_bytes (one tensor larger than that gets a shard of its own),
// with model.safetensors.index.json when there is more than one shard. Tied weights are
// written once, as Hugging Face does.
void save_hf_weights(const std::string& dir, const ResidentWeights& weights,
                     std::size_t max_shard_bytes = std::size_t(5) << 30);

// The files beside a Hugging Face model's weights that make its folder usable as it is
// (AutoTokenizer / from_pretrained, vLLM): the tokenizer (tokenizer.json, tokenizer_config.json,
// special_tokens_map.json, tokenizer.model, added_tokens.json, vocab.json, merges.txt), the chat
// template (chat_template.jinja, chat_template.json) and generation_config.json.
const std::vector<std::string>& hf_side_files();
// A small file of a save (config.json, the shards' index) written whole to `path` (a temporary
// that commit_hf_files moves into place): a write or close that fails (a full drive) throws kIo
// naming `shown`, the file's final name, and removes `path`.
void write_hf_text_file(const std::string& path, const std::string& text, const std::string& shown);

// The end of a save into `dir` (save_hf_weights, strata-export): moves the written temporary
// files into place (`renames`: temporary -> final paths) and removes what an older save left
// that loaders would take instead — model.safetensors beside a sharded save's index (or the
// index beside a single file), model-*-of-*.safetensors not written now — and .strata-tmp-*
// leftovers of a failed save. Every other file (tokenizer files, a README, checkpoints/) stays.
void commit_hf_files(const std::string& dir,
                     const std::vector<std::pair<std::string, std::string>>& renames, bool sharded);

// fsync of a file (or, with `folder`, of a folder's entries): what a save calls before a rename
// makes a file visible, and after. Throws kIo naming `what` ("checkpoint", "model save") and
// the path.
void fsync_path(const std::string& path, bool folder, const char* what);

}  // namespace strata
