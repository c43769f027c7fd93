// Token data for training: memory-mapped token files cut into micro-batches.
//
// Formats: raw little-endian uint16 or uint32 token ids (nanoGPT's train.bin is raw uint16),
// llm.c's .bin (a 256 x int32 header: magic 20240520, version 1 = uint16 / 2 = uint32 ids,
// token count; then the ids), and bytes (any file, each byte a token: vocabulary 256, for
// experiments without a tokenizer), and prepared files (strata/corpus.h: strata-prep's output,
// tokens with a target mask and document starts). kAuto picks prepared or llm.c when their magic
// is there, bytes for .txt, and refuses anything else: raw ids carry no header saying their width,
// so they need kU16 or kU32 given (and text is named as text, never read as ids).
//
// Unshuffled, batches are taken exactly as llm.c's DataLoader takes them (one process):
// a micro-batch of B sequences of T tokens reads B*T+1 contiguous tokens at the current
// position; inputs are the first B*T, targets the B*T after the first; the position then
// advances by B*T, and moves to the next file (then wraps, epoch + 1) when fewer than
// B*T+1 tokens remain. Shuffled, the unit is a window of T+1 tokens at a stride of T, and
// each epoch visits all windows of all files in a random order that depends only on (seed,
// epoch), B per batch.
// The validation split is the last val_fraction of each file's tokens; train is the rest.
//
// Prepared files are packed (docs/prepared-data.md): each file's documents, in order, fill rows of
// T tokens; a document that does not fit in what is left of a row starts the next one (the rest is
// padding: token 0, target kIgnoreTarget); a document longer than T starts a row and is split
// into pieces of T (the pieces are trained as separate documents; their count is reported as
// split). Batch::positions restart at 0 at each document (and piece) start; a target is the next
// token of the same document where the file counts it, else kIgnoreTarget (so a document's last
// token, its EOS, predicts nothing). Rows are fixed by the file; an epoch visits them in order,
// or shuffled in an order that depends only on (seed, epoch), B per batch. The validation split
// is the last val_fraction of each file's documents.
// A token id >= vocab_size is an error naming the file and byte offset.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "strata/model.h"

namespace strata {

enum class TokenFormat { kAuto, kU16, kU32, kLlmc, kBytes, kPrepared };
// auto, u16, u32, llmc, bytes, prepared
TokenFormat parse_token_format(const std::string& name);

enum class DataSplit { kTrain, kVal };

struct DataOptions {
  std::vector<std::string> files;
  TokenFormat format = TokenFormat::kAuto;
  std::int64_t batch = 1;       // B
  std::int64_t seq_len = 0;     // T
  std::int64_t vocab_size = 0;  // ids must be below it; 0 = unchecked
  bool shuffle = false;
  std::uint64_t seed = 0;
  double val_fraction = 0.0;  // in [0, 1)
  // Prepared files: the hash of the model's tokenizer (strata/corpus.h tokenizer_hash) a file must
  // carry, and where the tokenizer was read (for messages); empty: not checked (a model with no
  // tokenizer folder), only the vocabulary is.
  std::string tokenizer_hash;
  std::string tokenizer_origin;
};

// What a TokenLoader of `options` reads in an epoch, from the files' sizes and headers alone (their
// ids are not read: no vocabulary check); the errors of a file it cannot read are the loader's.
struct DataExtent {
  std::int64_t tokens = 0;  // in the split, all files
  // The sequences of seq_len tokens (rows of a batch) one epoch gives: shuffled, every T+1-token
  // window at a stride of T once; unshuffled, batch rows per batch, in whole batches per file.
  std::int64_t rows = 0;
  // Prepared files: documents, counted targets and documents split across rows (longer than
  // seq_len) in the split; zero for token files.
  std::int64_t documents = 0, counted = 0, split_documents = 0;
  bool prepared = false;
};
DataExtent measure_tokens(const DataOptions& options, DataSplit split = DataSplit::kTrain);

class TokenLoader {
 public:
  explicit TokenLoader(const DataOptions& options, DataSplit split = DataSplit::kTrain);
  ~TokenLoader();
  TokenLoader(const TokenLoader&) = delete;
  TokenLoader& operator=(const TokenLoader&) = delete;

  Batch next();  // wraps to a new epoch at the end
  void reset();  // back to the first batch of epoch 0
  std::int64_t epoch() const;
  std::int64_t batches_per_epoch() const;
  std::int64_t num_tokens() const;  // in this split, all files

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata
