// Tests of the umbrella: device selection, and the facts strata-info reports about the build
// and the host.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>

#include "cpu/cpu_info.h"
#include "gpu/cuda_module.h"
#include "gpu/gpu_info.h"
#include "gpu/model_kernels.h"
#include "strata/build_info.h"
#include "strata/device.h"
#include "strata/error.h"
#include "strata/system_info.h"
#include "test_util.h"

namespace strata {
namespace {

TEST(Runtime, MakeDeviceCpuGivesTheEmulatedDevice) {
  auto dev = make_device("cpu");
  ASSERT_NE(dev, nullptr);
  EXPECT_EQ(dev->kind(), DeviceKind::kCpu);
  EXPECT_FALSE(dev->name().empty());
  Buffer b = dev->alloc(4096);
  EXPECT_TRUE(b);
  EXPECT_EQ(b.size(), 4096u);
}

TEST(Runtime, MakeDeviceRejectsUnknownNamesListingTheAllowedOnes) {
  try {
    (void)make_device("bogus");
    FAIL() << "make_device(\"bogus\") did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    const std::string m = e.message();
    EXPECT_NE(m.find("bogus"), std::string::npos) << m;
    for (const char* allowed : {"auto", "cpu", "cuda"})
      EXPECT_NE(m.find(allowed), std::string::npos) << m;
  }
}

TEST(Runtime, MakeDeviceCudaWithoutAGpuIsUnsupportedWithTheProbeReason) {
  const CudaProbe probe = probe_cuda();
  if (probe.device_count > 0) GTEST_SKIP() << "a GPU is usable here";
  EXPECT_FALSE(probe.reason.empty());
  try {
    (void)make_device("cuda");
    FAIL() << "make_device(\"cuda\") did not throw without a GPU";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
    EXPECT_NE(e.message().find(probe.reason), std::string::npos) << e.message();
  }
  // "auto" falls back to the CPU-emulated device.
  EXPECT_EQ(make_device("auto")->kind(), DeviceKind::kCpu);
}

TEST(Runtime, ComponentVersionsNameTheHostLibraries) {
  const auto versions = component_versions();
  std::set<std::string> names;
  for (const auto& c : versions) {
    EXPECT_FALSE(c.name.empty());
    EXPECT_FALSE(c.version.empty()) << c.name;
    EXPECT_TRUE(names.insert(c.name).second) << "duplicate " << c.name;
  }
  for (const char* lib : {"onednn", "tbb", "hwloc", "liburing"}) {
    ASSERT_TRUE(names.count(lib)) << lib << " missing";
    const auto it = std::find_if(versions.begin(), versions.end(),
                                 [&](const auto& c) { return c.name == lib; });
    // Host libraries are always linked: a real version, starting with a digit.
    EXPECT_TRUE(std::isdigit(static_cast<unsigned char>(it->version[0])))
        << lib << ": " << it->version;
  }
  EXPECT_EQ(built_with_cuda(), probe_cuda().compiled);
  EXPECT_FALSE(strata_version().empty());
}

// The CUDA backend is a module loaded at run time (src/gpu/cuda_module.h): either it loaded,
// from beside libstrata_gpu.so, with every CUDA library it needs, or the reason says why,
// naming where the libraries were looked for.
TEST(Runtime, CudaModuleLoadsWithItsLibrariesOrTheReasonSaysWhereItLooked) {
  const CudaProbe probe = probe_cuda();
  const auto libs = gpu::cuda_libraries();
  if (probe.device_count == 0) {
    // Thrown inside the module when it is loaded: strata::Error must cross the boundary.
    try {
      (void)make_cuda_device();
      FAIL() << "make_cuda_device() did not throw without a GPU";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
      EXPECT_NE(e.message().find(probe.reason), std::string::npos) << e.message();
    }
  }
  if (!probe.compiled) {
    EXPECT_NE(probe.reason.find("built without CUDA"), std::string::npos) << probe.reason;
    EXPECT_TRUE(libs.empty());
    return;
  }
  if (libs.empty()) {
    for (const char* place :
         {"looked in", "STRATA_CUDA_LIBS", "/usr/local/cuda", "wheels", "default path"})
      EXPECT_NE(probe.reason.find(place), std::string::npos)
          << place << " missing from: " << probe.reason;
    return;
  }
  std::set<std::string> names;
  for (const auto& l : libs) {
    names.insert(l.name);
    EXPECT_TRUE(std::filesystem::exists(l.path)) << l.name << ": " << l.path;
    EXPECT_NE(l.path.find(l.name), std::string::npos) << l.path;
  }
  EXPECT_EQ(libs.back().name, "libstrata_cuda.so");
  for (const char* needed : {"libcudart.so", "libcublas.so", "libcublasLt.so"}) {
    EXPECT_TRUE(std::any_of(names.begin(), names.end(),
                            [&](const std::string& n) { return n.starts_with(needed); }))
        << needed << " was not loaded";
  }
  // With the module loaded, the versions are the libraries' own.
  for (const auto& c : component_versions()) {
    if (c.name == "cuda" || c.name == "cublas") {
      EXPECT_TRUE(std::isdigit(static_cast<unsigned char>(c.version[0])))
          << c.name << ": " << c.version;
    }
  }
}

TEST(Runtime, IoUringProbeIsConsistentAndCached) {
  const nvme::UringProbe a = nvme::probe_io_uring();
  const nvme::UringProbe b = nvme::probe_io_uring();
  EXPECT_EQ(a.available, b.available);
  EXPECT_EQ(a.reason, b.reason);
  EXPECT_FALSE(a.version.empty());
  EXPECT_NE(a.version, "unknown");
  if (a.available) {
    EXPECT_TRUE(a.reason.empty()) << a.reason;
  } else {
    EXPECT_NE(a.reason.find("io_uring"), std::string::npos) << a.reason;
  }
}

TEST(Runtime, HostFactsAreSane) {
  const auto nodes = cpu::numa_nodes();
  ASSERT_GE(nodes.size(), 1u);
  int cores = 0;
  std::set<int> indices;
  for (const auto& n : nodes) {
    EXPECT_GT(n.memory_bytes, 0u) << "node " << n.os_index;
    EXPECT_TRUE(indices.insert(n.os_index).second);
    cores += n.cores;
  }
  EXPECT_GE(cores, 1);
  EXPECT_LE(static_cast<unsigned>(cores), std::max(1u, std::thread::hardware_concurrency()));
  EXPECT_FALSE(nodes[0].cpuset.empty());

  const cpu::HugePageInfo h = cpu::huge_page_info();
  EXPECT_GT(h.hugetlb_page_bytes, 0u);
  EXPECT_LE(h.hugetlb_free, h.hugetlb_total);
  const std::set<std::string> modes{"always", "madvise", "never", "unavailable"};
  EXPECT_TRUE(modes.count(h.thp_mode)) << h.thp_mode;

  EXPECT_FALSE(cpu::cpu_model().empty());
  const std::set<std::string> known{"avx2",     "f16c",        "fma",     "avx512f",
                                    "avx512bw", "avx512_bf16", "amx_bf16"};
  const auto isa = cpu::cpu_isa_features();
  for (const auto& f : isa) EXPECT_TRUE(known.count(f)) << f;
  // avx512_bf16 is only reported on top of avx512f.
  const bool bf16 = std::count(isa.begin(), isa.end(), "avx512_bf16") > 0;
  const bool f512 = std::count(isa.begin(), isa.end(), "avx512f") > 0;
  if (bf16) {
    EXPECT_TRUE(f512);
  }
#if defined(__x86_64__)
  // Cross-check against what the kernel lists for the CPU.
  std::ifstream f("/proc/cpuinfo");
  std::string line, flags;
  while (std::getline(f, line))
    if (line.rfind("flags", 0) == 0) {
      flags = line + " ";
      break;
    }
  if (!flags.empty()) {
    EXPECT_EQ(flags.find(" avx2 ") != std::string::npos,
              std::count(isa.begin(), isa.end(), "avx2") > 0);
    EXPECT_EQ(flags.find(" f16c ") != std::string::npos,
              std::count(isa.begin(), isa.end(), "f16c") > 0);
  }
#endif
}

// A CUDA device's default cap leaves max(3 GiB, 5% of the total) for what is not strata's to plan.
TEST(Runtime, TheDefaultCudaCapLeavesHeadroom) {
  constexpr std::size_t GiB = std::size_t(1) << 30;
  EXPECT_EQ(default_cuda_capacity(139 * GiB, 140 * GiB), 139 * GiB - 7 * GiB);  // an H200: 5%
  EXPECT_EQ(default_cuda_capacity(23 * GiB, 24 * GiB), 20 * GiB);               // 3 GiB
  EXPECT_EQ(default_cuda_capacity(2 * GiB, 24 * GiB), 1 * GiB);  // nothing left: half
}

// strata-info's JSON ("host") of a run with `env`, or the run itself when it failed.
nlohmann::json info_host(const std::vector<std::pair<std::string, std::string>>& env,
                         testing::Result* r = nullptr) {
  testing::TempDir d("strata-info");
  const testing::Result got = testing::run(STRATA_INFO_BIN, {"--json"}, d.path, "info", env);
  if (r) *r = got;
  if (got.status != 0) return {};
  const std::string& out = got.out;
  const auto start = out.rfind("\n{");
  return nlohmann::json::parse(out.substr(start == std::string::npos ? 0 : start + 1))["host"];
}

// The CUDA model kernels' variant (gpu/model_kernels.h) in a fresh process: exit 1 for the simple
// kernels, 2 for the tiled; 3 when the table's first use throws and its second throws too,
// with the message on stderr.
[[noreturn]] void exit_with_first_kernel_variant() {
  try {
    std::exit(gpu::model::kernels().kernel_variant() == gpu::model::KernelVariant::kTiled ? 2 : 1);
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.message().c_str());
    try {
      (void)gpu::model::kernels();
    } catch (const Error&) {
      std::exit(3);
    }
    std::exit(4);
  }
}

// The CUDA model kernels default to the simple variant, set_kernel_variant switches them, and
// STRATA_GPU_KERNELS, read when the table is first used, picks one or is refused naming itself
// and its values. Host state only: this runs wherever the CUDA module loads, GPU or not.
TEST(Runtime, GpuKernelVariantSwitchAndStrataGpuKernels) {
  if (gpu::cuda_module() == nullptr)
    GTEST_SKIP() << "the CUDA module does not load here: " << gpu::cuda_unavailable_reason();
  const char* user = std::getenv("STRATA_GPU_KERNELS");
  const std::string saved = user ? user : "";
  GTEST_FLAG_SET(death_test_style,
                 "threadsafe");  // a fresh process each: the variable is read once
  struct Case {
    const char* value;  // nullptr: unset
    int exit_code;
    const char* stderr_regex;
  };
  for (const Case& c :
       {Case{nullptr, 1, ""}, Case{"", 1, ""}, Case{"simple", 1, ""}, Case{"tiled", 2, ""},
        Case{"Tiled", 3, "STRATA_GPU_KERNELS='Tiled' is not one of simple .*, tiled "}}) {
    SCOPED_TRACE(c.value ? c.value : "(unset)");
    if (c.value)
      setenv("STRATA_GPU_KERNELS", c.value, 1);
    else
      unsetenv("STRATA_GPU_KERNELS");
    EXPECT_EXIT(exit_with_first_kernel_variant(), ::testing::ExitedWithCode(c.exit_code),
                c.stderr_regex);
  }
  unsetenv("STRATA_GPU_KERNELS");
  const gpu::model::Kernels& k = gpu::model::kernels();
  const auto before = k.kernel_variant();
  k.set_kernel_variant(gpu::model::KernelVariant::kTiled);
  EXPECT_EQ(k.kernel_variant(), gpu::model::KernelVariant::kTiled);
  k.set_kernel_variant(gpu::model::KernelVariant::kSimple);
  EXPECT_EQ(k.kernel_variant(), gpu::model::KernelVariant::kSimple);
  k.set_kernel_variant(before);
  if (user) setenv("STRATA_GPU_KERNELS", saved.c_str(), 1);
}

// STRATA_CPU_ISA caps every CPU dispatcher at once, as strata-info reports them: AdamW, the model's
// row kernels and oneDNN (whose bf16 matmul Debian's oneDNN has only from AVX-512: below it the
// bf16 GEMMs are widened to fp32). Without the cap, the paths are the widest the CPU has. A bad
// value is one line naming the variable, before anything else is printed.
TEST(Runtime, StrataCpuIsaCapsEveryPathStrataInfoReports) {
  // The user's own oneDNN cap would win over ours: this test sets none.
  const std::vector<std::pair<std::string, std::string>> clean{{"ONEDNN_MAX_CPU_ISA", ""},
                                                               {"DNNL_MAX_CPU_ISA", ""},
                                                               {"STRATA_ADAMW_ISA", ""},
                                                               {"STRATA_MODEL_ISA", ""}};
  auto with = [&](const char* cap) {
    auto env = clean;
    env.emplace_back("STRATA_CPU_ISA", cap);
    return env;
  };
  const nlohmann::json free = info_host(with(""));
  ASSERT_TRUE(free.is_object());
  EXPECT_EQ(free["isa_cap"], "auto");
  const auto features = cpu::cpu_isa_features();
  const bool has512 = std::count(features.begin(), features.end(), "avx512bw") > 0;
  const bool has2 = std::count(features.begin(), features.end(), "avx2") > 0;
  EXPECT_EQ(free["adamw_isa"], has512 ? "avx512" : has2 ? "avx2" : "scalar") << free.dump();
  EXPECT_EQ(free["model_kernels_isa"], free["adamw_isa"]);
  for (const char* dt : {"fp32", "bf16", "fp16"}) {
    ASSERT_TRUE(free["gemm"].contains(dt)) << free.dump();
    EXPECT_FALSE(free["gemm"][dt]["impl"].get<std::string>().empty()) << dt;
  }
  EXPECT_EQ(free["gemm"]["fp32"]["route"], "oneDNN native");

  for (const char* cap : {"avx2", "scalar"}) {
    SCOPED_TRACE(cap);
    const nlohmann::json h = info_host(with(cap));
    ASSERT_TRUE(h.is_object());
    EXPECT_EQ(h["isa_cap"], cap);
    const std::string want = std::string(cap) == "avx2" && has2 ? "avx2" : "scalar";
    EXPECT_EQ(h["adamw_isa"], want) << h.dump();
    EXPECT_EQ(h["model_kernels_isa"], want) << h.dump();
    const std::string onednn = h["onednn_isa"];
    EXPECT_FALSE(onednn.starts_with("avx512")) << onednn;
    if (std::string(cap) == "scalar") {
      EXPECT_EQ(onednn, "sse41");
    }
    // oneDNN 2.x has no bf16 or fp16 matmul below AVX-512: both widened.
    EXPECT_EQ(h["gemm"]["bf16"]["route"], "widened to fp32") << h.dump();
    EXPECT_EQ(h["gemm"]["fp16"]["route"], "widened to fp32") << h.dump();
    EXPECT_EQ(h["gemm"]["fp32"]["route"], "oneDNN native") << h.dump();
  }
  testing::Result r;
  auto bad = with("avx3");
  EXPECT_TRUE(info_host(bad, &r).is_null());
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.err,
            "strata-info: invalid argument: STRATA_CPU_ISA='avx3' is not one of auto, avx512, "
            "avx2, scalar: "
            "unset it or pick one\n");
  EXPECT_NE(r.out.find("\"error\""), std::string::npos)
      << r.out;  // --json's error object, and nothing before it
  EXPECT_EQ(r.out.find("cpu:"), std::string::npos) << r.out;
  // The model kernels' own variable, named as such (it said "unknown AdamW ISA 'bogus'").
  auto bad_model = with("");
  bad_model.emplace_back("STRATA_MODEL_ISA", "bogus");
  EXPECT_TRUE(info_host(bad_model, &r).is_null());
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("STRATA_MODEL_ISA='bogus' is not one of auto, avx512, avx2, scalar"),
            std::string::npos)
      << r.err;
}

}  // namespace
}  // namespace strata
