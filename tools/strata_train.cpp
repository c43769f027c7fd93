// strata-train: fine-tune a model from the command line through the ZeRO-3 engine.
// With no model and no data it runs the embedded demo (a small Llama on generated text,
// weights and optimizer state on NVMe, an emulated device smaller than the weights).
// Flags are parsed here; everything else is strata::train (include/strata/trainer.h).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <string>

#include "strata/device.h"
#include "strata/error.h"
#include "strata/nvme.h"
#include "strata/trainer.h"
#include "tool_main.h"

int main(int argc, char** argv) {
  strata::reexec_with_passive_openmp(argv);  // before libgomp's first team: see device.h
  strata::remove_swap_files_on_interrupt();  // Ctrl-C does not leave the optimizer state on the
                                             // drive
  strata::tools::g_ranks_start_mpi = true;  // every rank starts MPI: one failing early ends the job
  strata::TrainOptions o;
  bool no_shuffle = false;
  CLI::App app{
      "strata-train: fine-tune a model with ZeRO-3 over GPU memory, pinned host memory and NVMe.\n"
      "With no --model/--model-config and no --data/--text: the embedded demo."};
  app.add_option("--model", o.model_dir, "Hugging Face model folder (config.json + *.safetensors)");
  app.add_option("--model-config", o.model_config,
                 "config.json of a model to initialise at random");
  app.add_option("--data", o.data_files,
                 "training data: strata-prep files, token files, or .txt / .jsonl / .json corpora "
                 "(prepared with the --model folder's tokenizer into a cache)");
  app.add_option("--data-dtype", o.data_format,
                 "token file format (auto: by header; raw ids without one need u16 or u32)")
      ->check(CLI::IsMember({"auto", "u16", "u32", "llmc", "bytes", "prepared"}));
  app.add_option("--text", o.text_file,
                 "a text file: byte by byte for a byte-level model (vocabulary 256), else one "
                 "document tokenized by the --model folder's tokenizer");
  app.add_option("--text-field", o.text_field,
                 "JSON lines corpora: the field that holds a document's text (default text); "
                 "given, it wins over a record's chat keys");
  app.add_option("--chat-format", o.chat_format,
                 "chat records in --data .jsonl corpora: render them in this layout (chatml, "
                 "llama3, llama2, mistral, none) instead of the --model folder's chat template")
      ->check(CLI::IsMember({"chatml", "llama3", "llama2", "mistral", "none"}));
  std::string separator;
  auto* separator_opt = app.add_option(
      "--separator", separator,
      "text corpora: split each file into documents on this string (default: one document)");
  app.add_option("--config", o.ds_config,
                 "DeepSpeed-style ds_config.json (default: stage 3, no offload)");
  app.add_option("--seq-len", o.seq_len,
                 "tokens per sequence (default: 128 for the demo, else 1024 or the model's "
                 "max_position_embeddings "
                 "when smaller)")
      ->check(strata::tools::kPositive);
  app.add_option("--tensor-parallel", o.tensor_parallel,
                 "split every layer's matrices over this many ranks of a node (Megatron tensor "
                 "parallelism), ZeRO-3 over the data-parallel groups of the rest (default: the "
                 "--config's tensor_parallel.autotp_size, else 1)")
      ->check(strata::tools::kPositive);
  app.add_flag(
      "--sequence-parallel", o.sequence_parallel,
      "with --tensor-parallel: Megatron's sequence parallelism (the norms and the residual "
      "stream on 1/N of the tokens a rank: less activation memory, the same traffic)");
  app.add_option("--micro-batch", o.micro_batch,
                 "sequences per micro-batch per data-parallel rank (default: the --config's "
                 "train_micro_batch_size_per_gpu, else 1; the demo 2)")
      ->check(strata::tools::kPositive);
  app.add_option("--grad-accum", o.grad_accum,
                 "micro-batches per optimizer step (default: the --config's "
                 "gradient_accumulation_steps, else 1)")
      ->check(strata::tools::kPositive);
  app.add_option("--steps", o.steps, "optimizer steps (default 60, unless --epochs)")
      ->check(strata::tools::kPositive)  // (one message at a time: "&" joined both with AND)
      ->check(strata::tools::kCount);
  app.add_option("--epochs", o.epochs,
                 "passes over the data instead of --steps (default: none, --steps 60): steps = "
                 "ceil(epochs x steps an epoch), as the Hugging Face Trainer's num_train_epochs; "
                 "fractions allowed")
      ->check(strata::tools::kPositive);
  app.add_option("--lr", o.lr,
                 "peak learning rate (AdamW, PyTorch semantics; default: the --config's "
                 "optimizer.params.lr, else 1e-3; the demo 3e-3)")
      ->check(strata::tools::kNonNegative);
  app.add_option("--warmup", o.warmup,
                 "linear warmup steps (default 0; with neither this nor --lr-schedule, the "
                 "--config's scheduler block applies)")
      ->check(strata::tools::kNonNegative);
  app.add_option("--lr-schedule", o.lr_schedule,
                 "after warmup: const (default), cosine or linear (the Hugging Face Trainer's)")
      ->check(CLI::IsMember({"const", "cosine", "linear"}));
  app.add_option("--min-lr", o.min_lr, "the lr a cosine or linear schedule ends at (default 0)")
      ->check(strata::tools::kNonNegative);
  app.add_option("--max-grad-norm", o.max_grad_norm,
                 "clip the global gradient norm to this (0: off; default: the --config's "
                 "gradient_clipping, else 1.0 when fine-tuning a --model folder, as the Hugging "
                 "Face Trainer, else off)")
      ->check(strata::tools::kNonNegative);
  app.add_option("--weight-decay", o.weight_decay,
                 "decoupled weight decay (default 0), not on norm weights and biases unless the "
                 "--config says \"strata\": {\"weight_decay_exempt\": \"none\"}")
      ->check(strata::tools::kNonNegative);
  app.add_option("--seed", o.seed, "initialisation and shuffle seed, 0 to 2^64 - 1 (default 1234)")
      ->check(strata::tools::kSeed);
  app.add_flag("--no-shuffle", no_shuffle, "read the data in order (llm.c's batches)");
  app.add_option("--dtype", o.dtype, "compute dtype (default: the config's, else fp32)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--device", o.device,
                 "auto (a usable GPU, else the CPU-emulated device), cpu or cuda (default auto)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--device-mem-gb", o.device_mem_gb,
                 "device memory cap in GiB (default: the GPU's memory; the emulated device's "
                 "4 GiB, the demo's 20 MiB)")
      ->check(strata::tools::kPositive);
  app.add_option("--emu-h2d-gbps", o.emu_h2d_gbps,
                 "emulated device: host-to-device GB/s (default unthrottled)")
      ->check(strata::tools::kNonNegative);
  app.add_option("--emu-d2h-gbps", o.emu_d2h_gbps,
                 "emulated device: device-to-host GB/s (default unthrottled)")
      ->check(strata::tools::kNonNegative);
  app.add_option("--emu-compute-gflops", o.emu_compute_gflops,
                 "emulated device: matmul GFLOP/s (default unthrottled)")
      ->check(strata::tools::kNonNegative);
  app.add_flag("--checkpoint-activations", o.checkpoint_activations,
               "recompute each layer in backward");
  app.add_flag("--checkpoint-on-host", o.checkpoint_on_host,
               "recompute each layer in backward, keeping its input in host memory (implies "
               "--checkpoint-activations)");
  app.add_option("--eval-every", o.eval_every,
                 "validation loss every N steps and after the last (on --eval-data, else the "
                 "last 10% of the data)")
      ->check(strata::tools::kNonNegative);
  app.add_option("--eval-data", o.eval_files,
                 "evaluation token file(s), any format --data takes: evaluated after the last "
                 "step, and every --eval-every N steps");
  app.add_option("--eval-batches", o.eval_batches,
                 "batches a rank per evaluation (default 4; 0: the whole evaluation data)")
      ->check(strata::tools::kNonNegative);
  app.add_option("--sample-every", o.sample_every,
                 "every N steps and after the last, print a greedy sample of the model (0: none)")
      ->check(strata::tools::kCount);
  app.add_option("--sample-prompt", o.sample_prompt,
                 "the samples' prompt as text: through the --model folder's tokenizer.json, or its "
                 "bytes for a byte-level model (vocab_size <= 256)");
  app.add_option("--sample-prompt-ids", o.sample_prompt_ids,
                 "the samples' prompt as token ids: \"1 2 3\"");
  app.add_option("--sample-tokens", o.sample_tokens, "new tokens a sample (default 32)")
      ->check(strata::tools::kPositive);
  app.add_option("--log-json", o.log_json, "one JSON object per step to this file");
  app.add_option("--plot", o.plot_file,
                 "a picture of the run (loss, val loss, lr, gradient norm, tokens/s, bytes per "
                 "tier) as an SVG file, redrawn after every step: open it in a browser");
  app.add_option("--out", o.out_dir, "write the final model here (Hugging Face layout)");
  app.add_flag("--overwrite", o.overwrite,
               "replace an existing --out folder, --log-json, --plot or --trace file");
  double max_shard_mb = 0;
  app.add_option("--max-shard-mb", max_shard_mb,
                 "largest safetensors file --out writes, in MiB (default 5120; more: shards with "
                 "model.safetensors.index.json)")
      ->check(strata::tools::kPositive);
  app.add_option("--save-every", o.save_every,
                 "write a checkpoint every N steps and after the last one (default 0: none)")
      ->check(strata::tools::kNonNegative);
  app.add_option("--checkpoint-dir", o.checkpoint_dir,
                 "folder of the checkpoints (default <out>/checkpoints; resuming: the resumed "
                 "one's); shared by "
                 "the nodes, or a node-local drive at the same path on each");
  app.add_option("--keep-checkpoints,--save-total-limit", o.keep_checkpoints,
                 "keep only the newest N checkpoints (default 0: all; --save-total-limit, the "
                 "Hugging Face Trainer's name, is the same)")
      ->check(strata::tools::kNonNegative);
  app.add_option("--resume", o.resume,
                 "continue from the newest complete checkpoint in DIR (a checkpoint, a checkpoints "
                 "folder or a run's --out)");
  app.add_option("--trace", o.trace_file, "Chrome trace of one step to this file");
  app.add_option("--trace-step", o.trace_step, "the step --trace records (default 2)")
      ->check(strata::tools::kPositive);
  app.add_option("--demo-nvme", o.demo_nvme_dir,
                 "the demo's NVMe folder (default: <build>/demo-nvme from the build tree, else "
                 "~/.cache/strata/demo-nvme)");
  app.add_flag("--plan", o.plan_only, "print the memory plan and exit");
  return strata::tools::run_tool(
      "strata-train", app, argc, argv, strata::tools::ToolRuns::kernels, [&] {
        o.shuffle = !no_shuffle;
        o.text_field_named = app.count("--text-field") > 0;
        if (separator_opt->count() > 0) o.separator = separator;
        if (max_shard_mb > 0)
          o.out_max_shard_bytes =
              std::max<std::size_t>(1, strata::tools::mib_as_bytes(max_shard_mb));
        // A flag that would be ignored is named, not ignored (the user thinks it took effect).
        auto needs = [&](const char* flag, bool ok, const char* why) {
          STRATA_REQUIRE(!app.count(flag) || ok, "{} {}", flag, why);
        };
        const bool demo = o.model_dir.empty() && o.model_config.empty();
        needs("--trace-step", !o.trace_file.empty(),
              "chooses the step --trace records: add --trace FILE");
        needs("--overwrite",
              !o.out_dir.empty() || !o.log_json.empty() || !o.plot_file.empty() ||
                  !o.trace_file.empty(),
              "replaces an existing --out folder, --log-json, --plot or --trace file: add one of "
              "them");
        needs("--max-shard-mb", !o.out_dir.empty(), "sizes the files --out writes: add --out DIR");
        needs("--checkpoint-dir", o.save_every > 0,
              "is where --save-every N writes checkpoints: add --save-every N");
        needs("--keep-checkpoints", o.save_every > 0,
              "prunes the checkpoints --save-every N writes: add --save-every N");
        needs("--demo-nvme", demo && o.ds_config.empty(),
              "is the embedded demo's NVMe folder; with a model of yours or a --config, set "
              "offload_param / "
              "offload_optimizer nvme_path in the --config");
        needs("--eval-batches", o.eval_every > 0 || !o.eval_files.empty(),
              "sets the batches of an evaluation: add --eval-every N or --eval-data FILE");
        needs("--plot", !o.plan_only,
              "draws the steps of a run and --plan runs none: drop one of them");
        needs("--sample-tokens", o.sample_every > 0,
              "is the length of --sample-every's samples: add --sample-every N");
        needs("--data-dtype", !o.data_files.empty(),
              "is the format of --data token files (--text is read byte by byte)");
        needs("--text-field", !o.data_files.empty() || !o.eval_files.empty(),
              "names the text field of --data .jsonl corpora: add --data FILE.jsonl");
        needs("--chat-format", !o.data_files.empty() || !o.eval_files.empty(),
              "renders the chat records of --data .jsonl corpora: add --data FILE.jsonl");
        needs("--separator", !o.data_files.empty() || !o.text_file.empty(),
              "splits --data / --text text corpora into documents: add --data or --text");
        return strata::train(o).plan_fits ? 0 : 2;
      });
}
