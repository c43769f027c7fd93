// strata's native transformer: Llama-family (Llama, Mistral, Qwen2) and GPT-2 models,
// forward and backward on any strata Device.
//
// The model never owns the canonical weights. Parameters are grouped into fetch units —
// unit 0 the embeddings, units 1..L the decoder layers, unit L+1 the final norm and LM
// head — each laid out in one flat buffer (units()[i] gives every parameter's Hugging Face
// name, shape and element offset). Before a unit runs, the model asks a UnitProvider for the
// device tensor holding that unit's full weights, and after the unit's backward it hands
// back the unit's gradients. The ZeRO-3 engine is one provider (gather / prefetch / release,
// reduce-scatter); ResidentWeights, which keeps every unit on the device, is another.
//
// All work is queued on the Stream given at construction, in order; acquire/release calls
// happen on the calling host thread while that work is queued, and a release means "the
// model's last use of the unit is queued before this point on the stream" (record an event
// there before reusing the memory).
//
// Example (all weights resident, CPU-emulated device):
//
//   auto dev = strata::make_device("cpu");
//   auto stream = dev->create_stream("model");
//   strata::ModelConfig cfg = strata::load_model_config("ckpt/config.json");
//   strata::Model model(cfg, *dev, *stream, {.micro_batch = 4, .seq_len = 256});
//   strata::ResidentWeights w(model, *stream);
//   strata::load_hf_weights("ckpt", w);                // model_io.h
//   w.zero_grads();
//   float loss = model.forward(batch, w);              // batch.tokens / batch.targets: B*T ids
//   model.backward(w);                                 // gradients accumulate into w's grads
//
// Semantics:
//  - forward() returns the cross-entropy summed over the batch's counted targets (those not
//    kIgnoreTarget) divided by the loss denominator: by default the number of counted targets (the
//    mean; B*T without ignored targets, as Hugging Face's cross_entropy(ignore_index=-100)). One
//    micro-batch of a larger step passes the step's denominator instead, so that the step's loss
//    and gradients are those of (sum over every counted target of the step) / (their number), not
//    a mean of per-micro-batch means (strata::train does; see step_loss_denominator in
//    trainer.h). The gradients added are exactly those of the returned value. With grad enabled it
//    also runs the head unit's backward at once (the loss is fused with the LM head in chunks of
//    rows, so the [B*T, vocab] logits never exist and the head weights are fetched once);
//    backward() then walks the decoder layers down to the embeddings.
//  - Gradients are fp32 and ADDED into the provider's gradient tensors (gradient
//    accumulation over micro-batches is the provider zeroing them only between steps).
//  - Weights are in the compute dtype: fp32, or bf16 (matmuls in bf16 with fp32 accumulate;
//    norms, softmax, residual stream and gradients in fp32).
//  - Activation checkpointing keeps only each layer's input (on the device, or in host
//    memory) and recomputes the layer in backward; gradients are bit-identical either way.
//  - Packed rows (Batch::positions): a row holds several documents; query i attends key j only
//    within its own document (same row, j <= i, j >= i - positions[i]), and the rotary embedding
//    (Llama, Mistral, Qwen2) and GPT-2's learned position embedding (wpe[positions[i]]) restart at
//    each document. A packed row's loss and gradients equal those of its documents run as rows of
//    their own (to fp32 rounding: the sums run in another order). Without positions each row is
//    one document at 0..T-1, and the computation is exactly the unpacked one.
//
// Tensor parallelism (ModelOptions::tensor_parallel, Megatron-LM's layout): the TP ranks run the
// same batch, each with its slice of every split layer (model_units(cfg, {size, rank})): q/k/v by
// heads (key/value heads divided among the ranks), MLP gate/up (GPT-2's c_fc) by columns — column
// parallel — and the attention output and MLP down projections by their input — row parallel —
// one all-reduce over the group after each row-parallel layer in the forward and after each
// column-parallel layer's input gradient in the backward. The embedding and the LM head split
// the vocabulary in rows (ceil(vocab / size) a rank, the last one fewer): the embedding's rows are
// summed over the group, and the cross-entropy is vocabulary-parallel (each rank's rows'
// log-sum-exp and target logit gathered; no rank ever holds a row's full logits). Norms,
// row-parallel biases and GPT-2's position table are replicated: their gradients come out equal on
// every TP rank (from equal inputs), so they need no reduction. Losses equal TP 1's to fp32
// rounding (the row-parallel sums run in another order), and every TP rank returns the same loss.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "strata/device.h"
#include "strata/dtype.h"

namespace strata {

class Communicator;

enum class ModelArch { kLlama, kGpt2 };

// The parts of a Hugging Face config.json the model uses. Llama covers LlamaForCausalLM,
// MistralForCausalLM (same shapes) and Qwen2ForCausalLM (q/k/v biases).
struct ModelConfig {
  ModelArch arch = ModelArch::kLlama;
  std::string model_type = "llama";  // "llama", "mistral", "qwen2", "gpt2"
  std::int64_t vocab_size = 0;
  std::int64_t hidden_size = 0;
  std::int64_t intermediate_size = 0;  // GPT-2: n_inner or 4 * hidden
  std::int64_t num_layers = 0;
  std::int64_t num_heads = 0;
  std::int64_t num_kv_heads = 0;  // == num_heads without GQA
  std::int64_t head_dim = 0;
  std::int64_t max_positions = 0;  // GPT-2: n_positions (the wpe rows)
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  // rope_scaling {"rope_type": "llama3", ...}; factor 0 = none.
  double rope_llama3_factor = 0;
  double rope_llama3_low_freq_factor = 1;
  double rope_llama3_high_freq_factor = 4;
  double rope_llama3_original_max_positions = 8192;
  bool tie_word_embeddings = false;  // always true for GPT-2
  bool qkv_bias = false;             // Qwen2 (and Llama's attention_bias)
  bool o_bias = false;               // Llama's attention_bias: o_proj has a bias too
  // GPT-2's attention scale: 1/sqrt(head_dim) unless scale_attn_weights is false, then divided
  // by (layer index + 1) with scale_attn_by_inverse_layer_idx (Hugging Face's GPT2Attention).
  bool scale_attn_weights = true;
  bool scale_attn_by_inverse_layer_idx = false;
  double initializer_range = 0.02;  // std of from-scratch matrices (ResidentWeights::init_hf)
  std::string torch_dtype;  // the dtype the weights were saved in ("bfloat16", ...; "" unsaid)
  nlohmann::json raw;       // the config.json as read, written back on save

  std::int64_t num_units() const { return num_layers + 2; }
};

// Parses config.json text; `what` names the file in errors. Throws strata::Error naming the
// missing or malformed key.
ModelConfig parse_model_config(const std::string& json_text, const std::string& what);
ModelConfig load_model_config(const std::string& path);
// Where `folder` is a strata-train checkpoint (its step folder, or the folder of them) and no model
// folder: a sentence saying so and naming strata-export; else "".
std::string checkpoint_not_model(const std::string& folder);
// The config.json text for `cfg` (its raw JSON when it came from a file, else built).
std::string model_config_json(const ModelConfig& cfg);
// The config's sliding_window where it binds (Mistral's always; Qwen2's only with
// use_sliding_window true, Hugging Face's default for it being false), else 0. strata's attention
// is full causal, so a Model's seq_len may not pass it.
std::int64_t binding_sliding_window(const ModelConfig& cfg);

struct ParamSpec {
  std::string name;                 // the Hugging Face tensor name
  std::vector<std::int64_t> shape;  // as stored in safetensors; this rank's slice under TP
  std::size_t offset = 0;           // elements into the unit's flat buffer
  std::size_t numel = 0;
  // Tensor parallelism (model_units with TP > 1): the slice of the Hugging Face tensor this rank
  // holds. Along split_dim the tensor of full_shape is cut into split_parts equal parts (3 for
  // GPT-2's fused q|k|v columns, else 1), and this rank holds indices [split_begin, split_begin +
  // shape[split_dim] / split_parts) of each part, the parts one after another. split_dim -1: the
  // whole tensor, replicated on every TP rank (norms, row-parallel biases, GPT-2's wpe).
  std::vector<std::int64_t> full_shape;  // the Hugging Face tensor's shape (== shape unsplit)
  int split_dim = -1;
  int split_parts = 1;
  std::int64_t split_begin = 0;

  bool split() const { return split_dim >= 0; }
  // The element of the full tensor that element `local` of this slice is (row-major).
  std::size_t full_index(std::size_t local) const;
  // The full tensor's elements (numel when unsplit).
  std::size_t full_numel() const;
  // How many of this slice's elements from `local` on are consecutive in the full tensor too
  // (full_index(local) + k for the k-th): a run a streamed load reads at once.
  std::size_t contiguous_from(std::size_t local) const;
};

// Where this rank sits in a tensor-parallel group: the model's split layers hold slice `rank` of
// `size` (Megatron's layout: attention heads and MLP columns column-parallel, the output and down
// projections row-parallel, the vocabulary split in rows). See docs/model.md.
struct TensorParallel {
  int size = 1;
  int rank = 0;
};

struct UnitSpec {
  std::string name;  // "embed", "layers.3", "head"
  std::vector<ParamSpec> params;
  std::size_t numel = 0;  // of the flat buffer (parameters are 64-element aligned)
};

// Elements [first, first + count) of parameter `p` (of this rank's slice, under TP) as Hugging
// Face's _init_weights gives a model of `cfg` from scratch: matrices and embeddings normal(0,
// initializer_range) (GPT-2's attn/mlp c_proj: / sqrt(2 n_layer)), norm weights 1, biases 0. The
// normal draws come from a counter-based generator (Philox-4x32-10, Box-Muller) keyed by the seed
// and the parameter's name, with the element's index as the counter: any slice is computed alone,
// so every rank of any number of ranks, and every placement, gets the same weights.
void init_hf_values(const ModelConfig& cfg, const ParamSpec& p, std::uint64_t seed,
                    std::size_t first, std::size_t count, float* out);

// Where a unit's weights and gradients come from; see the header comment.
class UnitProvider {
 public:
  virtual ~UnitProvider() = default;
  // The unit's full weights (numel of units()[unit], the model's compute dtype), valid until
  // release_weights(unit). The model may acquire the same unit again later (forward, then
  // recompute and backward; the embeddings twice when tied to the head).
  virtual TensorRef acquire_weights(std::size_t unit) = 0;
  virtual void release_weights(std::size_t unit) = 0;
  // fp32, numel of the unit: the model adds this micro-batch's gradients into it, once per
  // backward for each unit, between acquire_grads and release_grads.
  virtual TensorRef acquire_grads(std::size_t unit) = 0;
  virtual void release_grads(std::size_t unit) = 0;
};

struct ModelOptions {
  std::int64_t micro_batch = 1;      // B
  std::int64_t seq_len = 0;          // T; 0 = max_positions (GPT-2) or 1024
  DType compute = DType::kF32;       // kF32 or kBF16
  bool checkpoint = false;           // keep only layer inputs, recompute in backward
  bool checkpoint_on_host = false;   // with checkpoint: keep those inputs in host memory
  std::int64_t loss_chunk_rows = 0;  // rows of logits per LM-head chunk; 0 = about 16 MiB
  // Tensor parallelism: this rank's group (its ranks hold the other slices of every split layer
  // and run the same batches); null: TP 1. See "Tensor parallelism" below.
  Communicator* tensor_parallel = nullptr;
  // With tensor_parallel: Megatron's sequence parallelism. The residual stream, the norms and the
  // replicated biases run on 1/TP of the micro-batch's B x T token rows on each rank (so do the
  // checkpointed layer inputs): an all-gather of the norm's output before each column-parallel
  // layer and a reduce-scatter after each row-parallel one replace the all-reduce (the same
  // bytes), and the replicated parameters' gradients are summed over TP. B x T must divide by TP.
  bool sequence_parallel = false;
};

// The host memory a model of `cfg` keeps its layer checkpoints in with checkpoint_on_host: each
// layer's input, fp32, of B x T token rows (1/TP of them under sequence parallelism over
// `sequence_parallel_ranks`), held from a step's forward to its backward and reused across steps.
std::uint64_t host_checkpoint_bytes(const ModelConfig& cfg, std::int64_t micro_batch,
                                    std::int64_t seq_len, int sequence_parallel_ranks = 1);

// A target that does not count in the loss (prompt tokens, padding): Hugging Face's
// ignore_index.
inline constexpr std::int32_t kIgnoreTarget = -100;

// One micro-batch: B*T input ids and B*T target ids, row-major [B, T].
//  - targets may hold kIgnoreTarget: such positions add nothing to the loss or the gradients.
//  - positions (packed rows): B*T, each token's position within its document, 0 where a
//    document starts; attention does not cross documents and rotary / learned positions restart
//    per document. Empty: each row is one document at positions 0..T-1. forward() refuses, naming
//    the index, positions of another size, a row that does not start at 0, and a position that
//    is neither 0 nor the previous one + 1 (so every position is below seq_len).
struct Batch {
  std::vector<std::int32_t> tokens;
  std::vector<std::int32_t> targets;
  std::vector<std::int32_t> positions;
};

// The targets of `batch` that count in the loss (those not kIgnoreTarget).
std::int64_t counted_targets(const Batch& batch);

class Model {
 public:
  Model(const ModelConfig& cfg, Device& device, Stream& stream, const ModelOptions& options);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const;
  const ModelOptions& options() const;
  const std::vector<UnitSpec>& units() const;
  TensorParallel tensor_parallel() const;
  // The collectives the model has queued over its TP group since it was made: per forward and
  // backward 4 all-reduces of B x T x hidden fp32 a layer (2 each way; a recomputed layer 1 more),
  // the embedding's and the head's input gradient's one each, and one all-gather of 2 floats a
  // row per LM-head chunk (the vocabulary-parallel cross-entropy). All zero under TP 1.
  // Under sequence parallelism the activations' all-reduces become reduce-scatters (bytes: the
  // whole input) and all-gathers of the norms' outputs (again in the backward for the weight
  // gradients), and the replicated parameters' gradients take a small all-reduce each.
  struct TpTraffic {
    std::uint64_t all_reduces = 0, all_reduce_bytes = 0;
    std::uint64_t all_gathers = 0, all_gather_bytes = 0;  // bytes: each rank's input
    std::uint64_t reduce_scatters = 0, reduce_scatter_bytes = 0;
  };
  TpTraffic tp_traffic() const;
  std::size_t num_params() const;  // tied weights counted once; this rank's under TP
  // Matmul FLOPs of one forward+backward over B*T tokens (6 * matmul params * tokens plus
  // attention), for throughput figures; this rank's share under TP.
  double flops_per_step() const;
  // The GEMMs one forward+backward runs through Stream::matmul: each linear layer's forward, dX
  // and dW, and the LM head's chunk by chunk, with how many times a step runs each shape.
  // `recompute`: a layer's forward run again in backward (activation checkpointing), work that
  // flops_per_step leaves out. For benchmarks that weigh a GEMM library's rate by the model's
  // own shapes.
  struct GemmShape {
    std::string name;  // "q|k|v forward", "mlp down dw", "lm head dx", ...
    std::int64_t m = 0, n = 0, k = 0;
    bool trans_a = false, trans_b = false;
    std::int64_t count = 0;
    bool recompute = false;
    double flops() const { return 2.0 * double(m) * double(n) * double(k) * double(count); }
  };
  std::vector<GemmShape> gemm_shapes() const;

  // Queues the forward (and, with grad, the head's backward); waits for it and returns the
  // loss: the sum of the counted targets' cross-entropies / loss_denominator, whose gradients
  // are the ones added. loss_denominator 0: the batch's counted targets (its mean loss; an error
  // when every target is kIgnoreTarget). Token ids must be < vocab_size and targets too or
  // kIgnoreTarget: an error names the offending position.
  float forward(const Batch& batch, UnitProvider& weights, bool grad = true,
                double loss_denominator = 0);
  // Queues the backward of the decoder layers and the embeddings; does not wait.
  void backward(UnitProvider& weights);
  // The full logits [B*T, vocab] (fp32) of `tokens`, for tests and inference on small inputs.
  std::vector<float> logits(const std::vector<std::int32_t>& tokens, UnitProvider& weights);

  // Inference on one sequence with a key/value cache (strata-generate, strata/generate.h):
  // `tokens` are the sequence's next ids, at positions [decode_length(), + tokens.size()); they
  // run through every unit (each acquired and released once), their keys and values are kept
  // (fp32, every layer, seq_len positions: allocated at the first call), and the logits [vocab]
  // (fp32) of the last one come back. Row for row what forward() computes for those positions
  // (the attention's sums run in another order). micro_batch plays no part; a sequence longer
  // than seq_len is an error. Waits for the result.
  std::vector<float> decode(const std::vector<std::int32_t>& tokens, UnitProvider& weights);
  // Drops the cache (and its memory): the next decode() starts a new sequence at position 0.
  void reset_decode();
  std::int64_t decode_length() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// Every unit resident on the device, in the model's compute dtype, with fp32 gradients.
class ResidentWeights final : public UnitProvider {
 public:
  ResidentWeights(const Model& model, Stream& stream);
  // Standalone (no Model): the same layout from a config (this TP rank's slices).
  ResidentWeights(const ModelConfig& cfg, DType dtype, Device& device, Stream& stream,
                  TensorParallel tp = {});

  TensorRef acquire_weights(std::size_t unit) override;
  void release_weights(std::size_t) override {}
  TensorRef acquire_grads(std::size_t unit) override;
  void release_grads(std::size_t) override {}

  const std::vector<UnitSpec>& units() const { return units_; }
  DType dtype() const { return dtype_; }
  const ModelConfig& config() const { return cfg_; }
  void zero_grads();
  // Normal(0, std) weights, norm weights 1 and biases small, from a seed (tests, benches:
  // norms and biases noisy on purpose, so their gradients are exercised).
  void init_random(std::uint64_t seed, float std = 0.02f);
  // From-scratch training weights as Hugging Face's _init_weights gives them (init_hf_values:
  // every element a function of the seed, its parameter's name and its index).
  void init_hf(std::uint64_t seed);
  // Host copies in fp32 (synchronizes): one parameter by name, or a whole unit.
  std::vector<float> get(const std::string& name) const;
  void set(const std::string& name, const std::vector<float>& values);
  std::vector<float> grad(const std::string& name) const;
  // The parameter's unit and spec; throws naming the parameter when it does not exist.
  std::pair<std::size_t, const ParamSpec*> find(const std::string& name) const;
  // Raw bytes of a parameter in `dtype()` (for saving bit-exact); synchronizes.
  std::vector<std::uint8_t> get_bytes(const std::string& name) const;
  void set_bytes(const std::string& name, const void* data, std::size_t bytes);

 private:
  ModelConfig cfg_;
  DType dtype_;
  Stream& stream_;
  std::vector<UnitSpec> units_;
  std::vector<Buffer> weights_, grads_;
};

// The unit layout of `cfg` (what Model::units() returns): under TP (tp.size > 1) this rank's
// slices. Refuses (kInvalidArgument, naming the sizes and what divides them) a TP size that does
// not divide the attention heads, the key/value heads or the MLP's width, or that leaves a rank
// no vocabulary rows.
std::vector<UnitSpec> model_units(const ModelConfig& cfg, TensorParallel tp = {});
// The parameters `units` hold (their elements, alignment gaps left out; tied weights once): of
// model_units(cfg), the whole model's; Model::num_params is its units'.
std::size_t num_params(const std::vector<UnitSpec>& units);
// Host copies between a parameter's full tensor (Hugging Face's, row-major) and this rank's
// slice of it (p.numel elements): `slice` takes the slice out, `place` puts it back in.
std::vector<float> tp_slice(const ParamSpec& p, const std::vector<float>& full);
void tp_place(const ParamSpec& p, const std::vector<float>& slice, std::vector<float>& full);
// Unit `u` whole (model_units(cfg)'s flat layout) from every TP rank's flat values of it
// (slices[k]: model_units(cfg, {slices.size(), k})[u]'s layout, padding allowed past its numel):
// the split parameters placed by their slices, the replicated ones TP rank 0's.
std::vector<float> tp_unit_whole(const ModelConfig& cfg, std::size_t u,
                                 const std::vector<std::vector<float>>& slices);
// The elements of the largest parameter tensor of `units`.
std::uint64_t largest_tensor(const std::vector<UnitSpec>& units);

}  // namespace strata
