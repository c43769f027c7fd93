// Chat data: conversations read from a jsonl record, rendered with a model family's chat template
// natively in C++ (no template engine at run time), and encoded with a target mask.
//
// A Hugging Face folder carries its chat template as Jinja source (tokenizer_config.json's
// `chat_template`, or chat_template.jinja). strata does not run Jinja: it recognises the family by
// fingerprint (distinctive substrings) and renders that family's layout itself, with the details
// the families' real templates have:
//
//   kChatML   "<|im_start|>"
//       <|im_start|>{role}\n{content}<|im_end|>\n per message; a default system turn when the
//       template writes one (Qwen2) and none is given; Qwen3's <think> blocks (below).
//   kLlama3   "<|start_header_id|>"
//       {bos}<|start_header_id|>{role}<|end_header_id|>\n\n{content, trimmed}<|eot_id|> per
//       message; the assistant header last either always (Meta-Llama-3-8B-Instruct's first
//       template writes it unconditionally) or with add_generation_prompt. Llama 3.1+: the system
//       turn always first, with the knowledge cutoff and "Today Date: {date_string}" lines before
//       the system prompt.
//   kLlama2   "[INST]" and "<<SYS>>"
//       {bos}[INST] {user, stripped} [/INST] {assistant, stripped} {eos} per exchange, the system
//       prompt folded into the first user turn as <<SYS>>\n{system}\n<</SYS>>\n\n
//       (Llama-2-chat's template).
//   kMistral  "[INST]", no "<<SYS>>", no "system"
//       {bos} once, then [INST] {user} [/INST]{assistant}{eos} per exchange, the eos followed by
//       " " where the template writes it (Mistral-7B-Instruct-v0.1; Mixtral-8x7B-Instruct-v0.1
//       does not); no system prompt.
//   kNone     (no template)
//       GPT-2 style: each user/system content followed by "\n", each assistant content followed by
//       the eos token; no role names.
//
// Qwen3 (a ChatML template that mentions "<think>"): an assistant turn after the last user message
// is written <think>\n{reasoning}\n</think>\n\n{answer}, the reasoning taken from a
// "<think>...</think>" in the content (empty when there is none); enable_thinking false adds an
// empty think block after the generation prompt.
//
// Never a silent guess: a template whose family is not recognised is an error naming
// --chat-format chatml|llama3|llama2|mistral|none; so is a Mistral [INST] template with a system
// prompt or tools (v0.2 and later: the system prompt goes into the last user turn). A recognised
// template may hold more than plain chat (tool calls, tool results, images): the renderer
// reproduces the plain-chat subset (system/user/assistant messages with text content) and
// ChatTemplate::not_reproduced says what else the template has.
//
// Masks (train_on_inputs false, as axolotl): a token counts in the loss when it is part of an
// assistant turn's body and its end-of-turn token — ChatML: the content (with Qwen3's think block)
// and <|im_end|> (not the "\n" after it); Llama 3: the trimmed content and <|eot_id|>; Llama 2:
// " " + stripped content + " " and the eos </s> (the space is inside the content's first token,
// "▁word"); Mistral: the content and eos (not the " " after it); none: the content and eos.
// Headers, role names, system and user turns, BOS and the generation prompt do not count.
//
// Example:
//
//   auto tok = strata::Tokenizer::from_folder(dir);
//   strata::ChatTemplate t = strata::chat_template_from_folder(dir);  // or chat_template_for(...)
//   strata::RenderOptions o = strata::render_options_for(tok);        // bos/eos strings
//   auto msgs = strata::parse_chat_record(nlohmann::json::parse(line), strata::ChatUse::kTraining);
//   strata::EncodedChat e = strata::encode_chat(tok, t, msgs, o);    // tokens + counted mask
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "strata/tokenizer.h"

namespace strata {

struct ChatMessage {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
  // An assistant message's "reasoning_content" (distilled-reasoning datasets): Qwen3's template
  // writes it as the think block; the other layouts, as their templates, leave it out.
  std::optional<std::string> reasoning = {};  // (given, even empty: the template takes it)
  bool operator==(const ChatMessage&) const = default;
};

enum class ChatUse {
  kTraining,  // the conversation must end with an assistant message (something to learn)
  kPrompt,    // the conversation may end anywhere (a prompt to continue)
};

// The messages of one jsonl record in any of the three shapes datasets use:
//   {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}  (OpenAI / HF)
//   {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}    (ShareGPT)
//   {"instruction": "...", "input": "..." (optional), "output": "..."}            (Alpaca)
// Alpaca becomes two messages: user = instruction, or instruction + "\n\n" + input when input is
// not empty; assistant = output; its "history" ([[instruction, output], ...], LLaMA-Factory's)
// goes first. ShareGPT's "human"/"user" -> user, "gpt"/"assistant" -> assistant. A record's own
// "system" (ShareGPT and Alpaca datasets carry one) is the first message. Throws strata::Error
// naming the problem (an unknown role, a missing or non-string field, an empty conversation, a
// system message after the first or beside the record's "system", an assistant message with
// tool_calls, which no layout here renders, for kTraining one that does not end with an assistant
// message); `where` prefixes the message ("data.jsonl:12").
std::vector<ChatMessage> parse_chat_record(const nlohmann::json& record, ChatUse use,
                                           std::string_view where = "chat record");

enum class ChatFormat { kChatML, kLlama3, kLlama2, kMistral, kNone };

// "chatml" | "llama3" | "llama2" | "none"; anything else is an error listing them.
ChatFormat parse_chat_format(std::string_view name);
const char* chat_format_name(ChatFormat f);

// What the renderer reproduces of one template: the family and the details it varies by.
struct ChatTemplate {
  ChatFormat format = ChatFormat::kNone;
  std::string default_system;    // ChatML: the system turn written when none is given ("": none)
  bool qwen3_thinking = false;   // ChatML: Qwen3's <think> blocks
  bool space_after_eos = false;  // Mistral: " " after each answer's eos (Mistral-7B v0.1)
  bool always_generation_prompt = false;  // Llama 3: the assistant header ends every rendering
  // Llama 3.1+: a system turn always written first, "Cutting Knowledge Date: {knowledge_cutoff}\n
  // Today Date: {date}\n\n{system, trimmed}" ("": no such turn, Llama 3).
  std::string knowledge_cutoff;
  std::string default_date;  // the template's own date_string when none is given ("26 Jul 2024")
  std::vector<std::string> not_reproduced;  // what else the template has ("tool calls", ...)
};

// The family's plain layout (what --chat-format picks): no default system prompt, no thinking,
// the generation prompt only when asked for.
ChatTemplate chat_template_for(ChatFormat f);
// Recognises a template's Jinja source by fingerprint. Throws naming --chat-format when the
// family is not one of these (or is Mistral's [INST] layout).
ChatTemplate chat_template_from_jinja(std::string_view source);
// A folder's template: chat_template.jinja, else tokenizer_config.json's `chat_template` (a
// string, or a list of {name, template} where the one named "default" is used). A folder with
// none is an error naming --chat-format.
ChatTemplate chat_template_from_folder(const std::filesystem::path& dir);
inline ChatFormat chat_format_from_config(const std::filesystem::path& dir) {
  return chat_template_from_folder(dir).format;
}

struct RenderOptions {
  bool add_generation_prompt = false;  // end with the assistant's header, for generation
  bool enable_thinking = true;         // Qwen3: false writes an empty think block after it
  std::string date_string;  // Llama 3.1+: the "Today Date" ("": the template's default_date)
  std::string bos_token;    // the template's bos_token (Llama 2 / 3: "<s>", ...)
  std::string eos_token;    // the template's eos_token (Llama 2, none: "</s>", ...)
};
// bos_token / eos_token as the tokenizer's tokenizer_config.json names them ("" where none).
RenderOptions render_options_for(const Tokenizer& tok);

// One piece of rendered text. `counted`: part of an assistant turn's body or its end-of-turn
// token (see the masks above). `special`: a special token the template writes (<|im_start|>,
// <|eot_id|>, bos, eos), on its own.
struct ChatSegment {
  std::string text;
  bool counted = false;
  bool special = false;
};

// The rendered conversation as pieces whose concatenation is render_chat's text. Throws naming
// the message when the family cannot place it (Llama 2: roles must alternate user/assistant after
// the system prompt, as its template requires).
std::vector<ChatSegment> render_chat_segments(const ChatTemplate& t,
                                              const std::vector<ChatMessage>& messages,
                                              const RenderOptions& o);
std::string render_chat(const ChatTemplate& t, const std::vector<ChatMessage>& messages,
                        const RenderOptions& o);

// The text of the token that ends an assistant turn: <|im_end|>, <|eot_id|>, or the eos token.
std::string end_of_turn(const ChatTemplate& t, const RenderOptions& o);

struct EncodedChat {
  std::vector<std::int32_t> tokens;
  std::vector<std::uint8_t> counted;  // 1: the token counts in the loss (as tokens.size())
  // Tokens that cross a boundary between a counted and an uncounted piece (a merge across it);
  // each belongs to the piece it ends in. 0 with the families' layouts on their own vocabularies.
  std::size_t straddling = 0;
};

// The tokens of render_chat's text exactly as tokenizer.encode(text, false) gives them (the BOS
// is in the text where the template writes it), with the mask. The text is encoded in runs
// between the template's special tokens (each run after its special token, so a normalizer sees
// it where it is in the whole text); a mask boundary inside a run is placed by encoding the run up
// to it.
EncodedChat encode_chat(const Tokenizer& tok, const ChatTemplate& t,
                        const std::vector<ChatMessage>& messages, const RenderOptions& o);

}  // namespace strata
