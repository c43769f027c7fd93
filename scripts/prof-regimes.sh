#!/usr/bin/env bash
# Checks strata-prof's predictions in several bottleneck regimes on the CPU-emulated device:
# for each regime, strata-prof measures, searches, and --validate's the best 3 placements and its
# default spread (up to 4 more: the best of other placement classes, the median- and the
# last-ranked) by running them through strata-train, three rounds in turns (--validate-rounds 3, each
# round begun a third further along the order; a candidate's measured step is the median of all its
# rounds' steps, so one round the machine slowed does not decide it); this prints predicted vs measured step
# time per candidate, then a table of the recommended configuration per regime: the resource
# it is bound by as predicted and as measured (the lane busiest in its traced step), the worst
# error over every validated candidate (target <= 15%), Spearman's rank correlation of
# predicted and measured tokens/s over them, as is and with values the runs cannot tell apart
# (within their median step-to-step spread) as ties (that one: target >= 0.8), and how far the
# recommended configuration is from the fastest one measured (target <= 5%), and how far one
# candidate's rounds came apart at most (the machine's drift, which the errors carry).
#
#   scripts/prof-regimes.sh [BUILD_DIR] [WORK_DIR]      (defaults: build, build/prof-regimes)
#
# The regimes (the demo's byte-level Llama unless said otherwise, fp32):
#   compute  everything fits on the device; matmuls throttled to 10 GFLOP/s
#   link     a 100 MiB device: weights must stream over a 0.1 GB/s link each way
#   nvme     a 61 MiB device and 61 MiB of pinned host memory: optimizer state on NVMe
#   offload  a wider model (hidden 512, 23M parameters) on a 120 MiB device, no NVMe, 1, 2 or
#            4 16-token sequences per step: weights streamed in from the host each step, gradients
#            and optimizer state on the host, the CPU AdamW in every step (ZeRO-Offload's case;
#            on the emulated device it is compute-bound: its kernels move the same host memory
#            as the AdamW does, so no batch makes the optimizer the longest lane)
# Needs a quiet machine: the emulated device computes on the host's cores.
set -euo pipefail
build=${1:-build}
work=${2:-$build/prof-regimes}
prof="$build/tools/strata-prof"
[ -x "$prof" ] || { echo "prof-regimes: $prof not found: build first (cmake --build $build)" >&2; exit 1; }
mkdir -p "$work/nvme"
cat >"$work/wide.json" <<'EOF'
{"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 512,
 "intermediate_size": 1376, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
 "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": false}
EOF

run() {
  local name=$1; shift
  echo "== $name: strata-prof $*"
  # --overwrite: a second run replaces the first run's files in the work folder. The NVMe
  # folder unless the regime leaves NVMe out (--no-nvme beside --nvme-path is refused).
  local nvme=(--nvme-path "$work/nvme")
  case " $* " in *" --no-nvme "*) nvme=() ;; esac
  "$prof" --device cpu "${nvme[@]}" --validate 3 --validate-steps 8 --validate-rounds 3 --top 3 --json --overwrite \
    --out "$work/$name.ds_config.json" --svg "$work/$name.svg" --trace "$work/$name.trace.json" "$@" \
    >"$work/$name.out" 2>"$work/$name.err" || { cat "$work/$name.err" >&2; exit 1; }
  sed -n '/placements considered/,/^picture/p' "$work/$name.out"
  tail -n 1 "$work/$name.out" >"$work/$name.json"
}

run compute --device-mem-gb 1 --emu-compute-gflops 10 --micro-batches 2
run link --device-mem-gb 0.1 --emu-h2d-gbps 0.1 --emu-d2h-gbps 0.1 --micro-batches 2
run nvme --device-mem-gb 0.06 --host-mem-gb 0.06 --micro-batches 1 --seq-len 64
run offload --model-config "$work/wide.json" --device-mem-gb 0.12 --no-nvme --micro-batches 1 2 4 --seq-len 16

echo
# The summary is the Markdown table docs/benchmarks.md keeps (one reader of the runs' JSON).
python3 "$(dirname "$0")/prof-regimes-table.py" "$work"
echo "(bound by: the recommended configuration's bottleneck, predicted / measured in its traced step)"
echo "(rank correlation: Spearman over every validated run, as is / with values within the runs' median"
echo " step-to-step spread (the % in brackets) of each other as ties, which the target is for)"
echo "(drift: how far one candidate's rounds came apart, the most of any: the machine's own movement,"
echo " which the errors carry)"
echo "(targets: worst error <= 15%, rank correlation >= 0.8, recommended within 5% of the fastest validated;"
echo " details in $work/*.out, pictures *.svg)"
echo "(the table over several runs: scripts/prof-regimes-table.py $work WORK_DIR ...)"
