// The reference for tokenizer_test: Hugging Face's Rust `tokenizers` library (its Node binding,
// @anush008/tokenizers) encodes and decodes every string of a corpus with a model folder's
// tokenizer.json and prints the results as one JSON object on stdout.
//
//   node tokenize_ref.mjs NPM_DIR TOKENIZER_JSON CORPUS_JSON
//
// NPM_DIR holds node_modules/ (scripts/npm-tokenizers.sh installs it); CORPUS_JSON is a JSON list
// of strings. Output: {"with_special": [[ids]...], "plain": [[ids]...], "decoded": [text...],
// "decoded_skip": [text...]} — encode with and without add_special_tokens, and decode of the
// first with and without skip_special_tokens. Exits 3 when the binding cannot be loaded.
import { createRequire } from 'node:module';
import { readFileSync } from 'node:fs';
import path from 'node:path';

const [npmDir, tokenizerJson, corpusJson] = process.argv.slice(2);
if (!corpusJson) {
  console.error('usage: node tokenize_ref.mjs NPM_DIR TOKENIZER_JSON CORPUS_JSON');
  process.exit(2);
}
let Tokenizer;
try {
  ({ Tokenizer } = createRequire(path.join(path.resolve(npmDir), 'package.json'))('@anush008/tokenizers'));
} catch (e) {
  console.error(`cannot load @anush008/tokenizers from ${npmDir}: ${e.message}`);
  process.exit(3);
}
const tok = Tokenizer.fromFile(tokenizerJson);
const corpus = JSON.parse(readFileSync(corpusJson, 'utf8'));
const out = { with_special: [], plain: [], decoded: [], decoded_skip: [] };
for (const text of corpus) {
  const ids = (await tok.encode(text, null, { addSpecialTokens: true })).getIds();
  out.with_special.push(ids);
  out.plain.push((await tok.encode(text, null, { addSpecialTokens: false })).getIds());
  out.decoded.push(await tok.decode(ids, false));
  out.decoded_skip.push(await tok.decode(ids, true));
}
process.stdout.write(JSON.stringify(out));
