// The reference for chat_test: @huggingface/jinja (the Jinja engine transformers.js runs chat
// templates with) renders each case with a template's own Jinja source, and Hugging Face's Rust
// tokenizers library (@anush008/tokenizers) encodes the rendered text as apply_chat_template
// does (add_special_tokens false). Prints one JSON object on stdout.
//
//   node chat_ref.mjs NPM_DIR CASES_JSON [TOKENIZER_JSON]
//
// CASES_JSON: {"template": "...", "cases": [{"messages": [...], "add_generation_prompt": bool,
// "bos_token": "...", "eos_token": "...", "enable_thinking": bool, "date_string": "..." (both
// optional)}]}. `tools` is null, as transformers' apply_chat_template passes it without tools.
// Output: {"text": [rendered...], "ids": [[ids]...] (with TOKENIZER_JSON)}. Exits 3 when a
// package cannot be loaded.
import { createRequire } from 'node:module';
import { readFileSync } from 'node:fs';
import path from 'node:path';

const [npmDir, casesJson, tokenizerJson] = process.argv.slice(2);
if (!casesJson) {
  console.error('usage: node chat_ref.mjs NPM_DIR CASES_JSON [TOKENIZER_JSON]');
  process.exit(2);
}
const req = createRequire(path.join(path.resolve(npmDir), 'package.json'));
let Template, Tokenizer;
try {
  ({ Template } = req('@huggingface/jinja'));
  if (tokenizerJson) ({ Tokenizer } = req('@anush008/tokenizers'));
} catch (e) {
  console.error(`cannot load the reference packages from ${npmDir}: ${e.message}`);
  process.exit(3);
}
const input = JSON.parse(readFileSync(casesJson, 'utf8'));
const template = new Template(input.template);
const tok = tokenizerJson ? Tokenizer.fromFile(tokenizerJson) : null;
const out = { text: [], ids: [] };
for (const c of input.cases) {
  const vars = {
    messages: c.messages,
    add_generation_prompt: c.add_generation_prompt,
    bos_token: c.bos_token,
    eos_token: c.eos_token,
    tools: null,
  };
  if (c.enable_thinking !== undefined) vars.enable_thinking = c.enable_thinking;
  if (c.date_string !== undefined) vars.date_string = c.date_string;
  const text = template.render(vars);
  out.text.push(text);
  if (tok) out.ids.push((await tok.encode(text, null, { addSpecialTokens: false })).getIds());
}
process.stdout.write(JSON.stringify(out));
