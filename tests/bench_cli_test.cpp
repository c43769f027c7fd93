// strata-bench's command line (the binary, end to end): bad input is refused before anything is
// written or measured, with one line naming the flag, and --json's last line is one JSON object
// (the figures, or the error); a measured part that fails exits 1 with its figures still last.
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "strata/adamw.h"
#include "strata/build_info.h"
#include "test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

// Where the output's last line (--json's object) starts.
std::size_t last_line_start(const std::string& out) {
  const std::size_t start = out.rfind('\n', out.find_last_not_of('\n'));
  return start == std::string::npos ? 0 : start + 1;
}

nlohmann::json last_json(const std::string& out) {
  return nlohmann::json::parse(out.substr(last_line_start(out)));
}

// What a run printed before its JSON (the JSON names its reference, whose words the table's
// labels may share).
std::string text_before_json(const std::string& out) { return out.substr(0, last_line_start(out)); }

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// A started run still going when its test ends (an assertion failed first) is ended with `sig`
// and reaped; p = 0 once the test has reaped it itself.
struct Reap {
  pid_t p;
  int sig;
  ~Reap() {
    if (p > 0 && ::kill(p, sig) == 0) ::waitpid(p, nullptr, 0);
  }
};

// A file larger than the drive's free space is refused before a byte is written, and nothing is
// left behind (a failed run used to leave its file, the drive full).
TEST(BenchCli, NvmeRefusesASizeTheDriveCannotHold) {
  TempDir d("strata-bench");
  struct statvfs sv {};
  ASSERT_EQ(::statvfs(d.path.c_str(), &sv), 0);
  const std::uint64_t free_gib = std::uint64_t(sv.f_bavail) * sv.f_frsize >> 30;
  const auto r = testing::run(
      STRATA_BENCH_BIN,
      {"nvme", "--path", d.path, "--size", std::to_string(free_gib + 64) + "G", "--json"}, d.path,
      "big");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(first_line(r.err).find("free, and the benchmark writes a"), std::string::npos) << r.err;
  EXPECT_NE(last_json(r.out).at("error").get<std::string>().find("--path"), std::string::npos)
      << r.out;
  EXPECT_FALSE(fs::exists(d.path + "/strata-bench-nvme.bin"));
}

// strata-bench model says how its bf16 GEMMs run, and measures its bound on the model's own GEMMs
// (every linear layer's forward, dX and dW, the LM head's chunks: Model::gemm_shapes), the faster
// of bf16 and fp32 per shape, weighted by FLOPs: capped to AVX2 (no bf16 matmul in oneDNN there),
// widened to fp32. With checkpointing the recomputed forwards are listed and reported apart.
TEST(BenchCli, ModelNamesItsGemmRouteAndWeighsTheModelsOwnGemms) {
  TempDir d("strata-bench");
  const std::vector<std::string> args{
      "model", "--hidden",          "64",  "--layers", "2",   "--heads", "2",  "--kv-heads",
      "2",     "--intermediate",    "128", "--vocab",  "256", "--seq",   "32", "--steps",
      "1",     "--loss-chunk-rows", "40",  "--json"};
  for (const char* cap : {"", "avx2"}) {
    SCOPED_TRACE(cap);
    const auto r = testing::run(STRATA_BENCH_BIN, args, d.path, "model",
                                {{"STRATA_CPU_ISA", cap}, {"ONEDNN_MAX_CPU_ISA", ""}});
    ASSERT_EQ(r.status, 0) << r.out << r.err;
    const nlohmann::json j = last_json(r.out);
    EXPECT_EQ(j.at("cpu_isa_cap"), *cap ? cap : "auto");
    const double bf16 = j.at("onednn_bf16_gflops"), fp32 = j.at("onednn_fp32_gflops");
    const double ref = j.at("reference_gemm_gflops");
    // The faster per shape is at least as fast as either dtype throughout.
    EXPECT_GE(ref, std::max(bf16, fp32) * 0.999) << j.dump();
    EXPECT_NE(j.at("reference_gemm").get<std::string>().find("on the model's GEMM shapes"),
              std::string::npos);
    EXPECT_NE(j.at("reference_method").get<std::string>().find("before and after the timed steps"),
              std::string::npos)
        << j.dump();
    EXPECT_DOUBLE_EQ(j.at("ratio_vs_matmul").get<double>(), j.at("gflops").get<double>() / ref);
    // A step faster than the GEMMs' own rate means the reference, not the step, is wrong.
    const bool broken = j.at("ratio_vs_matmul").get<double>() > 1.02;
    EXPECT_EQ(j.at("broken_bound").get<bool>(), broken) << j.dump();
    EXPECT_EQ(text_before_json(r.out).find("broken bound") != std::string::npos, broken) << r.out;
    // B=2 x T=32 = 64 rows: LM head chunks of 40 and 24; 4 linears x 3 GEMMs + 2 chunks x 3.
    const auto& shapes = j.at("gemm_shapes");
    EXPECT_EQ(shapes.size(), 18u) << shapes.dump();
    double flops = 0;
    for (const auto& g : shapes) {
      EXPECT_GT(g.at("bf16_gflops").get<double>(), 0) << g;
      flops += 2.0 * g.at("m").get<double>() * g.at("n").get<double>() * g.at("k").get<double>() *
               g.at("count").get<double>();
    }
    // The model's FLOPs are its GEMMs' plus attention's (here 3 x 2 x 2 x L x T^2/2 x qd x B).
    const double attention = 3.0 * 2 * 2 * 2 * 32.0 * 32 / 2 * 64 * 2;
    EXPECT_NEAR(j.at("gflop_per_step").get<double>() * 1e9, flops + attention, 1.0) << j.dump();
    EXPECT_EQ(j.at("recompute_gemm_gflop_per_step"), 0.0);
    if (*cap) {
      EXPECT_EQ(j.at("gemm_route"), "widened to fp32") << j.dump();
      EXPECT_EQ(j.at("onednn_isa"), "avx2") << j.dump();
    } else {
      EXPECT_EQ(j.at("gemm_route"), j.at("onednn_isa").get<std::string>().starts_with("avx512")
                                        ? "oneDNN native"
                                        : "widened to fp32")
          << j.dump();
    }
    EXPECT_NE(r.out.find(std::string("; ") + j.at("gemm_route").get<std::string>() + ")"),
              std::string::npos)
        << r.out;
  }
  std::vector<std::string> ckpt = args;
  ckpt.insert(ckpt.end() - 1, "--checkpoint");
  const auto r = testing::run(STRATA_BENCH_BIN, ckpt, d.path, "model-ckpt");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const nlohmann::json j = last_json(r.out);
  // Each layer's first three linears run again in backward: 3 x 2 x N x in x out x L.
  const double recompute = 2.0 * 64 * (64 * 192 + 64 * 64 + 64 * 256) * 2;  // q|k|v is 3 x 64 wide
  EXPECT_NEAR(j.at("recompute_gemm_gflop_per_step").get<double>() * 1e9, recompute, 1.0)
      << j.dump();
  EXPECT_NE(r.out.find("recomputation adds"), std::string::npos) << r.out;
}

// A --max-bytes the node's memory cannot hold on the emulated device is refused before any
// buffer is made (it used to meet the OOM killer).
TEST(BenchCli, CommRefusesSizesTheMemoryCannotHold) {
  TempDir d("strata-bench");
  const auto r =
      testing::run(STRATA_BENCH_BIN, {"comm", "--device", "cpu", "--max-bytes", "4096G", "--json"},
                   d.path, "comm");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(first_line(r.err).find("--max-bytes 4096G needs about"), std::string::npos) << r.err;
  EXPECT_NE(last_json(r.out).at("error").get<std::string>().find("lower --max-bytes"),
            std::string::npos)
      << r.out;
}

// The engine bench counts, and its --trace shows, work that crosses a step's edge: in the adamw
// regime the early optimizer's AdamW runs on through step()'s return into the next forward, so a
// step starts with one running. Tracing turned on only inside each step lost that AdamW, from the
// trace and from the AdamW's busy time. The adamw-scalar regime's AdamW is its scalar path unless
// --adamw-isa; the adamw regime runs the AdamW strata ships. A regime is met only when bound by the
// resource it stresses.
TEST(BenchCli, EngineCountsTheAdamwRunningWhenAStepStarts) {
  TempDir d("strata-bench");
  const std::string trace = d.path + "/t.json";
  auto r = testing::run(STRATA_BENCH_BIN,
                        {"engine", "--path", d.path, "--regime", "adamw-scalar", "--layers", "4",
                         "--steps", "2", "--trace", trace, "--json"},
                        d.path, "adamw");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const nlohmann::json row = last_json(r.out).at("regimes").at(0);
  EXPECT_EQ(last_json(r.out).at("reference").get<std::string>().rfind("the busiest resource", 0),
            0u)
      << r.out;
  EXPECT_EQ(row.at("adamw_isa"), "scalar") << row;
  EXPECT_NE(row.at("config").get<std::string>().find("AdamW scalar"), std::string::npos) << row;
  // A stand-in, labelled as one in the JSON (a headline regime's `variant` is null).
  if (adamw_selected_isa() == Isa::kScalar) {  // the scalar path is what ships on this CPU
    EXPECT_TRUE(row.at("variant").is_null()) << row;
  } else {
    EXPECT_NE(row.at("variant").get<std::string>().find("stands in"), std::string::npos) << row;
  }
  // The step's edges (the trace's "step" lane), and the optimizer lane's spans cut at them: the
  // worker is at work through both edges but for the microseconds between two units (a few per
  // cent of the time), so one edge at least cuts one (traced only inside the step, none ever
  // started or ended on an edge).
  std::ifstream in(trace);
  const nlohmann::json t = nlohmann::json::parse(in);
  int lane_step = -1, lane_opt = -1;
  for (const auto& e : t.at("traceEvents"))
    if (e.at("ph") == "M") {
      if (e.at("args").at("name") == "step") lane_step = e.at("tid");
      if (e.at("args").at("name") == "optimizer") lane_opt = e.at("tid");
    }
  double start = -1, end = -1;
  for (const auto& e : t.at("traceEvents"))
    if (e.at("ph") == "X" && e.at("tid") == lane_step) {
      start = e.at("ts").get<double>();
      end = start + e.at("dur").get<double>();
    }
  ASSERT_GE(start, 0) << "no step span in the trace";
  int cut = 0;
  for (const auto& e : t.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    const double ts = e.at("ts").get<double>(), te = ts + e.at("dur").get<double>();
    EXPECT_GE(ts, start) << e;
    EXPECT_LE(te, end + 0.002) << e;
    if (e.at("tid") == lane_opt) cut += (ts == start) + (std::abs(te - end) < 1e-4);
  }
  EXPECT_GE(cut, 1) << "no AdamW cut at the step's edges: " << r.out;

  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{"--regime", "adamw"},
        std::vector<std::string>{"--regime", "adamw-scalar", "--adamw-isa", "auto"}}) {
    std::vector<std::string> args{"engine", "--path",  d.path, "--layers",
                                  "2",      "--steps", "1",    "--json"};
    args.insert(args.end(), extra.begin(), extra.end());
    r = testing::run(STRATA_BENCH_BIN, args, d.path, "auto");
    ASSERT_EQ(r.status, 0) << r.out << r.err;
    const nlohmann::json row2 = last_json(r.out).at("regimes").at(0);
    EXPECT_EQ(row2.at("adamw_isa"), isa_name(adamw_selected_isa())) << r.out;
    // The shipped path in both (--adamw-isa auto overrides adamw-scalar's): no stand-in.
    EXPECT_TRUE(row2.at("variant").is_null()) << row2;
    const bool as_meant = row2.at("bottleneck") == row2.at("expected_bottleneck");
    EXPECT_EQ(row2.at("bound_as_meant").get<bool>(), as_meant) << row2;
    EXPECT_EQ(row2.at("met").get<bool>(),
              as_meant && row2.at("ratio_step_vs_busiest").get<double>() <= 1.1)
        << row2;
    EXPECT_EQ(r.out.find("(meant to be") == std::string::npos, as_meant) << r.out;
    // "(> 1.1)" only where the ratio is (not on a row that misses only by its bottleneck)
    EXPECT_EQ(r.out.find("(> 1.1)") == std::string::npos,
              row2.at("ratio_step_vs_busiest").get<double>() <= 1.1)
        << r.out;
  }
  r = testing::run(STRATA_BENCH_BIN, {"engine", "--path", d.path, "--adamw-isa", "avx3"}, d.path,
                   "bad");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(first_line(r.err).find("--adamw-isa 'avx3': use auto, avx512, avx2 or scalar"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("strata-bench engine:"), std::string::npos) << "ran first: " << r.out;
}

// A drive too small for the NVMe regime's swap files is said before any regime runs, in one line
// (the engine refused it only when the regime came, after the others, with its whole plan).
// Needs root to mount a 32 MiB tmpfs; Skipped elsewhere.
TEST(BenchCli, EngineNvmeRegimeTooBigForTheDriveIsRefusedFirst) {
  TempDir d("strata-bench");
  const std::string mnt = d.path + "/small";
  testing::SmallTmpfs small(mnt, 32);
  if (!small.ok) GTEST_SKIP() << small.why;
  const auto r =
      testing::run(STRATA_BENCH_BIN, {"engine", "--path", mnt, "--steps", "1"}, d.path, "small");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(first_line(r.err).find("--path " + mnt +
                                   ": the NVMe regime's swap files need 448 MiB and the drive has "
                                   "32 MiB free"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("strata-bench engine:"), std::string::npos) << "ran first: " << r.out;
  EXPECT_TRUE(fs::is_empty(mnt));
}

// The sizes run from --min-bytes by --factor and end at --max-bytes itself (8 x 4^k never met
// 256M: the largest size asked for was never measured); each bad flag is named on its own.
TEST(BenchCli, CommEndsAtMaxBytesAndNamesEachBadFlag) {
  TempDir d("strata-bench");
  auto r = testing::run(STRATA_BENCH_BIN,
                        {"comm", "--device", "cpu", "--min-bytes", "8", "--max-bytes", "1M",
                         "--ops", "all_reduce", "--iters", "1", "--warmup", "0", "--json"},
                        d.path, "sizes");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const nlohmann::json j = last_json(r.out);
  std::vector<std::uint64_t> sizes;
  for (const auto& row : j.at("results")) sizes.push_back(row.at("size_bytes"));
  EXPECT_EQ(sizes, (std::vector<std::uint64_t>{8, 32, 128, 512, 2048, 8192, 32768, 131072, 524288,
                                               1048576}))
      << r.out;
  const std::pair<std::vector<std::string>, const char*> bad[] = {
      {{"--factor", "1"}, "--factor 1: must be >= 2"},
      {{"--iters", "0"}, "--iters 0: must be >= 1"},
      {{"--warmup", "-1"}, "--warmup -1: must be >= 0"},
      {{"--min-bytes", "2M", "--max-bytes", "1M"},
       "--min-bytes 2M / --max-bytes 1M: need 1 <= --min-bytes <= --max-bytes"}};
  for (const auto& [flags, says] : bad) {
    std::vector<std::string> args{"comm", "--device", "cpu"};
    args.insert(args.end(), flags.begin(), flags.end());
    r = testing::run(STRATA_BENCH_BIN, args, d.path, "bad");
    EXPECT_EQ(r.status, 1) << flags[0];
    EXPECT_NE(first_line(r.err).find(says), std::string::npos) << r.err;
  }
}

// --version before or after a subcommand (after one it was refused as unexpected), naming
// strata's version and whether the CUDA backend is built in.
TEST(BenchCli, VersionIsSaidBeforeOrAfterASubcommand) {
  TempDir d("strata-bench");
  const std::string want = fmt::format("strata-bench {} (CUDA backend {})\n", strata_version(),
                                       built_with_cuda() ? "on" : "off");
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--version"}, {"adam", "--version"}, {"nvme", "--version"}}) {
    const auto r = testing::run(STRATA_BENCH_BIN, args, d.path, "version");
    EXPECT_EQ(r.status, 0) << args[0] << ": " << r.err;
    EXPECT_EQ(r.out, want) << args[0];
  }
}

// Flags a mode would ignore are named, not ignored.
TEST(BenchCli, NvmeFlagsTheModeIgnoresAreRefused) {
  TempDir d("strata-bench");
  auto run = [&](std::vector<std::string> args, const char* tag) {
    args.insert(args.begin(), {"nvme", "--path", d.path, "--size", "8M"});
    return testing::run(STRATA_BENCH_BIN, args, d.path, tag);
  };
  auto r = run({"--sweep", "--block-size", "64K"}, "sweep-bs");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(first_line(r.err).find("--block-size with --sweep"), std::string::npos) << r.err;
  r = run({"--out", d.path + "/aio.json"}, "out");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(first_line(r.err).find("belong to --sweep"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(d.path + "/aio.json"));
  r = run({"--overwrite"}, "overwrite");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(first_line(r.err).find("--overwrite belong to --sweep"), std::string::npos) << r.err;
  r = run({"--sweep", "--sweep-seconds", "0"}, "zero");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(first_line(r.err).find("--sweep-seconds 0"), std::string::npos) << r.err;
  r = run({"--block-size", "3K"}, "bs");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(first_line(r.err).find("--block-size 3K"), std::string::npos) << r.err;
  // A size that is not whole blocks was cut down to them, silently (1.5M ran as 1M).
  r = testing::run(STRATA_BENCH_BIN, {"nvme", "--path", d.path, "--size", "1536K"}, d.path, "part");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(
      first_line(r.err).find(
          "--size 1536K: must be a whole number of --block-size 1M blocks; use 1 MiB or 2 MiB"),
      std::string::npos)
      << r.err;
  r = testing::run(STRATA_BENCH_BIN, {"nvme", "--path", d.path, "--size", "64K"}, d.path, "small");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(first_line(r.err).find(
                "--size 64K: must be a whole number of --block-size 1M blocks; use 1 MiB"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(fs::exists(d.path + "/strata-bench-nvme.bin"));
}

// Each of our runs says how its buffer's pages lie in physical memory (the segments a request
// becomes), beside that run's read, where /proc/self/pagemap shows frame numbers (root); the
// figures are kept per run, and the best is the one reported.
TEST(BenchCli, NvmeReportsItsBuffersPhysicalRuns) {
  TempDir d("strata-bench");
  const auto r = testing::run(
      STRATA_BENCH_BIN,
      {"nvme", "--path", d.path, "--size", "8M", "--buffers", "normal", "--repeat", "2", "--json"},
      d.path, "runs");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto row = last_json(r.out).at("results").at(0);
  // Does /proc/self/pagemap show this process frame numbers (CAP_SYS_ADMIN)? Asked of a page
  // of its own, as the benchmark asks of its buffer.
  static volatile char probe[8192];
  probe[4096] = 1;
  const auto page = reinterpret_cast<std::uintptr_t>(&probe[4096]) / 4096;
  std::uint64_t entry = 0;
  const int fd = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  const bool read_ok = fd >= 0 && ::pread(fd, &entry, 8, off_t(page * 8)) == 8;
  if (fd >= 0) ::close(fd);
  if (!read_ok || (entry & ((std::uint64_t(1) << 55) - 1)) == 0) {
    EXPECT_FALSE(row.contains("buffer_phys_runs")) << row.dump();
    GTEST_SKIP() << "/proc/self/pagemap shows frame numbers to CAP_SYS_ADMIN only";
  }
  const auto pages = row.at("buffer_pages").get<std::size_t>();
  EXPECT_EQ(pages,
            std::size_t(8) << 20 >> 12);  // the buffer is the whole 8 MiB (less than QD x block)
  ASSERT_EQ(row.at("buffer_phys_runs").size(), 2u) << row.dump();
  double best = 0;
  for (int i = 0; i < 2; ++i) {
    const auto runs = row["buffer_phys_runs"][std::size_t(i)].get<std::size_t>();
    EXPECT_GE(runs, 1u);
    EXPECT_LE(runs, pages);
    best = std::max(best, row["read_gbps_each"][std::size_t(i)].get<double>());
  }
  EXPECT_DOUBLE_EQ(best, row.at("read_gbps").get<double>());
  EXPECT_NE(r.out.find("physically contiguous runs and read GB/s of each of our runs"),
            std::string::npos)
      << r.out;
}

// --buffers same: our runs and fio read into the pages of one shared memory (a memfd fio opens
// through our /proc entry: the like-for-like comparison where 4 KiB pages' physical layout
// decides a read's speed); with --vs-fio, fio ran on them (mmapshared) and, for normal
// buffers, fio's own buffer's layout is shown beside each of its reads.
TEST(BenchCli, NvmeSameBuffersAreOneMemorysPagesForBothSides) {
  TempDir d("strata-bench");
  const bool fio = std::system("fio --version >/dev/null 2>&1") == 0;
  // 256M: fio's reads last long enough (~0.1 s) to be looked at.
  std::vector<std::string> args = {"nvme",      "--path", d.path,     "--size", "256M",
                                   "--buffers", "all",    "--repeat", "2",      "--json"};
  if (fio) args.push_back("--vs-fio");
  const auto r = testing::run(STRATA_BENCH_BIN, args, d.path, "same");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto j = last_json(r.out);
  const auto results = j.at("results");
  ASSERT_EQ(results.size(), 3u) << results.dump();
  if (fio) {
    // fio is the bound, named with how it ran; a row faster than it by more than 2% says so.
    EXPECT_EQ(j.at("reference").get<std::string>().rfind("fio: the same job", 0), 0u) << j.dump();
    bool any = false;
    for (const auto& row : results) {
      if (!row.contains("ratio_vs_fio_read")) continue;
      const bool broken = row.at("ratio_vs_fio_read").get<double>() > 1.02 ||
                          row.at("ratio_vs_fio_write").get<double>() > 1.02;
      EXPECT_EQ(row.at("broken_bound").get<bool>(), broken) << row.dump();
      any = any || broken;
    }
    EXPECT_EQ(text_before_json(r.out).find("broken bound") != std::string::npos, any) << r.out;
  } else {
    EXPECT_FALSE(j.contains("reference")) << j.dump();
  }
  const auto& same = results.at(2);
  EXPECT_EQ(same.at("buffers"), "same");
  EXPECT_EQ(same.at("page_kind"), "shmem");
  EXPECT_GT(same.at("read_gbps").get<double>(), 0);
  if (fio) {
    EXPECT_GT(same.at("fio_read_gbps").get<double>(), 0) << same.dump();
    EXPECT_GT(same.at("fio_write_gbps").get<double>(), 0) << same.dump();
  }
  if (!same.contains("buffer_phys_runs"))
    GTEST_SKIP() << "frame numbers are shown to CAP_SYS_ADMIN only";
  // The same pages in every run (our pool's normal pages are new ones each run).
  EXPECT_EQ(same["buffer_phys_runs"][0], same["buffer_phys_runs"][1]) << same.dump();
  const auto& normal = results.at(1);
  ASSERT_EQ(normal.at("buffers"), "normal");
  if (fio) {
    ASSERT_EQ(normal.at("fio_buffer_phys_runs").size(), 2u) << normal.dump();
    std::size_t seen = 0;
    for (const auto& runs :
         normal["fio_buffer_phys_runs"]) {  // of fio's 32 MiB: 8,192 pages (0: not seen)
      EXPECT_LE(runs.get<std::size_t>(), (std::size_t(32) << 20 >> 12) + 64) << normal.dump();
      seen += runs.get<std::size_t>() > 0;
    }
    EXPECT_GE(seen, 1u) << "fio's buffer was never seen: " << normal.dump();
    EXPECT_NE(
        r.out.find("fio's own buffers: physically contiguous runs and read GB/s of each fio run"),
        std::string::npos)
        << r.out;
  }
}

// fio takes its buffers last in, first out: below block x queue depth its reads would land in
// other pages of the shared memory than ours.
TEST(BenchCli, NvmeSameBuffersNeedAWholeQueueOfBlocks) {
  TempDir d("strata-bench");
  const auto r = testing::run(STRATA_BENCH_BIN,
                              {"nvme", "--path", d.path, "--size", "8M", "--buffers", "same"},
                              d.path, "small");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(
      first_line(r.err).find("--buffers same with --size 8M: below block x queue depth (32 MiB)"),
      std::string::npos)
      << r.err;
  EXPECT_NE(first_line(r.err).find("use --size 32 MiB or more"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(d.path + "/strata-bench-nvme.bin"));
}

TEST(BenchCli, NvmeSameBuffersAreOneRingsBuffer) {
  TempDir d("strata-bench");
  const auto r = testing::run(
      STRATA_BENCH_BIN,
      {"nvme", "--path", d.path, "--size", "64M", "--buffers", "same", "--threads", "2"}, d.path,
      "threads");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(first_line(r.err).find(
                "--buffers same with --threads 2: the shared pages are one ring's buffer"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(fs::exists(d.path + "/strata-bench-nvme.bin"));
}

// Ctrl-C or SIGTERM mid-run leaves nothing behind either: the file is removed and vm.nr_hugepages
// put back (where this test may set it: root and a writable /proc/sys), and the process still
// dies of the signal (the shell's 130 / 143). Both used to stay, the file 2 GiB by default.
TEST(BenchCli, NvmeASignalLeavesNothingBehind) {
  const char* const hugepages = "/proc/sys/vm/nr_hugepages";
  int before = -1;
  std::ifstream(hugepages) >> before;
  const bool reserve = before >= 0 && ::geteuid() == 0 && ::access(hugepages, W_OK) == 0;
  for (const int sig : {SIGINT, SIGTERM, SIGHUP}) {  // Ctrl-C, a kill, a closed terminal
    SCOPED_TRACE(sig);
    TempDir d("strata-bench");
    const std::string file = d.path + "/strata-bench-nvme.bin";
    std::vector<std::string> args = {"nvme",     "--path", d.path,      "--size", "256M",
                                     "--repeat", "100",    "--buffers", "all"};
    if (reserve) args.insert(args.end(), {"--reserve-hugepages", std::to_string(before + 2)});
    const pid_t pid = testing::start(STRATA_BENCH_BIN, args, d.path, "run");
    // The file appears after the pages are reserved; then a run of minutes is ahead.
    for (int i = 0; i < 3000 && !fs::exists(file); ++i) ::usleep(10'000);
    EXPECT_TRUE(fs::exists(file)) << testing::slurp(d.path + "/run.stderr");
    ::kill(pid, sig);
    int st = 0;
    ASSERT_EQ(::waitpid(pid, &st, 0), pid);
    EXPECT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == sig)
        << "status " << st << ": " << testing::slurp(d.path + "/run.stderr");
    EXPECT_FALSE(fs::exists(file));
    EXPECT_FALSE(fs::exists(file + ".fio-stderr"));
    if (reserve) {
      int after = -1;
      std::ifstream(hugepages) >> after;
      EXPECT_EQ(after, before) << "vm.nr_hugepages was not restored";
      std::ofstream(hugepages) << before;  // whatever happened
    }
  }
}

// So does the engine bench's NVMe regime: its swap files (~450 MB at the defaults) went with a
// Ctrl-C no more than with an error.
TEST(BenchCli, EngineASignalLeavesNoSwapFiles) {
  TempDir d("strata-bench");
  const fs::path dir = fs::path(d.path) / "strata-bench-engine";
  const pid_t pid = testing::start(
      STRATA_BENCH_BIN, {"engine", "--path", d.path, "--regime", "nvme", "--steps", "100"}, d.path,
      "run");
  Reap reap{pid, SIGKILL};  // an assertion below must not leave it writing into the removed folder
  auto swap_files = [&] {
    std::vector<std::string> files;
    std::error_code ec;
    for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
      if (it->is_regular_file(ec) &&
          it->path().filename().string().find("lock") == std::string::npos)
        files.push_back(it->path().string());
    return files;
  };
  for (int i = 0; i < 3000 && swap_files().empty(); ++i) ::usleep(10'000);
  ASSERT_FALSE(swap_files().empty()) << testing::slurp(d.path + "/run.stderr");
  ::usleep(300'000);  // into the steps
  ::kill(pid, SIGINT);
  int st = 0;
  ASSERT_EQ(::waitpid(pid, &st, 0), pid);
  reap.p = 0;
  EXPECT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGINT)
      << "status " << st << ": " << testing::slurp(d.path + "/run.stderr");
  const auto left = swap_files();
  EXPECT_TRUE(left.empty()) << left.size() << " left, e.g. " << (left.empty() ? "" : left.front());
  // The folders and lock file the signal left are a stopped run's: the next run removes them.
  const auto again = testing::run(STRATA_BENCH_BIN,
                                  {"engine", "--path", d.path, "--regime", "nvme", "--layers", "2",
                                   "--width", "256", "--steps", "1"},
                                  d.path, "again");
  EXPECT_EQ(again.status, 0) << again.out << again.err;
  EXPECT_NE(again.err.find("left by a run that was stopped"), std::string::npos) << again.err;
  EXPECT_FALSE(fs::exists(dir));
}

// The child fio of --vs-fio dies with the run: a SIGTERM to strata-bench alone (a scheduler's
// kill) left fio writing on, and laying the removed file out again.
TEST(BenchCli, NvmeASignalEndsItsFioToo) {
  if (std::system("fio --version >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "no fio (scripts/setup.sh installs it)";
  TempDir d("strata-bench");
  const std::string file = d.path + "/strata-bench-nvme.bin";
  const pid_t pid = testing::start(STRATA_BENCH_BIN,
                                   {"nvme", "--path", d.path, "--size", "1G", "--repeat", "100",
                                    "--vs-fio", "--buffers", "normal"},
                                   d.path, "run");
  Reap reap{pid, SIGTERM};  // an assertion below must not leave it (and its fio) running
  auto fio_child = [&] {    // a process whose parent is the run and whose name is fio
    for (const auto& e : fs::directory_iterator("/proc")) {
      std::ifstream stat(e.path() / "stat");
      std::string pid_s, comm, state;
      pid_t ppid = 0;
      if (stat >> pid_s >> comm >> state >> ppid && comm == "(fio)" && ppid == pid)
        return std::stoi(pid_s);
    }
    return 0;
  };
  // fio starts after our first write and read of the 1 GiB: waited for while the run lives (a
  // slow drive), up to the test's own time.
  int fio = 0, st = 0;
  bool ended = false;
  for (int i = 0; i < 24000 && !fio && !ended; ++i, ::usleep(10'000)) {
    fio = fio_child();
    ended = !fio && ::waitpid(pid, &st, WNOHANG) == pid;
  }
  if (ended) reap.p = 0;
  ASSERT_NE(fio, 0) << (ended ? "the run ended before fio started: " : "fio never started: ")
                    << testing::slurp(d.path + "/run.stderr");
  ::kill(pid, SIGTERM);
  ASSERT_EQ(::waitpid(pid, &st, 0), pid);
  reap.p = 0;
  EXPECT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGTERM) << "status " << st;
  // Killed, not left to finish its job (minutes): gone, or a zombie for init to reap.
  bool gone = false;
  for (int i = 0; i < 500 && !gone; ++i, ::usleep(10'000)) {
    std::ifstream stat("/proc/" + std::to_string(fio) + "/stat");
    std::string pid_s, comm, state;
    gone = !(stat >> pid_s >> comm >> state) || comm != "(fio)" || state == "Z";
  }
  EXPECT_TRUE(gone) << "fio " << fio << " runs on after the benchmark ended";
  EXPECT_FALSE(fs::exists(file)) << "the file is there again";
}

// --sweep --out FILE: a file already there (a user's ds_config.json) is not replaced by the aio
// block without --overwrite, and a folder that is not there is named with the reason, both
// before anything is measured.
TEST(BenchCli, NvmeSweepOutIsCheckedBeforeTheSweep) {
  TempDir d("strata-bench");
  const std::string mine = d.path + "/ds_config.json";
  std::ofstream(mine) << "{\"train_batch_size\": 8}";
  auto run = [&](std::vector<std::string> args, const char* tag) {
    args.insert(args.begin(),
                {"nvme", "--path", d.path, "--size", "8M", "--sweep", "--sweep-seconds", "1"});
    return testing::run(STRATA_BENCH_BIN, args, d.path, tag);
  };
  auto r = run({"--out", mine}, "exists");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(first_line(r.err).find("--out " + mine + " exists: pass --overwrite to replace it"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("strata-bench nvme --sweep"), std::string::npos)
      << "measured first: " << r.out;
  EXPECT_EQ(testing::slurp(mine), "{\"train_batch_size\": 8}");
  const std::string nodir = d.path + "/nodir/aio.json";
  r = run({"--out", nodir}, "nodir");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(first_line(r.err).find("--out " + nodir + ": the folder " + d.path +
                                   "/nodir does not exist: create it first (mkdir -p " + d.path +
                                   "/nodir)"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("strata-bench nvme --sweep"), std::string::npos)
      << "measured first: " << r.out;
  r = run({"--out", mine, "--overwrite"}, "overwrite");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_TRUE(nlohmann::json::parse(testing::slurp(mine)).contains("aio")) << testing::slurp(mine);
  EXPECT_FALSE(fs::exists(d.path + "/strata-bench-nvme.bin"));
}

// More AdamW threads than the process's cores would not be what the rows say (oneTBB keeps its
// pool to the cores): refused, naming the count it may use.
TEST(BenchCli, AdamRefusesMoreThreadsThanCores) {
  TempDir d("strata-bench");
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(::sched_getaffinity(0, sizeof set, &set), 0);
  const int cores = CPU_COUNT(&set);
  const auto r = testing::run(
      STRATA_BENCH_BIN,
      {"adam", "--params", "4096", "--reps", "1", "--threads", "1," + std::to_string(cores + 1)},
      d.path, "adam");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(first_line(r.err).find(
                fmt::format("--threads {}: this process may run on {} core", cores + 1, cores)),
            std::string::npos)
      << r.err;
  // Without --threads, on one core: the default (1,2) keeps to what can run, not an error about
  // a flag never given. (Children inherit the affinity.)
  cpu_set_t one;
  CPU_ZERO(&one);
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) {
      CPU_SET(c, &one);
      break;
    }
  ASSERT_EQ(::sched_setaffinity(0, sizeof one, &one), 0);
  const auto dflt = testing::run(
      STRATA_BENCH_BIN, {"adam", "--params", "4096", "--reps", "1", "--json"}, d.path, "one");
  ::sched_setaffinity(0, sizeof set, &set);
  EXPECT_EQ(dflt.status, 0) << dflt.out << dflt.err;
  // 64 KiB of state sits in any last-level cache: said, in the table and the JSON (the step beat
  // its "memory bound" there, which was a cache speed and the threads' creation).
  const nlohmann::json j = last_json(dflt.out);
  EXPECT_EQ(j.at("cache_resident"), true) << dflt.out;
  EXPECT_NE(dflt.out.find("fit in the "), std::string::npos) << dflt.out;
}

// Below the address-space floor a benchmark is refused before it runs (its subcommand's work ran
// inside the command line's parsing, and the refusal came after the table).
TEST(BenchCli, AnAddressSpaceLimitBelowTheFloorIsRefusedBeforeTheRun) {
#ifdef __SANITIZE_ADDRESS__
  GTEST_SKIP() << "AddressSanitizer's shadow memory needs terabytes of address space";
#endif
  TempDir d("strata-bench");
  const auto r = testing::run("/bin/sh",
                              {"-c", std::string("ulimit -v 900000; exec ") + STRATA_BENCH_BIN +
                                         " adam --params 4096 --reps 1 --threads 1"},
                              d.path, "floor");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_EQ(r.out, "") << "the benchmark ran";
  EXPECT_NE(first_line(r.err).find("the process's address-space limit (`ulimit -v`) is 878 MiB, "
                                   "and strata needs at least 1024 MiB"),
            std::string::npos)
      << r.err;
}

// The memory bound's loops run the instructions the AdamW kernels run (the same run-time ISA,
// STRATA_CPU_ISA included), and a row faster than the bound says "broken bound" (in the table and
// the JSON) rather than showing a ratio above 1 as speed. The DeepSpeed-style comparison loop
// follows the same ISA and is checked against AdamW before it is timed.
TEST(BenchCli, AdamBoundLoopsRunTheKernelsIsaAndABrokenBoundIsSaid) {
  TempDir d("strata-bench");
  std::vector<std::pair<std::string, std::string>> caps = {{"", ""}};
  if (isa_supported(Isa::kAvx2)) caps.push_back({"STRATA_CPU_ISA", "avx2"});
  caps.push_back({"STRATA_CPU_ISA", "scalar"});
  for (const auto& cap : caps) {
    std::vector<std::pair<std::string, std::string>> env;
    if (!cap.first.empty()) env.push_back(cap);
    const auto r = testing::run(
        STRATA_BENCH_BIN, {"adam", "--params", "2k", "--reps", "1", "--threads", "1", "--json"},
        d.path, "isa-" + cap.second, env);
    ASSERT_EQ(r.status, 0) << r.out << r.err;
    const nlohmann::json j = last_json(r.out);
    EXPECT_EQ(j.at("bound_isa"), j.at("isa")) << r.out;
    if (!cap.first.empty()) {
      EXPECT_EQ(j.at("isa"), cap.second) << r.out;
    } else {  // the path this process's AdamW takes here
      EXPECT_EQ(j.at("isa"), isa_name(adamw_selected_isa())) << r.out;
    }
    for (const auto& row : j.at("results")) {  // 2k parameters: a copy the caches keep
      EXPECT_EQ(row.at("copy_out_stores"), row.at("copy_out") == "none" ? "none" : "plain") << row;
    }
    EXPECT_NE(j.at("bound").get<std::string>().find("write-allocate"), std::string::npos) << r.out;
    // No two arrays one loop streams together start at the same offset past a 2 MiB boundary (at
    // one offset they would lie multiples of 2 MiB apart, a slow layout on some hosts): read from
    // their addresses.
    const nlohmann::json& offsets = j.at("array_offsets_kib");
    for (const auto& group : std::vector<std::vector<std::string>>{
             {"p", "m", "v", "g", "m16", "v16", "g16", "c16"}, {"triad_a", "triad_b", "triad_c"}}) {
      std::set<std::size_t> seen;
      for (const std::string& name : group) seen.insert(offsets.at(name).get<std::size_t>());
      EXPECT_EQ(seen.size(), group.size()) << offsets;
    }
    for (const auto& row : j.at("results")) {
      const double ratio = row.at("ratio_vs_bound");
      EXPECT_EQ(row.at("broken_bound").get<bool>(), ratio > 1.02) << row;
      EXPECT_GE(row.at("bound_gbps").get<double>(), row.at("triad_nt_gbps").get<double>()) << row;
    }
    // The DeepSpeed-style loop: named as strata's rendering, held to AdamW in double at every
    // width up to the kernels' before it is timed, and timed on the fp32/fp32/no-copy rows only,
    // its bytes one more probe of the bound.
    EXPECT_NE(j.at("ds_style_reference").get<std::string>().find("strata's rendering"),
              std::string::npos)
        << r.out;
    EXPECT_NE(j.at("ds_style_method").get<std::string>().find("alternating"), std::string::npos)
        << r.out;
    EXPECT_EQ(j.at("ds_style_isa"), j.at("isa")) << r.out;
    const nlohmann::json& check = j.at("ds_style_check");
    EXPECT_LE(check.at("worst_of_tolerance").get<double>(), 1.0) << r.out;
    EXPECT_EQ(check.at("isas").back(), j.at("isa")) << r.out;
    EXPECT_EQ(check.at("isas").front(), "scalar") << r.out;
    int ds_rows = 0;
    for (const auto& row : j.at("results")) {
      const bool fp32_no_copy =
          row.at("grads") == "fp32" && row.at("states") == "fp32" && row.at("copy_out") == "none";
      EXPECT_EQ(row.contains("ds_style_gparams_per_s"), fp32_no_copy) << row;
      EXPECT_EQ(row.contains("ratio_vs_ds_style"), fp32_no_copy) << row;
      if (!fp32_no_copy) continue;
      ++ds_rows;
      EXPECT_NEAR(
          row.at("ratio_vs_ds_style").get<double>(),
          row.at("gparams_per_s").get<double>() / row.at("ds_style_gparams_per_s").get<double>(),
          1e-9)
          << row;
      EXPECT_GE(row.at("bound_gbps").get<double>(), row.at("ds_style_gbps").get<double>()) << row;
    }
    EXPECT_EQ(ds_rows, 1) << r.out;
    EXPECT_NE(r.out.find("ds-style"), std::string::npos) << r.out;
    const bool any_broken = r.out.find("\"broken_bound\": true") != std::string::npos ||
                            r.out.find("\"broken_bound\":true") != std::string::npos;
    EXPECT_EQ(any_broken, text_before_json(r.out).find("broken bound:") != std::string::npos)
        << r.out;
  }
}

// Where the step streams its bf16 copy-out (AVX-512, 2^19 parameters and more), the same-pattern
// probe writes it with non-temporal stores too, in the same pass (plain stores read every line
// first: a probe of other traffic than the step's). The row says which stores its pass took, and
// the bench checks the copy the pass wrote (exit 1 naming the element where it is wrong).
TEST(BenchCli, AdamSamePatternLoopWritesTheCopyOutAsTheStepDoes) {
  TempDir d("strata-bench");
  const std::size_t n = 600'000;
  const auto r = testing::run(
      STRATA_BENCH_BIN,
      {"adam", "--params", std::to_string(n), "--reps", "1", "--threads", "1", "--json"}, d.path,
      "nt");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const bool streams = adamw_streams_copy_out(Isa::kAuto, n);
  EXPECT_EQ(streams, adamw_selected_isa() == Isa::kAvx512);
  EXPECT_FALSE(adamw_streams_copy_out(Isa::kAvx512, (std::size_t(1) << 19) - 1));
  EXPECT_NE(text_before_json(r.out).find(streams ? "copy-out stores (non-temporal)"
                                                 : "copy-out stores (plain)"),
            std::string::npos)
      << r.out;
  int copy_rows = 0;
  const nlohmann::json j = last_json(r.out);
  for (const auto& row : j.at("results")) {
    if (row.at("copy_out") == "none") {
      EXPECT_EQ(row.at("copy_out_stores"), "none") << row;
      continue;
    }
    ++copy_rows;
    EXPECT_EQ(row.at("copy_out_stores"), streams ? "non_temporal" : "plain") << row;
  }
  EXPECT_EQ(copy_rows, 4) << r.out;
}

// A typo in --parts is an error wherever it runs (without a GPU it was SKIPPED, exit 0).
TEST(BenchCli, GpuPartsAreCheckedBeforeTheGpuIsLookedFor) {
  TempDir d("strata-bench");
  const auto r =
      testing::run(STRATA_BENCH_BIN, {"gpu", "--parts", "link,gemmm", "--json"}, d.path, "gpu");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(first_line(r.err).find(
                "--parts: 'gemmm' is not one of link, gemm, adamw, kernels, model, parity"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("SKIPPED"), std::string::npos) << r.out;
  EXPECT_NE(last_json(r.out).at("error").get<std::string>().find("gemmm"), std::string::npos)
      << r.out;
}

// So are the model part's values: a shape strata-train would refuse, or a vocabulary past u16
// tokens, is exit 1 naming the flag (it passed until the GPU run, after the other parts).
TEST(BenchCli, GpuModelFlagsAreCheckedBeforeTheGpuIsLookedFor) {
  TempDir d("strata-bench");
  auto r = testing::run(STRATA_BENCH_BIN, {"gpu", "--vocab", "70000", "--json"}, d.path, "vocab");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(first_line(r.err).find("--vocab 70000 must be in 1..65536"), std::string::npos)
      << r.err;
  EXPECT_EQ(r.out.find("SKIPPED"), std::string::npos) << r.out;
  r = testing::run(STRATA_BENCH_BIN, {"gpu", "--hidden", "770"}, d.path, "hidden");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(first_line(r.err).find("hidden size 770 is not a multiple of 12 heads"),
            std::string::npos)
      << r.err;
  EXPECT_NE(first_line(r.err).find("hidden_size is --hidden"), std::string::npos) << r.err;
  r = testing::run(STRATA_BENCH_BIN, {"gpu", "--batch", "0"}, d.path, "batch");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("--batch: must be > 0, got 0"), std::string::npos) << r.err;
}

// A --path the NVMe regime cannot make its folder in (/sys: no one may) is named with the reason
// before any regime runs, not a raw "filesystem error".
TEST(BenchCli, EnginePathThatCannotBeWrittenIsNamed) {
  TempDir d("strata-bench");
  const auto r = testing::run(STRATA_BENCH_BIN, {"engine", "--path", "/sys", "--regime", "nvme"},
                              d.path, "engine");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(first_line(r.err).find(
                "--path /sys: cannot create the NVMe regime's folder /sys/strata-bench-engine "
                "there: "),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("filesystem error"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("strata-bench engine:"), std::string::npos) << "ran first: " << r.out;
}

// Nothing of the user's is removed or replaced: a file or folder of the benchmarks' own names
// already in --path (nvme and engine removed them, with what they held), an existing --trace
// file (engine, model: replaced after the run), the gpu bench's files in --out. Each refused
// before anything runs, naming the fix, and left as it was.
TEST(BenchCli, WhatIsThereAlreadyIsNotRemovedNorReplaced) {
  TempDir d("strata-bench");
  const auto keep = [&](const std::string& path) {
    std::ofstream(path) << "mine";
    return path;
  };
  const auto intact = [](const std::string& path) {
    std::ifstream f(path);
    std::string s;
    f >> s;
    return s == "mine";
  };
  const std::string bin = keep(d.path + "/strata-bench-nvme.bin");
  auto r = testing::run(STRATA_BENCH_BIN, {"nvme", "--path", d.path, "--size", "8M", "--json"},
                        d.path, "nvme");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(first_line(r.err).find(
                "strata-bench-nvme.bin already exists and the benchmark would replace and then "
                "remove it"),
            std::string::npos)
      << r.err;
  EXPECT_TRUE(intact(bin));
  // A huge-page reservation another run holds (this test, holding its lock): refused before
  // vm.nr_hugepages is set, and before the benchmark's file is made. (The lock file this test's
  // own, STRATA_TEST_HUGEPAGES_LOCK: tests run side by side.)
  const std::string hp_lock = d.path + "/hugepages.lock";
  if (const int held = ::open(hp_lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644); held >= 0) {
    ASSERT_EQ(::flock(held, LOCK_EX | LOCK_NB), 0);
    const std::string before = testing::slurp("/proc/sys/vm/nr_hugepages");
    r = testing::run(STRATA_BENCH_BIN,
                     {"nvme", "--path", d.path, "--size", "8M", "--reserve-hugepages", "4"}, d.path,
                     "hp", {{"STRATA_TEST_HUGEPAGES_LOCK", hp_lock}});
    ::close(held);
    EXPECT_EQ(r.status, 1) << r.out << r.err;
    EXPECT_NE(first_line(r.err).find("--reserve-hugepages 4: another strata-bench run on this host "
                                     "holds a huge-page reservation"),
              std::string::npos)
        << r.err;
    EXPECT_EQ(testing::slurp("/proc/sys/vm/nr_hugepages"), before);
  }
  fs::create_directories(d.path + "/e/strata-bench-engine");
  const std::string notes = keep(d.path + "/e/strata-bench-engine/notes.txt");
  r = testing::run(STRATA_BENCH_BIN, {"engine", "--path", d.path + "/e", "--regime", "nvme"},
                   d.path, "engine");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(first_line(r.err).find(
                "strata-bench-engine already exists and the NVMe regime removes its folder"),
            std::string::npos)
      << r.err;
  EXPECT_TRUE(intact(notes));
  const std::string trace = keep(d.path + "/trace.json");
  for (const std::vector<std::string>& cmd :
       {std::vector<std::string>{"engine", "--regime", "link"},
        std::vector<std::string>{"model", "--layers", "1"}}) {
    std::vector<std::string> v = cmd;
    v.insert(v.end(), {"--trace", trace});
    r = testing::run(STRATA_BENCH_BIN, v, d.path, "trace");
    EXPECT_EQ(r.status, 1) << cmd[0] << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find("--trace " + trace + " exists: pass --overwrite"), std::string::npos)
        << r.err;
    EXPECT_TRUE(intact(trace)) << cmd[0];
  }
  fs::create_directories(d.path + "/g");
  const std::string model_cfg = keep(d.path + "/g/model-config.json");
  r = testing::run(STRATA_BENCH_BIN, {"gpu", "--out", d.path + "/g"}, d.path, "gpu");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(first_line(r.err).find("model-config.json is there and the bench writes its own"),
            std::string::npos)
      << r.err;
  EXPECT_TRUE(intact(model_cfg));
  // Parts that write nothing into --out do not mind what is there (here: no GPU, SKIPPED).
  r = testing::run(STRATA_BENCH_BIN, {"gpu", "--parts", "link", "--out", d.path + "/g"}, d.path,
                   "gpu-link");
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_TRUE(intact(model_cfg));
}

// Values that were accepted and then ignored or misread: sizes past any memory (1e30 read as
// "less than one block"), a negative --reserve-hugepages, an empty --parts ("ok", nothing
// run), --probe with --rehearse, a --link-gib under one chunk, --out naming a file, an
// --params the memory cannot hold (the OOM killer's), all refused naming the flag.
TEST(BenchCli, ValuesThatWereMisreadAreRefused) {
  TempDir d("strata-bench");
  std::ofstream(d.path + "/afile") << "x";
  for (const auto& [args, says] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"nvme", "--path", d.path, "--size", "1e30"},
            "--size '1e30' is more bytes than any drive or memory holds"},
           {{"comm", "--max-bytes", "1e30"},
            "--max-bytes '1e30' is more bytes than any drive or memory holds"},
           {{"nvme", "--path", d.path, "--reserve-hugepages", "-5"}, "--reserve-hugepages"},
           {{"nvme", "--path", d.path, "--reserve-hugepages", "1000000"},
            "more in huge pages, and"},
           {{"gpu", "--parts", ""}, "--parts is empty"},
           {{"gpu", "--link-gib", "0.1"}, "--link-gib 0.1: at least 0.25"},
           {{"gpu", "--out", d.path + "/afile"},
            "--out " + d.path + "/afile is a file: give a folder"},
           {{"adam", "--params", "100000000000"},
            "--params 100000000000: the benchmark needs about"},
           // The model's shape named as the flags given (it named config.json keys), and a negative
           // chunk no longer taken as 0.
           {{"nvme", "--path", d.path + "/afile", "--size", "8M"},
            "--path '" + d.path + "/afile' is a file, not a folder"},
           {{"nvme", "--path", d.path + "/nope", "--size", "8M"},
            "--path '" + d.path + "/nope' is not there: create"},
           {{"adam", "--params", "-3k"}, "--params: '-3k' is not a count"},
           {{"model", "--seq", "0"}, "--seq: must be > 0, got 0"},
           {{"model", "--layers", "0"}, "--layers: must be > 0, got 0"},
           {{"model", "--loss-chunk-rows", "-5"}, "--loss-chunk-rows: must be >= 0, got -5"},
           // Sizes in the flags' words (std::bad_alloc, a config key's name, an allocation of 0
           // bytes after an overflow), and a --doc-len no row holds.
           {{"model", "--seq", "100000000000"},
            "--seq 100000000000 is more positions than strata runs (at most 16777216)"},
           {{"model", "--batch", "4611686018427387904"},
            "--batch 4611686018427387904 x --seq 256 is 1.18e+21 tokens, more than a micro-batch "
            "holds"},
           {{"model", "--doc-len", "100", "--seq", "16"}, "--doc-len 100 is longer than --seq 16"},
           // gpu's sizes before the GPU is looked for (a --seq of 1e9 wrote a 9.4 GB token file
           // under --rehearse; --adamw-mparams 1e30 said "must be > 0").
           {{"gpu", "--adamw-mparams", "1e30"},
            "--adamw-mparams 1e+30 is outside 0.000064 (64 parameters) to 100000"},
           {{"gpu", "--adamw-mparams", "0.00001"}, "--adamw-mparams 1e-05 is outside"},
           {{"gpu", "--rehearse", "--parts", "model", "--seq", "1000000", "--batch", "1000",
             "--out", d.path + "/gpu-out"},
            "--batch 1000 x --seq 1000000 is 1e+09 tokens, more than the model part's micro-batch "
            "takes"}}) {
    const auto r = testing::run(STRATA_BENCH_BIN, args, d.path, "bad");
    EXPECT_EQ(r.status, 1) << says << "\n" << r.out << r.err;
    EXPECT_NE(r.err.find(says), std::string::npos) << r.err;
    EXPECT_EQ(r.out.find("SKIPPED"), std::string::npos) << r.out;
  }
  EXPECT_FALSE(fs::exists(d.path + "/strata-bench-nvme.bin"));
  EXPECT_FALSE(fs::exists(d.path + "/gpu-out"));
  // adam --params takes the form its help gives its default in (100M was "not a number").
  const auto adam = testing::run(
      STRATA_BENCH_BIN, {"adam", "--params", "2k", "--reps", "1", "--threads", "1", "--json"},
      d.path, "adam-2k");
  EXPECT_EQ(adam.status, 0) << adam.err;
  EXPECT_NE(adam.out.find("\"params\":2000,"), std::string::npos) << adam.out;
  // --probe with --rehearse checks the flags and looks for no GPU (gpu-check.sh's pre-check of
  // its --bench-args adds --probe).
  const auto r = testing::run(STRATA_BENCH_BIN,
                              {"gpu", "--probe", "--rehearse", "--hidden", "64", "--heads", "4"},
                              d.path, "probe");
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("REHEARSAL: flags accepted"), std::string::npos) << r.out;
}

// On a file system that keeps no block count (ramfs) the space check has nothing to go by, but
// a user's strata-bench-nvme.bin there is still not replaced (it was: the check came after).
TEST(BenchCli, NvmeOnRamfsKeepsAUsersFile) {
  TempDir d("strata-bench");
  const std::string mnt = d.path + "/ram";
  fs::create_directories(mnt);
  if (::geteuid() != 0 ||
      std::system(("mount -t ramfs ramfs " + mnt + " 2>/dev/null").c_str()) != 0)
    GTEST_SKIP() << "cannot mount a ramfs here (root and CAP_SYS_ADMIN needed)";
  std::ofstream(mnt + "/strata-bench-nvme.bin") << "mine";
  const auto r =
      testing::run(STRATA_BENCH_BIN, {"nvme", "--path", mnt, "--size", "8M"}, d.path, "ramfs");
  std::string kept;
  std::ifstream(mnt + "/strata-bench-nvme.bin") >> kept;
  std::system(("umount " + mnt).c_str());
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("strata-bench-nvme.bin already exists"), std::string::npos) << r.err;
  EXPECT_EQ(kept, "mine");
}

// One rank moves nothing between ranks: every collective's bus bandwidth is 0 (broadcast's was
// the local copy's, 2661 GB/s).
TEST(BenchCli, CommOnOneRankHasNoBusBandwidth) {
  TempDir d("strata-bench");
  const auto r = testing::run(
      STRATA_BENCH_BIN, {"comm", "--device", "cpu", "--max-bytes", "64K", "--iters", "2", "--json"},
      d.path, "comm");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto j = last_json(r.out);
  int rows = 0;
  for (const auto& row : j.at("results")) {
    EXPECT_EQ(row.at("busbw_gbps").get<double>(), 0.0) << row.dump();
    ++rows;
  }
  EXPECT_GT(rows, 0) << j.dump();
  EXPECT_EQ(j.at("reference").get<std::string>().rfind("one-thread memcpy", 0), 0u) << j.dump();
}

// A bad value CLI11 catches still gets --json's error object, last.
TEST(BenchCli, ACommandLineErrorIsAJsonObjectWithJson) {
  TempDir d("strata-bench");
  const auto r =
      testing::run(STRATA_BENCH_BIN, {"nvme", "--queue-depth", "0", "--json"}, d.path, "qd");
  EXPECT_EQ(r.status, 1);
  const auto j = last_json(r.out);
  EXPECT_NE(j.at("error").get<std::string>().find("--queue-depth"), std::string::npos) << r.out;
  EXPECT_EQ(j.at("kind"), "invalid argument");
  // A first word that is no subcommand is named, with the ones there are.
  const auto bogus = testing::run(STRATA_BENCH_BIN, {"bogus", "--json"}, d.path, "bogus");
  EXPECT_EQ(bogus.status, 1);
  EXPECT_EQ(last_json(bogus.out).at("error"),
            "'bogus' is not a subcommand: give one of nvme, adam, comm, model, tp, engine, gpu, "
            "tokenize");
  // A count of parameters of 13 digits is a count (refused for the memory it needs, not read).
  const auto big =
      testing::run(STRATA_BENCH_BIN, {"adam", "--params", "1000000000000"}, d.path, "big");
  EXPECT_EQ(big.status, 1);
  EXPECT_NE(big.err.find("--params 1000000000000: the benchmark needs about"), std::string::npos)
      << big.err;
}

// strata-bench gpu's ratios against a bound measured in the same run (the AdamW against a device
// copy of as many bytes) say "broken bound" above 1.02, in the table and the JSON; a rehearsal's
// GEMM, its own reference, never does. On the CPU-emulated device at 1M parameters the AdamW's
// bytes fit in the cache that the copy's do not always: either answer can come, both are checked.
TEST(BenchCli, GpuRatiosAboveTheirBoundSayBrokenBound) {
  TempDir d("strata-bench");
  const auto r = testing::run(STRATA_BENCH_BIN,
                              {"gpu", "--rehearse", "--parts", "adamw,gemm", "--adamw-mparams", "1",
                               "--out", d.path + "/gpu", "--json"},
                              d.path, "gpu");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto j = last_json(r.out);
  const auto& adamw = j.at("adamw");
  const bool broken = adamw.at("ratio_vs_copy").get<double>() > 1.02;
  EXPECT_EQ(adamw.at("broken_bound").get<bool>(), broken) << adamw;
  const std::size_t line = r.out.find("AdamW (");
  ASSERT_NE(line, std::string::npos) << r.out;
  const std::string adamw_line = r.out.substr(line, r.out.find('\n', line) - line);
  EXPECT_EQ(adamw_line.find("broken bound") != std::string::npos, broken) << adamw_line;
  for (const auto& shape : j.at("gemm").at("shapes"))
    EXPECT_FALSE(shape.at("broken_bound")) << shape;
  // Each part names its reference (the rehearsal says what stands in for cuBLASLt).
  EXPECT_EQ(adamw.at("reference").get<std::string>().rfind("a device-to-device copy", 0), 0u);
  EXPECT_EQ(j.at("gemm").at("reference").get<std::string>().rfind("rehearsal: ", 0), 0u);
}

// A part that fails is a measured result: exit 1, and the figures (with the part "failed") are
// the last JSON object, not an error object after them. (Here the AdamW part's 1000M parameters
// do not fit the rehearsal's 4 GiB emulated device.)
TEST(BenchCli, AFailedGpuPartKeepsTheFiguresLast) {
  TempDir d("strata-bench");
  const auto r = testing::run(STRATA_BENCH_BIN,
                              {"gpu", "--rehearse", "--parts", "adamw", "--adamw-mparams", "1000",
                               "--out", d.path + "/gpu", "--json"},
                              d.path, "gpu");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  const auto j = last_json(r.out);
  EXPECT_EQ(j.at("command"), "gpu") << r.out;
  EXPECT_EQ(j.at("parts").at("adamw"), "failed") << r.out;
  EXPECT_FALSE(j.at("ok").get<bool>());
}

// strata-bench tokenize on a byte-level tokenizer.json with every byte and no merges (each byte
// one token): the figures are there, strata's scaling has one entry per thread count, and the
// Rust reference is either measured with the same token counts or null with its reason. A
// --text that cannot be read is named.
TEST(BenchCli, TokenizeReportsPerThreadRateAndTheReferenceOrWhyNot) {
  TempDir d("strata-bench");
  nlohmann::json vocab = nlohmann::json::object();
  // GPT-2's byte -> character map: printable Latin-1 stands for itself, the rest from U+0100.
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const int cp = printable ? b : next++;
    std::string ch;
    if (cp < 0x80) {
      ch.push_back(static_cast<char>(cp));
    } else {
      ch.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      ch.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    vocab[ch] = b;
  }
  const nlohmann::json tj = {
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}},
      {"pre_tokenizer",
       {{"type", "ByteLevel"},
        {"add_prefix_space", false},
        {"trim_offsets", true},
        {"use_regex", true}}},
      {"decoder",
       {{"type", "ByteLevel"},
        {"add_prefix_space", false},
        {"trim_offsets", true},
        {"use_regex", true}}}};
  std::ofstream(d.path + "/tokenizer.json") << tj.dump();
  const auto r = testing::run(STRATA_BENCH_BIN,
                              {"tokenize", "--tokenizer", d.path, "--text-mb", "0.05", "--threads",
                               "2", "--reps", "1", "--json"},
                              d.path, "tokenize");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto j = last_json(r.out);
  EXPECT_GT(j.at("strata_mb_per_s").get<double>(), 0.0);
  EXPECT_EQ(j.at("threads"), 2);
  EXPECT_GE(j.at("text_mb").get<double>(), 0.05);
  // Each byte is a token.
  EXPECT_EQ(j.at("tokens").get<double>(), std::round(j.at("text_mb").get<double>() * 1e6));
  const auto& scaling = j.at("scaling_mb_per_s_by_threads");
  ASSERT_EQ(scaling.size(), 2u) << j.dump();
  EXPECT_GT(scaling.at("1").get<double>(), 0.0);
  EXPECT_GT(scaling.at("2").get<double>(), 0.0);
  EXPECT_FALSE(j.at("cpu").get<std::string>().empty());
  EXPECT_EQ(j.at("reference").get<std::string>().rfind("Hugging Face's Rust tokenizers", 0), 0u);
  if (j.at("hf_rust_mb_per_s").is_null()) {
    // Only an absent reference is null (a failing one exits 1, above).
    EXPECT_TRUE(j.at("ratio_vs_hf_rust").is_null());
    EXPECT_FALSE(j.at("hf_rust_note").get<std::string>().empty());
  } else {
    EXPECT_TRUE(j.at("token_counts_equal").get<bool>()) << j.dump();
    EXPECT_EQ(j.at("hf_rust_tokens"), j.at("tokens"));
    EXPECT_NEAR(j.at("ratio_vs_hf_rust").get<double>(),
                j.at("strata_mb_per_s").get<double>() / j.at("hf_rust_mb_per_s").get<double>(),
                1e-9);
  }
  // A reference that is there but cannot read its tokenizer.json is a failed measurement: exit 1,
  // the figures last with the reason (without node or the binding: null and exit 0, as above).
  std::ofstream(d.path + "/broken.json") << "{}";
  const auto broken =
      testing::run(STRATA_BENCH_BIN,
                   {"tokenize", "--tokenizer", d.path, "--text-mb", "0.01", "--threads", "1",
                    "--reps", "1", "--reference-json", d.path + "/broken.json", "--json"},
                   d.path, "tokenize-broken");
  const auto jb = last_json(broken.out);
  EXPECT_TRUE(jb.at("hf_rust_mb_per_s").is_null()) << broken.out;
  if (j.at("hf_rust_mb_per_s").is_null()) {
    EXPECT_EQ(broken.status, 0) << broken.out << broken.err;
  } else {
    EXPECT_EQ(broken.status, 1) << broken.out << broken.err;
    EXPECT_NE(jb.at("hf_rust_note").get<std::string>().find("the reference failed"),
              std::string::npos)
        << broken.out;
  }
  const auto bad = testing::run(STRATA_BENCH_BIN,
                                {"tokenize", "--tokenizer", d.path, "--text", d.path + "/nope.txt"},
                                d.path, "tokenize-bad");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.err.find("cannot read --text"), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace strata
