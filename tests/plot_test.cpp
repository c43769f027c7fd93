// The picture of a run (strata/run_plot.h), strata-plot (STRATA_PLOT_BIN) and strata-train --plot
// (STRATA_TRAIN_BIN):
//   - the SVG is well-formed enough for a browser (every tag closed, in order), holds its five
//     panels, a marker at each evaluated step and none elsewhere, gaps for missing values, words
//     for all-zero series, a log axis for a huge range, and stays small for 200k steps;
//   - a --log-json file read back: a cut-short last line is left out, any other bad line is an
//     error naming the file and line; empty, missing and non-log files are refused;
//   - strata-plot and strata-train --plot end to end (the picture redrawn after each step: a run
//     killed at step 2 left step 1's picture; the resumed run draws every step);
//   - Chromium, headless, renders the SVG to a PNG that shows the lines and the text (counted by
//     tests/oracle/png_stats.py); SKIPPED where chromium or python3 is not installed.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/utf8.h"
#include "strata/error.h"
#include "strata/run_plot.h"
#include "test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using testing::Result;
using testing::run;
using testing::slurp;
using testing::TempDir;

constexpr double kNaN = RunRecord::kNone;

// `n` steps of a plausible run: loss falling, lr warming up, val loss every 5th step, H2D and
// D2H traffic, no NVMe.
std::vector<RunRecord> sample_run(int n) {
  std::vector<RunRecord> v;
  for (int i = 1; i <= n; ++i) {
    RunRecord r;
    r.step = i;
    r.loss = 5.5 * std::exp(-0.05 * i) + 1.2;
    r.val_loss = i % 5 == 0 ? r.loss + 0.1 : kNaN;
    r.lr = 1e-3 * std::min(1.0, i / 10.0);
    r.grad_norm = 2.0 / std::sqrt(double(i));
    r.tokens_per_s = 12000 + 300 * std::sin(i);
    r.h2d_bytes = 48.0 * (1 << 20);
    r.d2h_bytes = 24.0 * (1 << 20);
    r.nvme_read_bytes = 0;
    r.nvme_written_bytes = 0;
    v.push_back(r);
  }
  return v;
}

// Every element closed, in order (<x .../> closes itself); comments and the declaration skipped.
// "" when well-formed, else what is wrong.
std::string tag_balance(const std::string& svg) {
  std::vector<std::string> open;
  std::size_t at = 0;
  int roots = 0;
  while ((at = svg.find('<', at)) != std::string::npos) {
    const std::size_t end = svg.find('>', at);
    if (end == std::string::npos) return "a '<' without '>' at " + std::to_string(at);
    const std::string tag = svg.substr(at + 1, end - at - 1);
    at = end + 1;
    if (tag.starts_with("?") || tag.starts_with("!")) continue;
    if (tag.find('<') != std::string::npos) return "'<' inside a tag: " + tag;
    if (tag.starts_with("/")) {
      const std::string name = tag.substr(1);
      if (open.empty() || open.back() != name)
        return "</" + name + "> closes " + (open.empty() ? std::string("nothing") : open.back());
      open.pop_back();
      continue;
    }
    const std::string name = tag.substr(0, tag.find_first_of(" \t\n/"));
    if (open.empty()) ++roots;
    if (!tag.ends_with("/")) open.push_back(name);
  }
  if (!open.empty()) return "<" + open.back() + "> is never closed";
  if (roots != 1) return std::to_string(roots) + " root elements";
  return "";
}

std::size_t count(const std::string& s, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

// The d="..." of the path drawn in `color` (the first), "" when there is none.
// (Searched by hand: std::regex recurses once a character, and a path is thousands long.)
std::string path_of(const std::string& svg, const std::string& color) {
  const std::string open = "<path d=\"", tail = "\" fill=\"none\" stroke=\"" + color + "\"";
  for (std::size_t at = svg.find(open); at != std::string::npos; at = svg.find(open, at + 1)) {
    const std::size_t begin = at + open.size(), end = svg.find('"', begin);
    if (end != std::string::npos && svg.compare(end, tail.size(), tail) == 0)
      return svg.substr(begin, end - begin);
  }
  return "";
}

TEST(PlotSvg, HoldsEveryPanelAndAMarkerAtEachEvaluation) {
  const std::string svg = run_plot_svg(sample_run(40), "a <test> & run");
  EXPECT_EQ(tag_balance(svg), "");
  EXPECT_TRUE(svg.starts_with("<?xml")) << svg.substr(0, 80);
  for (const char* panel : {">loss<", ">learning rate<", ">gradient norm<",
                            ">throughput (tokens/s)<", ">bytes moved per step<"})
    EXPECT_NE(svg.find(panel), std::string::npos) << panel;
  EXPECT_NE(svg.find("a &lt;test&gt; &amp; run"), std::string::npos);
  EXPECT_EQ(count(svg, "class=\"val\""), 8u);  // steps 5, 10, ..., 40
  // Bytes in binary units on the axis; no NVMe traffic is said, not drawn.
  EXPECT_NE(svg.find(" MiB<"), std::string::npos);
  EXPECT_NE(svg.find("NVMe read: none"), std::string::npos);
  EXPECT_NE(svg.find("NVMe written: none"), std::string::npos);
  EXPECT_EQ(path_of(svg, "#2ca02c").find('M'), 0u);  // the lr (same colour as NVMe read) drawn
  // Self-contained: nothing is loaded from elsewhere.
  for (const char* outside : {"href", "<script", "<style", "@import", "url("})
    EXPECT_EQ(svg.find(outside), std::string::npos) << outside;
  EXPECT_EQ(count(svg, "http"), 1u);  // the xmlns name only
}

TEST(PlotSvg, NoValLossSaysSoAndDrawsNoMarker) {
  auto steps = sample_run(12);
  for (auto& r : steps) r.val_loss = kNaN;
  const std::string svg = run_plot_svg(steps, "t");
  EXPECT_EQ(tag_balance(svg), "");
  EXPECT_EQ(count(svg, "class=\"val\""), 0u);
  EXPECT_NE(svg.find("val loss: none logged"), std::string::npos);
}

TEST(PlotSvg, OneStepIsDrawn) {
  const std::string svg = run_plot_svg(sample_run(1), "t");
  EXPECT_EQ(tag_balance(svg), "");
  EXPECT_NE(svg.find("1 step logged, steps 1 to 1"), std::string::npos);
  // A lone value is a dot, in each of the five panels' colours.
  EXPECT_NE(svg.find("<circle cx=\"510.0\""), std::string::npos) << svg;
  EXPECT_EQ(svg.find("nan"), std::string::npos);
  EXPECT_EQ(svg.find("inf"), std::string::npos);
}

TEST(PlotSvg, MissingAndNonFiniteValuesAreGaps) {
  auto steps = sample_run(20);
  steps[9].grad_norm = kNaN;  // a skipped step's norm
  steps[9].skipped = true;
  steps[14].grad_norm = INFINITY;
  steps[3].tokens_per_s = -INFINITY;
  const std::string svg = run_plot_svg(steps, "t");
  EXPECT_EQ(tag_balance(svg), "");
  const std::string norm = path_of(svg, "#9467bd");
  EXPECT_EQ(count(norm, "M"), 3u) << norm;  // three runs: 1-9, 11-14, 16-20
  EXPECT_EQ(count(norm, "L"), 8u + 3u + 4u) << norm;
  EXPECT_NE(svg.find("skipped step (1)"), std::string::npos);
  EXPECT_NE(svg.find("1 skipped"), std::string::npos);
  EXPECT_EQ(svg.find("nan"), std::string::npos);
  EXPECT_EQ(svg.find("inf"), std::string::npos);
}

TEST(PlotSvg, ZeroAndAbsentSeriesAreSaidInWords) {
  auto steps = sample_run(6);
  for (auto& r : steps) {
    r.h2d_bytes = r.d2h_bytes = 0;
    r.lr = 0;
    r.tokens_per_s = kNaN;
  }
  const std::string svg = run_plot_svg(steps, "t");
  EXPECT_EQ(tag_balance(svg), "");
  EXPECT_NE(svg.find("no bytes moved between these tiers at any step"), std::string::npos);
  EXPECT_NE(svg.find("host to device: none"), std::string::npos);
  EXPECT_NE(svg.find("lr: 0 at every step"), std::string::npos);
  EXPECT_NE(svg.find("tokens/s: not in the log"), std::string::npos);
  EXPECT_EQ(path_of(svg, "#2ca02c"), "");  // no lr line on a made-up axis
}

TEST(PlotSvg, HugeRangesStayOnTheAxis) {
  auto steps = sample_run(30);
  steps[20].grad_norm = 3e7;  // a blow-up: a log axis, every value still on it
  steps[5].loss = 1e300;
  steps[6].loss = -1e300;
  const std::string svg = run_plot_svg(steps, "t");
  EXPECT_EQ(tag_balance(svg), "");
  EXPECT_NE(svg.find("log scale"), std::string::npos);
  EXPECT_NE(svg.find(">1e7<"), std::string::npos);
  for (const std::string color : {"#9467bd", "#1f77b4"}) {
    const std::string d = path_of(svg, color);
    ASSERT_FALSE(d.empty()) << color;
    std::regex pt("([-0-9.]+),([-0-9.]+)");
    for (auto it = std::sregex_iterator(d.begin(), d.end(), pt); it != std::sregex_iterator();
         ++it) {
      const double x = std::stod((*it)[1]), y = std::stod((*it)[2]);
      EXPECT_GE(x, 84 - 0.1);
      EXPECT_LE(x, 936 + 0.1);
      EXPECT_TRUE(std::isfinite(y)) << d;
    }
  }
}

TEST(PlotSvg, ValuesAndStepsBeyondADoublesWholeNumbers) {
  std::vector<RunRecord> steps(3);
  for (int i = 0; i < 3; ++i) {
    steps[i].step = 4000000000000000000 + i;  // t + 1 == t in a double
    steps[i].loss = 1e17 + 16 * i;
    steps[i].lr = 1e-3;
  }
  const std::string svg = run_plot_svg(steps, "t");
  EXPECT_EQ(tag_balance(svg), "");
  EXPECT_LT(svg.size(), 64u << 10);
  // Each step at its own place, the axis labelled with whole steps, and none a NaN: near 2^63 a
  // double holds no two neighbouring steps (their axis had no width: x="-nan").
  EXPECT_NE(svg.find(">4000000000000000000</text>"), std::string::npos) << svg;
  EXPECT_NE(svg.find(">4000000000000000001</text>"), std::string::npos) << svg;
  EXPECT_NE(svg.find(">4000000000000000002</text>"), std::string::npos) << svg;
  EXPECT_EQ(svg.find("nan"), std::string::npos);
  for (int n : {1, 2}) {
    std::vector<RunRecord> last(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) {
      last[std::size_t(i)].step = INT64_MAX - (n - 1) + i;
      last[std::size_t(i)].loss = 1.0 - 0.1 * i;
    }
    const std::string edge = run_plot_svg(last, "t");
    EXPECT_EQ(tag_balance(edge), "");
    EXPECT_EQ(edge.find("nan"), std::string::npos) << n << " step(s)";
    EXPECT_NE(edge.find(">9223372036854775807</text>"), std::string::npos) << edge;
  }
}

TEST(PlotSvg, ManyStepsCostThePlotsWidthNotTheirNumber) {
  auto steps = sample_run(200000);
  steps[123456].grad_norm = 50;  // one spike among 200k steps stays drawn
  const std::string svg = run_plot_svg(steps, "t");
  EXPECT_EQ(tag_balance(svg), "");
  EXPECT_LT(svg.size(), 300u << 10) << "the picture grows with the steps";
  const std::string norm = path_of(svg, "#9467bd");
  double top = 1e9;
  std::regex pt("[ML]([-0-9.]+),([-0-9.]+)");
  for (auto it = std::sregex_iterator(norm.begin(), norm.end(), pt); it != std::sregex_iterator();
       ++it)
    top = std::min(top, std::stod((*it)[2]));
  // The spike is the panel's highest value: its point is at the plot's top (log axis: 1e2's line
  // is the top, 50 just under it).
  EXPECT_LT(top, 64 + 2 * 196 + 30 + 20) << "the spike was dropped";
}

TEST(PlotSvg, NoStepYet) {
  const std::string svg = run_plot_svg({}, "t");
  EXPECT_EQ(tag_balance(svg), "");
  EXPECT_NE(svg.find("no step logged yet"), std::string::npos);
}

// ---- the log read back ----

std::string write(const TempDir& d, const std::string& name, const std::string& text) {
  const std::string p = d.path + "/" + name;
  std::ofstream(p, std::ios::binary) << text;
  return p;
}

std::string line(int step, double loss) {
  return nlohmann::json{
             {"step", step}, {"loss", loss}, {"lr", 1e-3}, {"grad_norm", 1.0}, {"h2d_bytes", 100}}
             .dump() +
         "\n";
}

std::string error_of(const std::string& path) {
  try {
    read_run_log(path);
  } catch (const Error& e) {
    return e.user_message();
  }
  return "(no error)";
}

TEST(RunLog, ACutShortLastLineIsLeftOut) {
  TempDir d;
  const std::string p = write(d, "run.jsonl", line(1, 3) + line(2, 2.5) + "{\"step\": 3, \"lo");
  const auto steps = read_run_log(p);
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[1].step, 2);
  EXPECT_EQ(steps[1].loss, 2.5);
  EXPECT_TRUE(std::isnan(steps[1].val_loss));
  EXPECT_TRUE(std::isnan(steps[1].nvme_read_bytes));
  // A complete last line without its newline yet is a step.
  const std::string q = write(d, "b.jsonl", line(1, 3) + "{\"step\": 2, \"loss\": null}");
  const auto b = read_run_log(q);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_TRUE(std::isnan(b[1].loss));
}

TEST(RunLog, ABadLineElsewhereNamesFileAndLine) {
  TempDir d;
  const std::string mid = write(d, "mid.jsonl", line(1, 3) + "{\"step\": 2, \"lo\n" + line(3, 2));
  EXPECT_NE(error_of(mid).find(mid + ":2: not JSON"), std::string::npos) << error_of(mid);
  // The last line, complete (its newline written) but not JSON: not a line being written.
  const std::string last = write(d, "last.jsonl", line(1, 3) + "garbage\n");
  EXPECT_NE(error_of(last).find(last + ":2:"), std::string::npos) << error_of(last);
  const std::string nostep = write(d, "nostep.jsonl", line(1, 3) + "{\"loss\": 2}\n");
  EXPECT_NE(error_of(nostep).find(nostep + ":2: not a step of strata-train --log-json (a JSON "
                                           "object without \"step\")"),
            std::string::npos)
      << error_of(nostep);
  const std::string frac = write(d, "frac.jsonl", "{\"step\": 1.5}\n");
  EXPECT_NE(error_of(frac).find("not a whole number"), std::string::npos) << error_of(frac);
  // Drawn as step -1 and as no loss, silently, before.
  const std::string huge = write(d, "huge.jsonl", "{\"step\": 18446744073709551615}\n");
  EXPECT_NE(error_of(huge).find(huge + ":1: not a step of strata-train --log-json (\"step\" is "
                                       "18446744073709551615, not a step number"),
            std::string::npos)
      << error_of(huge);
  const std::string word =
      write(d, "word.jsonl", line(1, 3) + "{\"step\": 2, \"loss\": \"abc\"}\n");
  EXPECT_NE(error_of(word).find(word + ":2: not a step of strata-train --log-json (\"loss\" is "
                                       "\"abc\", not a number)"),
            std::string::npos)
      << error_of(word);
}

TEST(RunLog, EmptyMissingAndOtherFilesAreRefusedWithTheFix) {
  TempDir d;
  const std::string empty = write(d, "empty.jsonl", "");
  EXPECT_NE(error_of(empty).find("holds no step yet (it is empty)"), std::string::npos)
      << error_of(empty);
  EXPECT_NE(error_of(empty).find("--log-json"), std::string::npos);
  const std::string missing = d.path + "/none.jsonl";
  EXPECT_NE(error_of(missing).find(missing + " cannot be read: No such file or directory: give "
                                             "the file strata-train --log-json FILE writes"),
            std::string::npos)
      << error_of(missing);
  const std::string torn = write(d, "torn.jsonl", "{\"step\": 1, \"lo");
  EXPECT_NE(error_of(torn).find("holds no complete step: its only line"), std::string::npos)
      << error_of(torn);
  const std::string cfg =
      write(d, "ds_config.json", "{\n  \"zero_optimization\": {\"stage\": 3}\n}\n");
  EXPECT_NE(error_of(cfg).find(cfg + ":1: not JSON"), std::string::npos) << error_of(cfg);
  const std::string array = write(d, "a.json", "[1, 2]\n");
  EXPECT_NE(error_of(array).find("a JSON array where a step's object"), std::string::npos)
      << error_of(array);
  EXPECT_NE(error_of(d.path).find("is a folder"), std::string::npos) << error_of(d.path);
}

TEST(RunLog, StepsInOrderTheLaterLineWinning) {
  TempDir d;
  const std::string p = write(d, "r.jsonl", line(2, 2) + line(1, 3) + "\n" + line(2, 1.5));
  const auto steps = read_run_log(p);
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0].step, 1);
  EXPECT_EQ(steps[1].loss, 1.5);
}

TEST(RunPlotFile, WrittenWholeOrNotAtAll) {
  TempDir d;
  const std::string p = d.path + "/run.svg";
  write_run_plot(p, "<svg/>");
  EXPECT_EQ(slurp(p), "<svg/>");
  write_run_plot(p, "<svg></svg>");
  EXPECT_EQ(slurp(p), "<svg></svg>");
  std::size_t files = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(d.path)) ++files;
  EXPECT_EQ(files, 1u) << "a temporary file was left";
  // A name of 249 bytes: its temporary file's name fits too (".tmp-<pid>-" before the whole name
  // passed the file system's 255).
  const std::string long_name = d.path + "/" + std::string(245, 'p') + ".svg";
  write_run_plot(long_name, "<svg/>");
  EXPECT_EQ(slurp(long_name), "<svg/>");
  try {
    write_run_plot(d.path + "/no/such/run.svg", "<svg/>");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kIo);
    EXPECT_NE(e.user_message().find(d.path + "/no/such/run.svg cannot be written"),
              std::string::npos)
        << e.user_message();
  }
}

// A device or a pipe is written into, never replaced: a picture renamed over the path put a
// regular file in place of /dev/null (as root, for every program on the machine). A FIFO here,
// refused while no one reads it; a character device, where one can be made.
TEST(RunPlotFile, ADeviceOrAPipeIsWrittenIntoNotReplaced) {
  TempDir d;
  const std::string fifo = d.path + "/pipe";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  // No reader: the picture is refused at once (strata-train's --plot waited there for ever).
  try {
    write_run_plot(fifo, "<svg/>");
    ADD_FAILURE() << "written with no reader";
  } catch (const Error& e) {
    EXPECT_NE(e.user_message().find(fifo + " cannot be written: a pipe no one reads"),
              std::string::npos)
        << e.user_message();
  }
  const int rd = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  ASSERT_GE(rd, 0);
  write_run_plot(fifo, "<svg>piped</svg>");
  char buf[64] = {};
  EXPECT_EQ(::read(rd, buf, sizeof buf), 16);
  EXPECT_EQ(std::string(buf), "<svg>piped</svg>");
  ::close(rd);
  EXPECT_TRUE(fs::is_fifo(fifo)) << "replaced by a file";
  std::size_t files = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(d.path)) ++files;
  EXPECT_EQ(files, 1u) << "a temporary file was left";
  const std::string null = d.path + "/null";
  if (::mknod(null.c_str(), S_IFCHR | 0666, ::makedev(1, 3)) != 0)
    GTEST_SKIP() << "cannot make a character device here: " << std::strerror(errno);
  write_run_plot(null, "<svg/>");
  EXPECT_TRUE(fs::is_character_file(null)) << "/dev/null's twin replaced by a file";
}

// ---- strata-plot ----

TEST(PlotCli, DrawsALogAndRefusesWhatItCannot) {
  TempDir d;
  Result r = run(STRATA_PLOT_BIN, {"--help"}, d.path, "help");
  EXPECT_EQ(r.status, 0);
  EXPECT_NE(r.out.find("--log-json"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("--overwrite"), std::string::npos) << r.out;
  const std::string log = write(d, "run.jsonl", line(1, 3) + line(2, 2) + "{\"st");
  const std::string svg = d.path + "/run.svg";
  r = run(STRATA_PLOT_BIN, {log, "-o", svg}, d.path, "ok");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("2 steps (1 to 2) drawn"), std::string::npos) << r.out;
  EXPECT_EQ(tag_balance(slurp(svg)), "");
  EXPECT_NE(slurp(svg).find("strata-train run: run.jsonl"), std::string::npos);
  r = run(STRATA_PLOT_BIN, {log, "-o", svg}, d.path, "exists");
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.err, "strata-plot: invalid argument: -o " + svg +
                       " exists: pass --overwrite to replace it\n");
  r = run(STRATA_PLOT_BIN, {log, "-o", svg, "--overwrite", "--title", "mine"}, d.path, "again");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(slurp(svg).find(">mine<"), std::string::npos);
  // A title that is no UTF-8 (Latin-1's é): U+FFFD in its place, so the file stays XML (it was
  // written as given, and a browser showed an XML error instead of the picture).
  r = run(STRATA_PLOT_BIN, {log, "-o", svg, "--overwrite", "--title", "caf\xE9 run"}, d.path,
          "latin1");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(slurp(svg).find(">caf\xEF\xBF\xBD run<"), std::string::npos);
  EXPECT_EQ(utf8::first_invalid(slurp(svg)), std::string::npos);
  r = run(STRATA_PLOT_BIN, {d.path + "/none.jsonl", "-o", svg}, d.path, "missing");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("strata-plot: I/O error: " + d.path + "/none.jsonl cannot be read"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(count(r.err, "\n"), 1u) << r.err;
  r = run(STRATA_PLOT_BIN, {log, "-o", log, "--overwrite"}, d.path, "self");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("is the log itself"), std::string::npos) << r.err;
  r = run(STRATA_PLOT_BIN, {log}, d.path, "no-out");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("--out is required"), std::string::npos) << r.err;
}

// ---- strata-train --plot ----

class PlotTrain : public ::testing::Test {
 protected:
  void SetUp() override {
    cfg = dir.path + "/model.json";
    std::ofstream(cfg) << R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 32,
      "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
      "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": false})";
    text = dir.path + "/corpus.txt";
    std::ofstream t(text);
    for (int i = 0; i < 2000; ++i) t << "alpha beta gamma delta. ";
  }
  std::vector<std::string> args(std::vector<std::string> extra) const {
    std::vector<std::string> a = {"--model-config", cfg, "--text", text,   "--seq-len", "16",
                                  "--steps",        "4", "--lr",   "1e-2", "--device",  "cpu",
                                  "--eval-every",   "2"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  }
  TempDir dir;
  std::string cfg, text;
};

TEST_F(PlotTrain, DrawsEveryStepAndGoesOnAfterAResume) {
  const std::string svg = dir.path + "/run.svg", log = dir.path + "/run.jsonl",
                    ck = dir.path + "/ck";
  // Killed at step 2 (after its checkpoint, before its log line): step 1's picture is there.
  Result r =
      run(STRATA_TRAIN_BIN,
          args({"--plot", svg, "--log-json", log, "--save-every", "1", "--checkpoint-dir", ck}),
          dir.path, "killed", {{"STRATA_TEST_CRASH_AFTER_CHECKPOINT", "2"}});
  ASSERT_NE(r.status, 0) << r.out;
  std::string pic = slurp(svg);
  EXPECT_EQ(tag_balance(pic), "");
  EXPECT_NE(pic.find("1 step logged, steps 1 to 1"), std::string::npos) << pic.substr(0, 600);
  // Resumed: the log's kept steps and the new ones, the evaluations at 2 and 4 marked.
  r = run(STRATA_TRAIN_BIN, args({"--plot", svg, "--log-json", log, "--resume", ck}), dir.path,
          "resumed");
  ASSERT_EQ(r.status, 0) << r.err;
  pic = slurp(svg);
  EXPECT_EQ(tag_balance(pic), "");
  EXPECT_NE(pic.find("4 steps logged, steps 1 to 4"), std::string::npos) << pic.substr(0, 600);
  EXPECT_EQ(count(pic, "class=\"val\""), 2u);
  EXPECT_NE(pic.find("strata-train: llama"), std::string::npos);
  // Without --log-json too; the picture and the log say the same steps.
  const std::string alone = dir.path + "/alone.svg";
  r = run(STRATA_TRAIN_BIN, args({"--plot", alone}), dir.path, "alone");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(slurp(alone).find("4 steps logged, steps 1 to 4"), std::string::npos);
}

TEST_F(PlotTrain, BadPlotPathsAreRefusedBeforeTheFirstStep) {
  auto refused = [&](std::vector<std::string> extra, const std::string& tag) {
    const Result r = run(STRATA_TRAIN_BIN, args(extra), dir.path, tag);
    EXPECT_EQ(r.status, 1) << tag;
    EXPECT_EQ(r.out.find("step 1"), std::string::npos) << tag << ": a step ran\n" << r.out;
    return r.err;
  };
  EXPECT_NE(refused({"--plot", dir.path}, "folder").find("--plot " + dir.path + " is a folder"),
            std::string::npos);
  EXPECT_NE(refused({"--plot", dir.path + "/no/run.svg"}, "nofolder")
                .find("the folder " + dir.path + "/no does not exist: create it first (mkdir -p " +
                      dir.path + "/no)"),
            std::string::npos);
  // ... and --log-json's (it was said only once the data and the device were ready).
  EXPECT_NE(refused({"--log-json", dir.path + "/no/log.jsonl"}, "nolog")
                .find("--log-json " + dir.path + "/no/log.jsonl: the folder " + dir.path +
                      "/no does not exist"),
            std::string::npos);
  EXPECT_NE(refused({"--plot", dir.path + "/same", "--log-json", dir.path + "/./same"}, "same")
                .find("--log-json and --plot both name"),
            std::string::npos);
  EXPECT_NE(refused({"--plot", dir.path + "/p.svg", "--plan"}, "plan").find("--plan runs none"),
            std::string::npos);
  if (::geteuid() != 0) {  // root writes anywhere
    const std::string ro = dir.path + "/ro";
    fs::create_directory(ro);
    ::chmod(ro.c_str(), 0555);
    EXPECT_NE(refused({"--plot", ro + "/run.svg"}, "ro").find("cannot be written in"),
              std::string::npos);
  }
}

// ---- in a browser ----

// The first of `names` on PATH, "" when none is.
std::string on_path(std::initializer_list<const char*> names) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  std::vector<std::string> folders;
  for (std::string d; std::getline(dirs, d, ':');) folders.push_back(d);
  for (const char* n : names)
    for (const auto& d : folders)
      if (::access((d + "/" + n).c_str(), X_OK) == 0) return d + "/" + n;
  return "";
}

TEST(PlotBrowser, ChromiumShowsTheLinesAndTheText) {
  const std::string chromium = on_path({"chromium", "chromium-browser", "google-chrome"});
  if (chromium.empty()) GTEST_SKIP() << "chromium is not installed (scripts/setup.sh installs it)";
  const std::string python = on_path({"python3"});
  if (python.empty()) GTEST_SKIP() << "python3 is not installed (the PNG oracle needs it)";
  TempDir d;
  auto steps = sample_run(60);
  steps[30].nvme_read_bytes = 3.0 * (1 << 30);
  steps[31].nvme_written_bytes = 1.5 * (1 << 30);
  const std::string svg = d.path + "/run.svg", png = d.path + "/run.png";
  write_run_plot(svg, run_plot_svg(steps, "strata-train run in Chromium"));
  const Result shot = run(chromium,
                          {"--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars",
                           "--user-data-dir=" + d.path + "/profile", "--screenshot=" + png,
                           "--window-size=960,1052", "file://" + svg},
                          d.path, "chromium");
  ASSERT_EQ(shot.status, 0) << shot.err;
  ASSERT_TRUE(fs::exists(png)) << shot.err;
  // The loss's blue, the val loss's orange, the lr's green, the norm's purple, tokens/s' cyan.
  const Result stats =
      run(python, {STRATA_PNG_ORACLE, png, "1f77b4", "ff7f0e", "2ca02c", "9467bd", "17becf"},
          d.path, "oracle");
  ASSERT_EQ(stats.status, 0) << stats.err;
  const auto j = nlohmann::json::parse(stats.out);
  EXPECT_EQ(j.at("width"), 960);
  const double pixels = j.at("width").get<double>() * j.at("height").get<double>();
  EXPECT_GT(j.at("non_white").get<double>(), 0.02 * pixels) << j;
  EXPECT_GT(j.at("colors").get<int>(), 50) << j;
  for (const auto& [color, n] : j.at("hits").items())
    EXPECT_GT(n.get<int>(), 100) << "no line in #" << color << " was drawn: " << j;
  // Titles, legends and tick labels: dark anti-aliased glyphs, thousands of pixels of them.
  EXPECT_GT(j.at("dark").get<int>(), 5000) << "no text was drawn (fonts?): " << j;
}

}  // namespace
}  // namespace strata
