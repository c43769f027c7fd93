// The checks of the files a program reads and writes (strata/paths.h), and strata::train making
// them itself: an API caller's log on its own corpus is refused, and the corpus is kept.
#include "strata/paths.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>

#include "strata/trainer.h"
#include "test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::slurp;
using testing::TempDir;

void write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

TEST(Paths, SameFileSeesThroughLinksDotsAndHardLinks) {
  TempDir d;
  const std::string f = d.path + "/a.txt";
  write(f, "x");
  fs::create_symlink(f, d.path + "/soft");
  fs::create_hard_link(f, d.path + "/hard");
  fs::create_directory(d.path + "/sub");
  EXPECT_TRUE(same_file(f, d.path + "/soft"));
  EXPECT_TRUE(same_file(f, d.path + "/hard"));
  EXPECT_TRUE(same_file(f, d.path + "/sub/../a.txt"));
  EXPECT_TRUE(same_file(d.path + "/new.txt", d.path + "/sub/../new.txt"));  // neither there yet
  EXPECT_FALSE(same_file(f, d.path + "/b.txt"));
  EXPECT_FALSE(same_file(f, ""));
}

// A lock taken without waiting: refused only while another open of the file holds it (another
// process's, or this one's through another open), taken again once that one is closed; a
// descriptor that cannot be locked at all (a pipe's) is not "held by another".
TEST(Paths, LockUnlessHeldRefusesOnlyAnotherHolder) {
  TempDir d;
  const std::string f = d.path + "/x.lock";
  const int a = ::open(f.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  const int b = ::open(f.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(a, 0);
  ASSERT_GE(b, 0);
  EXPECT_TRUE(lock_unless_held(a));
  EXPECT_TRUE(lock_unless_held(a));  // its own again
  EXPECT_FALSE(lock_unless_held(b));
  ::close(a);
  EXPECT_TRUE(lock_unless_held(b));
  ::close(b);
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  EXPECT_TRUE(lock_unless_held(p[0]));
  ::close(p[0]);
  ::close(p[1]);
}

TEST(Paths, CanonicalPathIsAbsoluteWithLinksAndDotsResolved) {
  TempDir d;
  const std::string real = fs::canonical(d.path).string();
  write(d.path + "/a.txt", "x");
  fs::create_directory(d.path + "/sub");
  fs::create_directory_symlink(d.path + "/sub", d.path + "/link");
  EXPECT_EQ(canonical_path(d.path + "/sub/../a.txt"), real + "/a.txt");
  EXPECT_EQ(canonical_path(d.path + "/link/new.txt"), real + "/sub/new.txt");  // not there yet
  const fs::path cwd = fs::current_path();
  fs::current_path(d.path + "/link");
  EXPECT_EQ(canonical_path("../a.txt"), real + "/a.txt");
  EXPECT_EQ(canonical_path("b/./c.txt"), real + "/sub/b/c.txt");
  fs::current_path(cwd);
}

TEST(Paths, OutputsApartFromEachOtherAndFromInputs) {
  TempDir d;
  const std::string corpus = d.path + "/corpus.txt", log = d.path + "/log.jsonl";
  write(corpus, "text");
  EXPECT_NE(error_of([&] {
              require_outputs_apart("the run", {{"--log-json", corpus}}, {{"--text", corpus}});
            }).find("--log-json " + corpus + " is the --text file: the run would replace it"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] {
        require_outputs_apart("x", {{"--log-json", log}, {"--plot", d.path + "/./log.jsonl"}}, {});
      }).find("--log-json and --plot both name " + log),
      std::string::npos);
  // Devices and empty paths are no files: two outputs to /dev/null, none named.
  EXPECT_EQ(error_of([&] {
              require_outputs_apart("x", {{"--a", "/dev/null"}, {"--b", "/dev/null"}, {"--c", ""}},
                                    {{"--text", ""}});
            }),
            "");
}

TEST(Paths, AUsersFileIsReplacedOnlyWithOverwrite) {
  TempDir d;
  const std::string f = d.path + "/notes.txt";
  write(f, "mine");
  EXPECT_NE(error_of([&] {
              require_overwrite_to_replace("--log-json", f, false);
            }).find("--log-json " + f + " exists: pass --overwrite to replace it"),
            std::string::npos);
  EXPECT_EQ(error_of([&] { require_overwrite_to_replace("--log-json", f, true); }), "");
  EXPECT_EQ(error_of([&] { require_overwrite_to_replace("--log-json", "/dev/null", false); }), "");
  // A link to no file is one to keep; a new path is free.
  fs::create_symlink(d.path + "/gone", d.path + "/dangling");
  EXPECT_NE(error_of([&] {
              require_output_file("-o", d.path + "/dangling", false);
            }).find("exists: pass --overwrite"),
            std::string::npos);
  EXPECT_EQ(error_of([&] { require_output_file("-o", d.path + "/new.bin", false); }), "");
  EXPECT_NE(error_of([&] { require_output_file("-o", d.path, false); }).find("is a folder"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              require_output_file("-o", f + "/x.bin", false);
            }).find("cannot be written in " + f),
            std::string::npos);
  EXPECT_EQ(slurp(f), "mine");
  // A file under /dev is a file all the same (/dev/shm, a tmpfs): it was taken for a device,
  // replaced without --overwrite, and could be an input the run replaced.
  std::error_code ec;
  if (fs::is_directory("/dev/shm") && ::access("/dev/shm", W_OK) == 0) {
    const std::string shm = fmt::format("/dev/shm/strata-paths-test-{}.txt", ::getpid());
    write(shm, "mine");
    EXPECT_NE(error_of([&] {
                require_overwrite_to_replace("--log-json", shm, false);
              }).find("exists: pass --overwrite"),
              std::string::npos);
    EXPECT_NE(error_of([&] {
                require_outputs_apart("the run", {{"--log-json", shm}}, {{"--text", shm}});
              }).find("is the --text file"),
              std::string::npos);
    EXPECT_EQ(slurp(shm), "mine");
    fs::remove(shm, ec);
  }
}

// What is written into as it is (a stream) and what a finished file replaces; writing into a
// stream appends, creates nothing, and does not wait for a FIFO's reader or die of its leaving.
TEST(Paths, StreamsAreWrittenInPlace) {
  TempDir d;
  const std::string f = d.path + "/f", fifo = d.path + "/p", link = d.path + "/out.svg";
  write(f, "abc");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  ASSERT_EQ(::symlink("/proc/self/fd/1", link.c_str()), 0);
  EXPECT_TRUE(written_in_place("/dev/null"));
  EXPECT_TRUE(written_in_place("/dev/stdout")) << "a link into /proc, whatever stdout is";
  EXPECT_TRUE(written_in_place("/dev/fd/2"));
  EXPECT_TRUE(written_in_place("/proc/self/fd/1"));
  EXPECT_TRUE(written_in_place(link));
  const std::string to_stdout = d.path + "/to-stdout", to_file = d.path + "/to-file",
                    to_fd = d.path + "/to-fd";
  ASSERT_EQ(::symlink("/dev/stdout", to_stdout.c_str()), 0);
  ASSERT_EQ(::symlink("/dev/fd/1", to_fd.c_str()), 0);
  EXPECT_TRUE(written_in_place(to_fd)) << "a link to /dev/fd/1, whatever stdout is";
  ASSERT_EQ(::symlink(f.c_str(), to_file.c_str()), 0);
  EXPECT_TRUE(written_in_place(to_stdout)) << "a link to a link into /proc";
  EXPECT_FALSE(written_in_place(to_file)) << "a link to a file is the file";
  EXPECT_TRUE(written_in_place(fifo));
  EXPECT_FALSE(written_in_place(f));
  EXPECT_FALSE(written_in_place(d.path));
  EXPECT_FALSE(written_in_place(d.path + "/missing"));
  EXPECT_FALSE(written_in_place(""));
  EXPECT_TRUE(null_device("/dev/null"));
  EXPECT_FALSE(null_device(fifo));
  EXPECT_FALSE(null_device(f));
  // Into a file (a redirected stdout's): appended, nothing of it replaced.
  EXPECT_EQ(write_into(f, "def", 3), 0);
  EXPECT_EQ(slurp(f), "abcdef");
  EXPECT_EQ(write_into(d.path + "/missing", "x", 1), ENOENT);
  EXPECT_FALSE(fs::exists(d.path + "/missing")) << "made a file";
  // A FIFO no one reads: ENXIO at once, not a wait.
  EXPECT_EQ(write_into(fifo, "x", 1), ENXIO);
  // One whose reader leaves mid-write: EPIPE, and the process lives on.
  const int rd = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  ASSERT_GE(rd, 0);
  std::thread reader([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // the pipe full by then
    ::close(rd);
  });
  const std::string big(std::size_t(1) << 20, 'x');  // more than the pipe holds
  EXPECT_EQ(write_into(fifo, big.data(), big.size()), EPIPE);
  reader.join();
  // copy_into: an open file's bytes from its start, the FIFO's reader waited for.
  const int from = ::open(f.c_str(), O_RDONLY);
  ASSERT_GE(from, 0);
  std::string got;
  std::thread whole([&] { got = slurp(fifo); });
  EXPECT_EQ(copy_into(from, fifo), 0);
  whole.join();
  EXPECT_EQ(got, "abcdef");
  EXPECT_EQ(copy_into(from, d.path + "/missing"), ENOENT);
  ::close(from);
  // A path naming one of the process's own descriptors (/dev/stdout is /proc/self/fd/1) is
  // written through it, at its offset: a file reopened by name wrote over what the process had
  // written there.
  const std::string own = d.path + "/own";
  const int fd = ::open(own.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, "head|", 5), 5);
  EXPECT_EQ(write_into(fmt::format("/dev/fd/{}", fd), "svg|", 4), 0);
  EXPECT_EQ(write_into(fmt::format("/proc/self/fd/{}", fd), "more|", 5), 0);
  ASSERT_EQ(::write(fd, "tail", 4), 4);
  ::close(fd);
  EXPECT_EQ(slurp(own), "head|svg|more|tail");
}

// An output the user named (--log-json, --trace, --svg, --out): a file is made anew; a stream
// (/dev/stdout sent to a file) is written into where the process's own lines are, nothing of
// them emptied or written over.
TEST(Paths, OutputsAreFilesMadeAnewOrStreamsWrittenInto) {
  TempDir d;
  const std::string f = d.path + "/log.jsonl", own = d.path + "/console";
  write(f, "an older run's lines\n");
  EXPECT_EQ(write_output(f, "new\n"), 0);
  EXPECT_EQ(slurp(f), "new\n");
  int fd = open_output(f);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(::write(fd, "x", 1), 1);
  ::close(fd);
  EXPECT_EQ(slurp(f), "x");
  EXPECT_EQ(write_output(d.path + "/no/such/folder/f", "x"), ENOENT);
  EXPECT_EQ(write_output(d.path, "x"), EISDIR);
  // A stream: a descriptor of this process's (a console redirected to a file), by a link as
  // /dev/stdout is one.
  const int console = ::open(own.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  ASSERT_GE(console, 0);
  const std::string link = d.path + "/stdout";
  ASSERT_EQ(::symlink(fmt::format("/proc/self/fd/{}", console).c_str(), link.c_str()), 0);
  ASSERT_EQ(::write(console, "step 1\n", 7), 7);
  fd = open_output(link);
  ASSERT_GE(fd, 0);
  EXPECT_EQ(::write(fd, "{1}\n", 4), 4);
  ASSERT_EQ(::write(console, "step 2\n", 7), 7);
  EXPECT_EQ(write_output(link, "<svg/>\n"), 0);
  EXPECT_EQ(write_holding_sigpipe(fd, "{2}\n", 4), 0);
  ::close(fd);
  ::close(console);
  EXPECT_EQ(slurp(own), "step 1\n{1}\nstep 2\n<svg/>\n{2}\n");
}

TEST(Paths, InputsAreFilesAndFoldersAsNamed) {
  TempDir d;
  const std::string f = d.path + "/c.bin";
  write(f, "x");
  EXPECT_NE(error_of([&] {
              require_input_file("--data", d.path);
            }).find("--data " + d.path + " is a folder, not a file: give the file itself"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { require_input_file("--data", d.path + "/nope"); }).find(": no such file"),
      std::string::npos);
  EXPECT_NE(error_of([&] { require_input_file("", "/dev/null"); }).find("not a regular file"),
            std::string::npos);
  EXPECT_EQ(error_of([&] { require_input_file("--data", f); }), "");
  EXPECT_NE(error_of([&] {
              require_input_folder("--model", f, "the model's folder");
            }).find("is a file, not a folder: give the model's folder"),
            std::string::npos);
  EXPECT_EQ(error_of([&] { require_input_folder("--model", d.path, "x"); }), "");
}

TEST(Paths, AModelFoldersFilesAreTheOnesStrataReads) {
  TempDir d;
  for (const char* name : {"config.json", "model-00001-of-00002.safetensors",
                           "model.safetensors.index.json", "tokenizer.json", "run.jsonl"})
    write(d.path + "/" + name, "{}");
  fs::create_directory(d.path + "/tokenizer.model");  // a folder of that name is no file
  const NamedPaths files = model_files_in_folder("--model", d.path);
  std::set<std::string> names;
  for (const auto& [flag, path] : files) names.insert(flag);
  EXPECT_EQ(names, (std::set<std::string>{"--model folder's config.json",
                                          "--model folder's model-00001-of-00002.safetensors",
                                          "--model folder's model.safetensors.index.json",
                                          "--model folder's tokenizer.json"}));
  EXPECT_TRUE(model_files_in_folder("--model", d.path + "/config.json").empty());
}

// strata::train checks what it writes against what it reads, for every caller: a log on the
// corpus, or on a file of the user's, is refused before anything is written.
TEST(Paths, TrainRefusesALogOnItsCorpusOrOnAUsersFile) {
  TempDir d;
  const std::string corpus = d.path + "/corpus.txt", notes = d.path + "/notes.txt";
  const std::string text(4096, 'a');
  write(corpus, text);
  write(notes, "mine");
  const std::string model = d.path + "/config.json";
  const std::string model_text =
      R"({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
          "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256,
          "max_position_embeddings": 64})";
  write(model, model_text);
  TrainOptions o;
  o.model_config = model;
  o.text_file = corpus;
  o.steps = 1;
  o.device = "cpu";
  std::FILE* quiet = std::fopen("/dev/null", "w");
  ASSERT_NE(quiet, nullptr);
  o.console = quiet;
  o.log_json = corpus;
  o.overwrite = true;  // no word of the user's lets a run replace its own input
  EXPECT_NE(error_of([&] {
              train(o);
            }).find("--log-json " + corpus + " is the --text file: the run would replace it"),
            std::string::npos);
  o.log_json = notes;
  o.overwrite = false;
  EXPECT_NE(error_of([&] { train(o); }).find("--log-json " + notes + " exists: pass --overwrite"),
            std::string::npos);
  o.log_json = d.path + "/run.jsonl";
  o.plot_file = d.path + "/run.jsonl";
  EXPECT_NE(error_of([&] { train(o); }).find("--log-json and --plot both name"), std::string::npos);
  o.plot_file.clear();
  o.trace_file = model;  // the model config read
  EXPECT_NE(error_of([&] { train(o); }).find("is the --model-config file"), std::string::npos);
  o.trace_file.clear();
  EXPECT_EQ(slurp(corpus), text);
  EXPECT_EQ(slurp(notes), "mine");
  EXPECT_FALSE(fs::exists(d.path + "/run.jsonl"));
  EXPECT_EQ(slurp(model), model_text);
  // The same run with its own log runs, and writes it.
  EXPECT_EQ(train(o).steps.size(), 1u);
  std::fclose(quiet);
  EXPECT_NE(slurp(d.path + "/run.jsonl").find("\"step\":1"), std::string::npos);
  EXPECT_EQ(slurp(corpus), text);
}

}  // namespace
}  // namespace strata
