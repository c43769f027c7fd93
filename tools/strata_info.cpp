// strata-info: what this build contains and what this machine offers it — versions, CPU,
// NUMA, huge pages, io_uring, devices, pinned memory — and, with --self-check, a short
// correctness check of every usable device against a CPU reference.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "strata/build_info.h"
#include "strata/device.h"
#include "strata/error.h"
#include "strata/pinned_pool.h"
#include "strata/system_info.h"
#include "tool_main.h"

namespace strata {
namespace {

using nlohmann::json;

std::string gib(std::size_t bytes) {
  return fmt::format("{:.2f} GiB", double(bytes) / double(1ull << 30));
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

json report_build() {
  const CudaProbe cuda = probe_cuda();
  std::printf("strata %s (CUDA backend %s)\n", strata_version().c_str(),
              cuda.compiled ? "on" : "off");
  json components = json::object();
  std::printf("components:\n");
  for (const auto& c : component_versions()) {
    std::printf("  %-12s %s\n", c.name.c_str(), c.version.c_str());
    components[c.name] = c.version;
  }
  // Where the CUDA libraries and the CUDA module came from (found on this machine at run time).
  json libraries = json::object();
  const auto loaded = gpu::cuda_libraries();
  if (!loaded.empty()) std::printf("cuda libraries:\n");
  for (const auto& l : loaded) {
    std::printf("  %-18s %s\n", l.name.c_str(), l.path.c_str());
    libraries[l.name] = l.path;
  }
  return {{"version", strata_version()},
          {"cuda_compiled", cuda.compiled},
          {"components", components},
          {"cuda_libraries", libraries}};
}

json report_cpu() {
  const std::string model = cpu::cpu_model();
  const auto isa = cpu::cpu_isa_features();
  std::printf("cpu: %s\n  isa: %s\n", model.c_str(),
              isa.empty() ? "(none of interest)" : join(isa, " ").c_str());
  // The paths taken (STRATA_CPU_ISA caps them all) and how each GEMM dtype runs.
  const cpu::CpuPaths paths = cpu::cpu_paths();
  std::printf("  paths: AdamW %s, model kernels %s, oneDNN %s (%s)\n", paths.adamw.c_str(),
              paths.model.c_str(), paths.onednn.c_str(),
              paths.cap == "auto" ? "the widest this CPU has"
                                  : ("capped by STRATA_CPU_ISA=" + paths.cap).c_str());
  json gemms = json::object();
  for (const auto& g : paths.gemms) {
    std::printf("  gemm %s: %s (%s)\n", g.dtype.c_str(), g.route.c_str(), g.impl.c_str());
    gemms[g.dtype] = {{"route", g.route}, {"impl", g.impl}};
  }
  json nodes = json::array();
  std::printf("numa:\n");
  for (const auto& n : cpu::numa_nodes()) {
    std::printf("  node %d: %s, %d cores, cpus %s\n", n.os_index, gib(n.memory_bytes).c_str(),
                n.cores, n.cpuset.c_str());
    nodes.push_back({{"os_index", n.os_index},
                     {"memory_bytes", n.memory_bytes},
                     {"cores", n.cores},
                     {"cpuset", n.cpuset}});
  }
  const cpu::HugePageInfo h = cpu::huge_page_info();
  std::printf(
      "huge pages: hugetlbfs %zu of %zu pages of %zu KiB free, transparent huge pages '%s'\n",
      h.hugetlb_free, h.hugetlb_total, h.hugetlb_page_bytes / 1024, h.thp_mode.c_str());
  // What libgomp loaded with (the tools set PASSIVE when it is unset: see device.h).
  const char* wait = std::getenv("OMP_WAIT_POLICY");
  std::printf("openmp: OMP_WAIT_POLICY=%s\n", wait ? wait : "(unset: libgomp spins)");
  return {{"cpu_model", model},
          {"omp_wait_policy", wait ? wait : ""},
          {"isa_features", isa},
          {"isa_cap", paths.cap},
          {"adamw_isa", paths.adamw},
          {"model_kernels_isa", paths.model},
          {"onednn_isa", paths.onednn},
          {"gemm", gemms},
          {"numa_nodes", nodes},
          {"huge_pages",
           {{"hugetlb_page_bytes", h.hugetlb_page_bytes},
            {"hugetlb_total", h.hugetlb_total},
            {"hugetlb_free", h.hugetlb_free},
            {"thp_mode", h.thp_mode}}}};
}

json report_io() {
  const nvme::UringProbe u = nvme::probe_io_uring();
  if (u.available)
    std::printf("io_uring: available (liburing %s)\n", u.version.c_str());
  else
    std::printf("io_uring: unavailable: %s (liburing %s); NVMe I/O uses the thread-pool fallback\n",
                u.reason.c_str(), u.version.c_str());
  return {{"available", u.available}, {"reason", u.reason}, {"liburing_version", u.version}};
}

json report_devices() {
  const CudaProbe cuda = probe_cuda();
  json gpus = json::array();
  std::printf("devices:\n");
  for (const auto& d : gpu::device_descriptions()) {
    std::printf("  %s\n", d.c_str());
    gpus.push_back(d);
  }
  if (cuda.device_count == 0) std::printf("  no usable GPU: %s\n", cuda.reason.c_str());
  std::printf("  cpu: the CPU-emulated device (always available)\n");
  return {{"cuda_device_count", cuda.device_count},
          {"cuda_reason", cuda.reason},
          {"cuda_devices", gpus},
          {"cpu_emulated", true}};
}

json report_pinned() {
  constexpr std::size_t kBytes = std::size_t(64) << 20;
  PinnedPoolOptions o;
  o.budget_bytes = kBytes;
  PinnedPool pool(o);
  PinnedBlock b = pool.allocate(kBytes);
  std::memset(b.data(), 0, b.size());
  const PinnedPoolStats s = pool.stats();
  std::printf("pinned memory: 64 MiB with %s pages, %s\n", page_kind_name(b.page_kind()),
              b.pinned() ? "page-locked" : "NOT page-locked (pageable fallback)");
  return {{"bytes", kBytes},
          {"page_kind", page_kind_name(b.page_kind())},
          {"locked", b.pinned()},
          {"reserved_bytes", s.reserved_bytes}};
}

// One device: a host->device->host round trip of random bytes through pinned staging, an
// fp32 matmul and a sum of squares against double-precision CPU references.
json self_check(const std::string& which) {
  auto dev = make_device(which);
  PinnedPoolOptions po;
  po.budget_bytes = std::size_t(16) << 20;
  po.device = dev.get();
  PinnedPool pool(po);
  auto stream = dev->create_stream("self-check");
  std::mt19937_64 rng(20240611);

  // Round trip of an odd number of random bytes.
  const std::size_t n_bytes = (std::size_t(3) << 20) + 13;
  PinnedBlock src = pool.allocate(n_bytes), dst = pool.allocate(n_bytes);
  auto* s = static_cast<unsigned char*>(src.data());
  for (std::size_t i = 0; i < n_bytes; ++i) s[i] = static_cast<unsigned char>(rng());
  std::memset(dst.data(), 0, n_bytes);
  Buffer d_bytes = dev->alloc(n_bytes, stream.get());
  stream->copy(d_bytes.ref(), host_ref(src.data(), n_bytes));
  stream->copy(host_ref(dst.data(), n_bytes), d_bytes.ref());
  stream->synchronize();
  const bool copy_ok = std::memcmp(src.data(), dst.data(), n_bytes) == 0;

  // C[64x48] = A[64x80] * B[80x48].
  constexpr int m = 64, n = 48, k = 80;
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> a(m * k), b(k * n), c(m * n, 0.0f);
  for (auto& x : a) x = u(rng);
  for (auto& x : b) x = u(rng);
  Buffer da = dev->alloc(a.size() * 4, stream.get()), db = dev->alloc(b.size() * 4, stream.get()),
         dc = dev->alloc(c.size() * 4, stream.get());
  stream->copy(da.ref(), host_ref(a.data(), a.size() * 4));
  stream->copy(db.ref(), host_ref(b.data(), b.size() * 4));
  MatmulDesc md;
  md.m = m;
  md.n = n;
  md.k = k;
  md.a = tensor(da, DType::kF32);
  md.b = tensor(db, DType::kF32);
  md.c = tensor(dc, DType::kF32);
  stream->matmul(md);
  stream->copy(host_ref(c.data(), c.size() * 4), dc.ref());

  // sum(x^2) over an odd count.
  constexpr std::size_t nx = 1237;
  std::vector<float> x(nx);
  for (auto& v : x) v = u(rng);
  float sumsq = -1.0f;
  Buffer dx = dev->alloc(nx * 4, stream.get()), dout = dev->alloc(4, stream.get());
  stream->copy(dx.ref(), host_ref(x.data(), nx * 4));
  stream->sum_squares(tensor(dx, DType::kF32), tensor(dout, DType::kF32));
  stream->copy(host_ref(&sumsq, 4), dout.ref());
  stream->synchronize();

  // Error relative to sum |a||b|: TF32 tensor cores (where a backend uses them) stay within
  // ~1e-3 of it, plain fp32 far below; a wrong kernel is off by O(1).
  double matmul_err = 0;
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double ref = 0, mag = 0;
      for (int l = 0; l < k; ++l) {
        ref += double(a[i * k + l]) * double(b[l * n + j]);
        mag += std::fabs(double(a[i * k + l]) * double(b[l * n + j]));
      }
      matmul_err = std::max(matmul_err, std::fabs(double(c[i * n + j]) - ref) / mag);
    }
  double ref_sumsq = 0;
  for (float v : x) ref_sumsq += double(v) * double(v);
  const double sumsq_err = std::fabs(double(sumsq) - ref_sumsq) / ref_sumsq;

  const bool matmul_ok = matmul_err <= 5e-3, sumsq_ok = sumsq_err <= 1e-5;
  const bool ok = copy_ok && matmul_ok && sumsq_ok;
  std::string detail = fmt::format(
      "{}; round trip {} bytes {}, matmul {}x{}x{} max rel err {:.2e}{}, "
      "sum_squares rel err {:.2e}{}, staging {} pages {}",
      dev->name(), n_bytes, copy_ok ? "identical" : "CORRUPTED", m, n, k, matmul_err,
      matmul_ok ? "" : " (limit 5e-3)", sumsq_err, sumsq_ok ? "" : " (limit 1e-5)",
      page_kind_name(src.page_kind()), src.pinned() ? "locked" : "pageable");
  std::printf("self-check %s: %s (%s)\n", which.c_str(), ok ? "ok" : "FAILED", detail.c_str());
  return {{"device", which},
          {"name", dev->name()},
          {"ok", ok},
          {"copy_ok", copy_ok},
          {"matmul_max_rel_err", matmul_err},
          {"sum_squares_rel_err", sumsq_err}};
}

int report(bool as_json, bool check) {
  json out;
  out["build"] = report_build();
  out["host"] = report_cpu();
  out["io_uring"] = report_io();
  out["devices"] = report_devices();
  out["pinned_memory"] = report_pinned();

  bool all_ok = true;
  if (check) {
    std::vector<std::string> which{"cpu"};
    if (probe_cuda().device_count > 0) which.push_back("cuda");
    json checks = json::array();
    for (const auto& w : which) {
      try {
        checks.push_back(self_check(w));
        all_ok = all_ok && checks.back()["ok"].get<bool>();
      } catch (const Error& e) {
        std::printf("self-check %s: FAILED: %s\n", w.c_str(), e.what());
        checks.push_back({{"device", w}, {"ok", false}, {"error", e.what()}});
        all_ok = false;
      }
    }
    out["self_check"] = checks;
  }
  if (as_json) std::printf("%s\n", out.dump().c_str());  // one line, like every --json
  return all_ok ? 0 : 1;
}

}  // namespace
}  // namespace strata

int main(int argc, char** argv) {
  strata::reexec_with_passive_openmp(argv);  // before libgomp's first team: see device.h
  CLI::App app{"strata-info: what this build of strata contains and what this machine offers it"};
  bool as_json = false, check = false;
  app.add_flag("--json", as_json, "also print one JSON object with everything, last");
  app.add_flag("--self-check", check, "run a short correctness check on every usable device");
  return strata::tools::run_tool("strata-info", app, argc, argv, strata::tools::ToolRuns::files,
                                 [&] { return strata::report(as_json, check); });
}
