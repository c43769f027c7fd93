// Chat records, the families' chat templates rendered natively, and chat encoding with a target
// mask (strata/chat.h). The layouts reproduce the families' Jinja templates character for
// character; tests/chat_test.cpp compares them with @huggingface/jinja running the templates.
#include "strata/chat.h"

#include <fstream>
#include <sstream>

#include "strata/error.h"
#include "strata/json_config.h"

namespace strata {

namespace {

using Json = nlohmann::json;

// Python's str.isspace() set, which Jinja's `trim` filter and str.strip() remove (UTF-8).
bool is_space_at(std::string_view s, std::size_t i, std::size_t* len) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  if (c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f)) {
    *len = 1;
    return true;
  }
  static const char* const kWide[] = {"\u0085", "\u00a0", "\u1680", "\u2000", "\u2001",
                                      "\u2002", "\u2003", "\u2004", "\u2005", "\u2006",
                                      "\u2007", "\u2008", "\u2009", "\u200a", "\u2028",
                                      "\u2029", "\u202f", "\u205f", "\u3000"};
  for (const char* w : kWide) {
    const std::string_view ws(w);
    if (s.substr(i, ws.size()) == ws) {
      *len = ws.size();
      return true;
    }
  }
  return false;
}

// The last character of `s` before `end` starts where? (UTF-8: skip continuation bytes back.)
std::size_t char_start_before(std::string_view s, std::size_t end) {
  std::size_t b = end - 1;
  while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
  return b;
}

std::string strip(std::string_view s) {
  std::size_t b = 0, n = 0;
  while (b < s.size() && is_space_at(s, b, &n)) b += n;
  std::size_t e = s.size();
  while (e > b) {
    const std::size_t c = char_start_before(s, e);
    if (!is_space_at(s, c, &n) || c + n != e) break;
    e = c;
  }
  return std::string(s.substr(b, e - b));
}

std::string_view lstrip_newlines(std::string_view s) {
  while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
  return s;
}
std::string_view rstrip_newlines(std::string_view s) {
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}

const std::string& string_field(const Json& obj, const char* key, std::string_view where,
                                std::string_view what) {
  const auto it = obj.find(key);
  STRATA_REQUIRE(it != obj.end(), "{}: {} has no \"{}\"", where, what, key);
  STRATA_REQUIRE(it->is_string(), "{}: {}'s \"{}\" is not a string (it is {})", where, what, key,
                 it->type_name());
  return it->get_ref<const std::string&>();
}

}  // namespace

std::vector<ChatMessage> parse_chat_record(const Json& record, ChatUse use,
                                           std::string_view where) {
  STRATA_REQUIRE(record.is_object(),
                 "{}: a chat record is a JSON object with \"messages\", \"conversations\" or "
                 "\"instruction\"/\"output\" (this one is {})",
                 where, record.type_name());
  std::vector<ChatMessage> out;
  if (record.contains("messages") || record.contains("conversations")) {
    const bool sharegpt = !record.contains("messages");
    const char* list_key = sharegpt ? "conversations" : "messages";
    const Json& list = record[list_key];
    STRATA_REQUIRE(list.is_array(), "{}: \"{}\" is not a list of messages", where, list_key);
    STRATA_REQUIRE(!list.empty(), "{}: \"{}\" is empty: a conversation needs messages", where,
                   list_key);
    for (std::size_t i = 0; i < list.size(); ++i) {
      const std::string what = fmt::format("{}[{}]", list_key, i);
      STRATA_REQUIRE(list[i].is_object(), "{}: {} is not an object", where, what);
      std::string role = string_field(list[i], sharegpt ? "from" : "role", where, what);
      const std::string& content =
          string_field(list[i], sharegpt ? "value" : "content", where, what);
      if (sharegpt) {
        if (role == "human" || role == "user")
          role = "user";
        else if (role == "gpt" || role == "assistant")
          role = "assistant";
        else
          STRATA_REQUIRE(role == "system",
                         "{}: {} is from '{}': ShareGPT messages are from \"system\", \"human\" or "
                         "\"gpt\"",
                         where, what, role);
      } else {
        STRATA_REQUIRE(role == "system" || role == "user" || role == "assistant",
                       "{}: {} has role '{}': the roles are \"system\", \"user\" and \"assistant\"",
                       where, what, role);
      }
      STRATA_REQUIRE(role != "system" || i == 0,
                     "{}: {} is a system message after the first message: put the system prompt "
                     "first",
                     where, what);
      // A tool call is what the answer is (its content often empty): trained on as an empty
      // answer, the model would learn to say nothing.
      const auto calls = list[i].find("tool_calls");
      STRATA_REQUIRE(
          calls == list[i].end() || calls->is_null() || (calls->is_array() && calls->empty()),
          "{}: {} has tool_calls, which strata's chat layouts do not render (the "
          "template writes them as its own tool-call blocks): leave such records out",
          where, what);
      std::optional<std::string> reasoning;
      if (const auto r = list[i].find("reasoning_content"); r != list[i].end() && !r->is_null()) {
        STRATA_REQUIRE(r->is_string(), "{}: {}'s \"reasoning_content\" is not a string (it is {})",
                       where, what, r->type_name());
        reasoning = r->get<std::string>();
      }
      out.push_back({std::move(role), content, std::move(reasoning)});
    }
  } else if (record.contains("instruction")) {
    // LLaMA-Factory's earlier turns: [[instruction, output], ...].
    if (const auto h = record.find("history"); h != record.end() && !h->is_null()) {
      STRATA_REQUIRE(h->is_array(), "{}: \"history\" is not a list of [instruction, output] pairs",
                     where);
      for (std::size_t i = 0; i < h->size(); ++i) {
        const nlohmann::json& pair = (*h)[i];
        STRATA_REQUIRE(
            pair.is_array() && pair.size() == 2 && pair[0].is_string() && pair[1].is_string(),
            "{}: history[{}] is not an [instruction, output] pair of strings", where, i);
        out.push_back({"user", pair[0].get<std::string>()});
        out.push_back({"assistant", pair[1].get<std::string>()});
      }
    }
    const std::string& instruction = string_field(record, "instruction", where, "the record");
    std::string user = instruction;
    if (record.contains("input") && !record["input"].is_null()) {
      const std::string& input = string_field(record, "input", where, "the record");
      if (!input.empty()) user += "\n\n" + input;
    }
    out.push_back({"user", std::move(user)});
    if (use == ChatUse::kTraining || record.contains("output"))
      out.push_back({"assistant", string_field(record, "output", where, "the Alpaca record")});
  } else {
    std::string keys;
    for (const auto& [k, v] : record.items()) keys += (keys.empty() ? "" : ", ") + k;
    STRATA_REQUIRE(false,
                   "{}: not a chat record: it has no \"messages\" (role/content), "
                   "\"conversations\" (ShareGPT from/value) or \"instruction\"/\"output\" (Alpaca) "
                   "(its keys: {})",
                   where, keys.empty() ? "none" : keys);
  }
  // The record's own system prompt (ShareGPT and Alpaca datasets), first.
  if (const auto sys = record.find("system"); sys != record.end() && !sys->is_null()) {
    STRATA_REQUIRE(sys->is_string(), "{}: \"system\" is not a string (it is {})", where,
                   sys->type_name());
    const std::string& system = sys->get_ref<const std::string&>();
    const bool has_one = !out.empty() && out[0].role == "system";
    STRATA_REQUIRE(!has_one || out[0].content == system,
                   "{}: the record's \"system\" and its system message differ: keep one", where);
    if (!has_one && !system.empty()) out.insert(out.begin(), ChatMessage{"system", system});
  }
  if (use == ChatUse::kTraining)
    STRATA_REQUIRE(out.back().role == "assistant",
                   "{}: the conversation ends with a {} message: a training conversation ends with "
                   "the assistant's answer",
                   where, out.back().role);
  return out;
}

ChatFormat parse_chat_format(std::string_view name) {
  if (name == "chatml") return ChatFormat::kChatML;
  if (name == "llama3") return ChatFormat::kLlama3;
  if (name == "llama2") return ChatFormat::kLlama2;
  if (name == "mistral") return ChatFormat::kMistral;
  if (name == "none") return ChatFormat::kNone;
  STRATA_REQUIRE(
      false, "--chat-format '{}' is not a chat format: chatml | llama3 | llama2 | mistral | none",
      name);
}

const char* chat_format_name(ChatFormat f) {
  switch (f) {
    case ChatFormat::kChatML:
      return "chatml";
    case ChatFormat::kLlama3:
      return "llama3";
    case ChatFormat::kLlama2:
      return "llama2";
    case ChatFormat::kMistral:
      return "mistral";
    case ChatFormat::kNone:
      return "none";
  }
  return "?";
}

ChatTemplate chat_template_for(ChatFormat f) {
  ChatTemplate t;
  t.format = f;
  return t;
}

namespace {

bool has(std::string_view s, std::string_view what) {
  return s.find(what) != std::string_view::npos;
}

// A default system prompt written as a literal: '<|im_start|>system\n...<|im_end|>' inside one
// string literal of the template (Qwen2 / Qwen2.5), unescaped; "" when there is none.
std::string chatml_default_system(std::string_view src) {
  const std::string_view head = "<|im_start|>system";
  for (std::size_t at = src.find(head); at != std::string_view::npos; at = src.find(head, at + 1)) {
    std::size_t p = at + head.size();
    if (src.substr(p, 2) == "\\n")
      p += 2;
    else if (src.substr(p, 1) == "\n")
      p += 1;
    else
      continue;
    const std::size_t end = src.find("<|im_end|>", p);
    if (end == std::string_view::npos) continue;
    const std::string_view body = src.substr(p, end - p);
    if (body.empty() || has(body, "'") || has(body, "\"") || has(body, "+") || has(body, "{"))
      continue;  // the literal ends before <|im_end|>: the content is an expression
    std::string out;
    for (std::size_t i = 0; i < body.size(); ++i) {
      if (body[i] == '\\' && i + 1 < body.size()) {
        const char c = body[++i];
        out += c == 'n' ? '\n' : c == 't' ? '\t' : c;
      } else {
        out += body[i];
      }
    }
    return out;
  }
  return {};
}

// The literal text after `marker` up to the end of its string literal or an escaped newline.
std::string literal_after(std::string_view src, std::string_view marker) {
  const std::size_t at = src.find(marker);
  if (at == std::string_view::npos) return {};
  std::string_view rest = src.substr(at + marker.size());
  std::size_t end = 0;
  while (end < rest.size() && rest[end] != '"' && rest[end] != '\'' && rest[end] != '\\' &&
         rest[end] != '\n')
    ++end;
  return std::string(rest.substr(0, end));
}

}  // namespace

ChatTemplate chat_template_from_jinja(std::string_view src) {
  ChatTemplate t;
  auto note_tools = [&] {
    if (has(src, "tool_calls") || has(src, "tools")) t.not_reproduced.push_back("tool calls");
    if (has(src, "'tool'") || has(src, "\"tool\"") || has(src, "ipython"))
      t.not_reproduced.push_back("tool results");
    if (has(src, "image")) t.not_reproduced.push_back("images");
  };
  // Each layout is recognised by its markers, then the ways a template of that family may
  // differ from what strata renders are refused: "never a silent guess".
  if (has(src, "<|im_start|>")) {
    STRATA_REQUIRE(!has(src, "<|im_sep|>"),
                   "the chat template writes <|im_sep|> after the role (Phi-4's layout), not "
                   "ChatML's newline, which strata does not reproduce: pass --chat-format chatml "
                   "to use ChatML's layout instead");
    STRATA_REQUIRE(!has(src, "message['content'] | trim") && !has(src, "message.content | trim") &&
                       !has(src, "message['content'].strip()") &&
                       !has(src, "message.content.strip()"),
                   "the chat template is ChatML with its messages trimmed, which strata does not "
                   "reproduce (it writes them as they are, as ChatML's templates do): pass "
                   "--chat-format chatml to use ChatML's layout, untrimmed");
    t.format = ChatFormat::kChatML;
    t.default_system = chatml_default_system(src);
    t.qwen3_thinking = has(src, "<think>");
    note_tools();
    return t;
  }
  if (has(src, "<|start_header_id|>")) {
    STRATA_REQUIRE(has(src, "trim") || has(src, ".strip()"),
                   "the chat template has Llama 3's headers but does not trim the messages as "
                   "Llama 3's does, which strata does: pass --chat-format llama3 to use Llama 3's "
                   "layout");
    t.format = ChatFormat::kLlama3;
    t.always_generation_prompt = !has(src, "add_generation_prompt");
    if (has(src, "Cutting Knowledge Date: ")) {
      t.knowledge_cutoff = literal_after(src, "Cutting Knowledge Date: ");
      t.default_date = literal_after(src, "set date_string = \"");
      STRATA_REQUIRE(!t.knowledge_cutoff.empty() && !t.default_date.empty(),
                     "the chat template is Llama 3.1's or later, but its \"Cutting Knowledge "
                     "Date\" line or its default date_string is not a plain literal: pass "
                     "--chat-format llama3 for Llama 3's layout without the date header");
      if (has(src, "strftime_now"))
        t.not_reproduced.push_back(
            "today's date (strftime_now; date_string or the template's default is written)");
    }
    note_tools();
    return t;
  }
  if (has(src, "[INST]") && has(src, "<<SYS>>")) {
    t.format = ChatFormat::kLlama2;
    note_tools();
    return t;
  }
  if (has(src, "[INST]")) {
    STRATA_REQUIRE(!has(src, "system") && !has(src, "[AVAILABLE_TOOLS]"),
                   "the chat template is a later Mistral [INST] layout (one with a system prompt "
                   "or tools, v0.2 and later), which strata does not reproduce: pass "
                   "--chat-format mistral for Mistral-7B-Instruct-v0.1's layout (no system "
                   "prompt), or chatml | llama3 | llama2 | none");
    t.format = ChatFormat::kMistral;
    t.space_after_eos = has(src, "eos_token + ' '");
    note_tools();
    return t;
  }
  STRATA_REQUIRE(
      false,
      "the chat template is not one strata recognises (it has none of <|im_start|>, "
      "<|start_header_id|>, [INST]): pass --chat-format chatml|llama3|llama2|mistral|none "
      "to pick the layout");
}

ChatTemplate chat_template_from_folder(const std::filesystem::path& dir) {
  auto slurp = [](const std::filesystem::path& p) {
    std::ifstream f(p, std::ios::binary);
    STRATA_REQUIRE(f.good(), "{}: cannot be read", p.string());
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  };
  std::error_code ec;
  if (std::filesystem::exists(dir / "chat_template.jinja", ec))
    return chat_template_from_jinja(slurp(dir / "chat_template.jinja"));
  const auto cfg_path = dir / "tokenizer_config.json";
  std::string src;
  if (std::filesystem::exists(cfg_path, ec)) {
    const Json cfg =
        config::parse(slurp(cfg_path), cfg_path.string(), /*duplicates_last_wins=*/true);
    if (cfg.is_object() && cfg.contains("chat_template")) {
      const Json& ct = cfg["chat_template"];
      if (ct.is_string()) src = ct.get<std::string>();
      if (ct.is_array())
        for (const Json& e : ct)
          if (e.is_object() && e.contains("name") && e["name"] == "default" &&
              e.contains("template") && e["template"].is_string())
            src = e["template"].get<std::string>();
    }
  }
  STRATA_REQUIRE(
      !src.empty(),
      "{} has no chat template (no chat_template.jinja, no \"chat_template\" in "
      "tokenizer_config.json): pass --chat-format chatml|llama3|llama2|mistral|none to pick "
      "one",
      dir.string());
  return chat_template_from_jinja(src);
}

RenderOptions render_options_for(const Tokenizer& tok) {
  RenderOptions o;
  if (tok.bos_id()) o.bos_token = tok.id_to_token(*tok.bos_id());
  if (tok.eos_id()) o.eos_token = tok.id_to_token(*tok.eos_id());
  return o;
}

std::string end_of_turn(const ChatTemplate& t, const RenderOptions& o) {
  switch (t.format) {
    case ChatFormat::kChatML:
      return "<|im_end|>";
    case ChatFormat::kLlama3:
      return "<|eot_id|>";
    default:
      return o.eos_token;
  }
}

namespace {

struct Builder {
  std::vector<ChatSegment> segs;
  void text(std::string_view s, bool counted = false) {
    if (s.empty()) return;
    if (!segs.empty() && !segs.back().special && segs.back().counted == counted)
      segs.back().text += s;
    else
      segs.push_back({std::string(s), counted, false});
  }
  void special(std::string_view s, bool counted = false) {
    if (!s.empty()) segs.push_back({std::string(s), counted, true});
  }
};

void render_chatml(const ChatTemplate& t, const std::vector<ChatMessage>& m, const RenderOptions& o,
                   Builder& b) {
  if ((m.empty() || m[0].role != "system") && !t.default_system.empty()) {
    b.special("<|im_start|>");
    b.text("system\n" + t.default_system);
    b.special("<|im_end|>");
    b.text("\n");
  }
  // Qwen3: the last user message; assistant turns after it get a think block.
  // (A user message that is a tool's response is no query: the template skips those.)
  std::size_t last_query = m.size() - 1;
  for (std::size_t i = m.size(); i-- > 0;)
    if (m[i].role == "user" && !(m[i].content.starts_with("<tool_response>") &&
                                 m[i].content.ends_with("</tool_response>"))) {
      last_query = i;
      break;
    }
  for (std::size_t i = 0; i < m.size(); ++i) {
    const bool assistant = m[i].role == "assistant";
    b.special("<|im_start|>");
    b.text(m[i].role + "\n");
    std::string body = m[i].content;
    if (assistant && t.qwen3_thinking) {
      std::string_view content = m[i].content;
      std::string_view reasoning = m[i].reasoning ? std::string_view(*m[i].reasoning) : "";
      const std::size_t close = content.find("</think>");
      if (m[i].reasoning) {
        // "reasoning_content" given: the template takes it, and the content as it is.
      } else if (close != std::string_view::npos) {
        const std::string_view before = content.substr(0, close);
        content = lstrip_newlines(content.substr(content.rfind("</think>") + 8));
        reasoning = rstrip_newlines(before);
        const std::size_t open = reasoning.rfind("<think>");
        if (open != std::string_view::npos) reasoning = reasoning.substr(open + 7);
        reasoning = lstrip_newlines(reasoning);
      }
      if (i > last_query && (i + 1 == m.size() || !reasoning.empty()))
        body = "<think>\n" + std::string(rstrip_newlines(lstrip_newlines(reasoning))) +
               "\n</think>\n\n" + std::string(lstrip_newlines(content));
      else
        body = std::string(content);
    }
    b.text(body, assistant);
    b.special("<|im_end|>", assistant);
    b.text("\n");
  }
  if (o.add_generation_prompt) {
    b.special("<|im_start|>");
    b.text("assistant\n");
    if (t.qwen3_thinking && !o.enable_thinking) b.text("<think>\n\n</think>\n\n");
  }
}

void render_llama3(const ChatTemplate& t, const std::vector<ChatMessage>& m, const RenderOptions& o,
                   Builder& b) {
  std::size_t first = 0;
  if (!t.knowledge_cutoff.empty()) {  // Llama 3.1+: the system turn, always
    b.special(o.bos_token);
    b.special("<|start_header_id|>");
    b.text("system");
    b.special("<|end_header_id|>");
    b.text("\n\nCutting Knowledge Date: " + t.knowledge_cutoff +
           "\nToday Date: " + (o.date_string.empty() ? t.default_date : o.date_string) + "\n\n");
    if (m[0].role == "system") {
      b.text(strip(m[0].content));
      first = 1;
    }
    b.special("<|eot_id|>");
  }
  for (std::size_t i = first; i < m.size(); ++i) {
    const bool assistant = m[i].role == "assistant";
    if (i == 0 && t.knowledge_cutoff.empty()) b.special(o.bos_token);
    b.special("<|start_header_id|>");
    b.text(m[i].role);
    b.special("<|end_header_id|>");
    b.text("\n\n");
    b.text(strip(m[i].content), assistant);
    b.special("<|eot_id|>", assistant);
  }
  if (o.add_generation_prompt || t.always_generation_prompt) {
    b.special("<|start_header_id|>");
    b.text("assistant");
    b.special("<|end_header_id|>");
    b.text("\n\n");
  }
}

void render_llama2(const std::vector<ChatMessage>& all, const RenderOptions& o, Builder& b) {
  std::size_t first = 0;
  std::string system;
  bool has_system = false;
  if (!all.empty() && all[0].role == "system") {
    system = all[0].content;
    has_system = true;
    first = 1;
  }
  for (std::size_t i = first; i < all.size(); ++i) {
    const std::size_t k = i - first;
    const bool want_user = k % 2 == 0;
    STRATA_REQUIRE((all[i].role == "user") == want_user && all[i].role != "system",
                   "message {} is a {} message: Llama 2's chat template needs the roles to "
                   "alternate user/assistant/user/... after an optional system prompt",
                   i, all[i].role);
    std::string content = all[i].content;
    if (k == 0 && has_system) content = "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + content;
    if (want_user) {
      b.special(o.bos_token);
      b.text("[INST] " + strip(content) + " [/INST]");
    } else {
      b.text(" " + strip(content) + " ", true);
      b.special(o.eos_token, true);
    }
  }
}

void render_mistral(const ChatTemplate& t, const std::vector<ChatMessage>& m,
                    const RenderOptions& o, Builder& b) {
  b.special(o.bos_token);
  for (std::size_t i = 0; i < m.size(); ++i) {
    const bool want_user = i % 2 == 0;
    STRATA_REQUIRE(m[i].role != "system",
                   "Mistral's chat template has no system prompt: leave it out, or pick a layout "
                   "with one (--chat-format llama2)");
    STRATA_REQUIRE((m[i].role == "user") == want_user,
                   "message {} is a {} message: Mistral's chat template needs the roles to "
                   "alternate user/assistant/user/...",
                   i, m[i].role);
    if (want_user) {
      b.text("[INST] " + m[i].content + " [/INST]");
    } else {
      b.text(m[i].content, true);
      b.special(o.eos_token, true);
      if (t.space_after_eos) b.text(" ");
    }
  }
}

void render_none(const std::vector<ChatMessage>& m, const RenderOptions& o, Builder& b) {
  for (const ChatMessage& msg : m) {
    if (msg.role == "assistant") {
      b.text(msg.content, true);
      b.special(o.eos_token, true);
    } else {
      b.text(msg.content + "\n");
    }
  }
}

}  // namespace

std::vector<ChatSegment> render_chat_segments(const ChatTemplate& t,
                                              const std::vector<ChatMessage>& messages,
                                              const RenderOptions& o) {
  STRATA_REQUIRE(!messages.empty(), "a chat needs at least one message");
  Builder b;
  switch (t.format) {
    case ChatFormat::kChatML:
      render_chatml(t, messages, o, b);
      break;
    case ChatFormat::kLlama3:
      render_llama3(t, messages, o, b);
      break;
    case ChatFormat::kLlama2:
      render_llama2(messages, o, b);
      break;
    case ChatFormat::kMistral:
      render_mistral(t, messages, o, b);
      break;
    case ChatFormat::kNone:
      render_none(messages, o, b);
      break;
  }
  return std::move(b.segs);
}

std::string render_chat(const ChatTemplate& t, const std::vector<ChatMessage>& messages,
                        const RenderOptions& o) {
  std::string out;
  for (const ChatSegment& s : render_chat_segments(t, messages, o)) out += s.text;
  return out;
}

EncodedChat encode_chat(const Tokenizer& tok, const ChatTemplate& t,
                        const std::vector<ChatMessage>& messages, const RenderOptions& o) {
  const std::vector<ChatSegment> segs = render_chat_segments(t, messages, o);
  EncodedChat out;
  // `anchor`: the special token the current run follows ("" at the start of the text). A run is
  // encoded after it, and its tokens dropped, so the run sees the context the whole text gives it.
  std::string anchor;
  std::size_t anchor_tokens = 0;
  auto encode_after = [&](const std::string& text) {
    std::vector<std::int32_t> ids = tok.encode(anchor + text, /*add_special_tokens=*/false);
    STRATA_CHECK(ids.size() >= anchor_tokens, "the special token '{}' lost its token", anchor);
    ids.erase(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(anchor_tokens));
    return ids;
  };
  for (std::size_t i = 0; i < segs.size();) {
    if (segs[i].special) {
      const std::vector<std::int32_t> ids = tok.encode(segs[i].text, false);
      const bool one_token = ids.size() == 1 && tok.token_to_id(segs[i].text) == ids[0];
      if (one_token) {
        out.tokens.push_back(ids[0]);
        out.counted.push_back(segs[i].counted);
        anchor = segs[i].text;
        anchor_tokens = 1;
        ++i;
        continue;
      }
      // Not one token in this vocabulary (a layout picked with --chat-format for another family):
      // it is text, encoded with the run it belongs to.
    }
    // A run: the pieces up to the next special token that is one token.
    std::size_t j = i;
    std::string run;
    std::vector<std::pair<std::size_t, bool>> bounds;  // (end of a piece in run, its counted)
    while (j < segs.size()) {
      if (segs[j].special && j > i) {
        const auto ids = tok.encode(segs[j].text, false);
        if (ids.size() == 1 && tok.token_to_id(segs[j].text) == ids[0]) break;
      }
      run += segs[j].text;
      bounds.emplace_back(run.size(), segs[j].counted);
      ++j;
    }
    const std::vector<std::int32_t> ids = encode_after(run);
    std::size_t from = 0;  // tokens of `ids` already given a mask value
    for (std::size_t k = 0; k < bounds.size(); ++k) {
      std::size_t upto = ids.size();
      if (k + 1 < bounds.size() && bounds[k + 1].second != bounds[k].second) {
        const std::vector<std::int32_t> prefix = encode_after(run.substr(0, bounds[k].first));
        std::size_t same = 0;
        while (same < prefix.size() && same < ids.size() && prefix[same] == ids[same]) ++same;
        if (same < prefix.size()) ++out.straddling;  // a token crosses the boundary
        upto = std::max(from, same);
      } else if (k + 1 < bounds.size()) {
        continue;  // the same mask value on both sides: no boundary to place
      }
      for (; from < upto; ++from) {
        out.tokens.push_back(ids[from]);
        out.counted.push_back(bounds[k].second);
      }
    }
    i = j;
  }
  return out;
}

}  // namespace strata
