// The CUDA loader: finds the CUDA runtime, cuBLAS and NCCL on this machine, loads them by
// full path, then loads the CUDA module (libstrata_cuda.so, see cuda_module.h) and answers
// every CUDA entry point of strata through the module's table.
//
// What it owns: the one-time load (first use, thread-safe; the answer never changes in a
// process) and its outcome — the module's table, or the reason it is unavailable naming every
// place searched and what to do.
// Search order for each library, first hit wins:
//   1. STRATA_CUDA_LIBS: colon-separated directories;
//   2. the CUDA install: $CUDA_HOME, $CUDA_PATH, /usr/local/cuda, /usr/local/cuda-* (newest
//      first), each at lib64, lib and targets/<arch>-linux/lib;
//   3. the nvidia-* Python wheels PyTorch machines carry (nvidia/cu<N>/lib, nvidia/nccl/lib,
//      and CUDA 12's nvidia/cuda_runtime/lib, nvidia/cublas/lib) in the site-packages and
//      dist-packages under lib/ and lib64/ of $VIRTUAL_ENV, $CONDA_PREFIX, ~/.local, /usr/local,
//      /usr and /opt/conda (found by glob; no Python is run);
//   4. the loader's default path (LD_LIBRARY_PATH, /etc/ld.so.cache, /lib, /usr/lib).
// A library some other code already loaded into the process is used as it is.
// The module lives next to this library (libstrata_gpu.so): in lib/ of an installed package
// and in src/gpu of a build tree.
// Never: loads the CUDA driver library itself (cudart does, when a device is used), or runs
// anything to find a library.
#include <dlfcn.h>
#include <glob.h>
#include <link.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "gpu/cuda_module.h"
#include "gpu/gpu_info.h"
#include "strata/error.h"
#include "strata/log.h"

namespace strata {
namespace gpu {
namespace {

struct LoadResult {
  const CudaModule* module = nullptr;
  std::string reason;                 // why module is nullptr
  std::vector<LoadedLibrary> loaded;  // in load order, the module last
};

#if defined(STRATA_HAVE_CUDA)

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

bool is_dir(const std::string& p) {
  std::error_code ec;
  return !p.empty() && std::filesystem::is_directory(p, ec);
}
bool is_file(const std::string& p) { return ::access(p.c_str(), R_OK) == 0; }

// The folders matching `pattern` (glob, with {a,b}), newest version first.
std::vector<std::string> glob_dirs(const std::string& pattern) {
  std::vector<std::string> out;
  glob_t g{};
  if (::glob(pattern.c_str(), GLOB_ONLYDIR | GLOB_NOSORT | GLOB_BRACE, nullptr, &g) == 0)
    for (std::size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  // Version order, so cuda-12.10 comes before cuda-12.9.
  std::sort(out.begin(), out.end(), [](const std::string& a, const std::string& b) {
    return ::strverscmp(a.c_str(), b.c_str()) > 0;
  });
  return out;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= s.size()) {
    const std::size_t end = std::min(s.find(sep, start), s.size());
    if (end > start) out.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

// The candidate directories in search order, and what was looked at, for the error message.
struct SearchPath {
  std::vector<std::string> dirs;
  std::vector<std::string> looked;

  void add_dir(const std::string& d) {
    if (std::find(dirs.begin(), dirs.end(), d) == dirs.end()) dirs.push_back(d);
  }
  // The library folders `subdirs` of each directory matching `pattern`; returns what to say
  // about it: "/usr/local/cuda-13.0", "... (absent)", "... (no match)".
  std::string add(const std::string& pattern, const std::vector<std::string>& subdirs,
                  const char* none_note) {
    const std::vector<std::string> roots = glob_dirs(pattern);
    if (roots.empty())
      return pattern +
             (pattern.find_first_of("*{") == std::string::npos ? " (absent)" : " (no match)");
    std::string note;
    for (const auto& r : roots) {
      bool any = false;
      for (const auto& sub : subdirs)
        if (is_dir(r + "/" + sub)) add_dir(r + "/" + sub), any = true;
      note += (note.empty() ? "" : ", ") + r + (any ? "" : none_note);
    }
    return note;
  }
};

SearchPath search_path() {
  SearchPath sp;
  // 1. The user's directories.
  const std::string user = env("STRATA_CUDA_LIBS");
  if (user.empty()) {
    sp.looked.push_back("STRATA_CUDA_LIBS (unset)");
  } else {
    std::string note = "STRATA_CUDA_LIBS=" + user;
    for (const auto& d : split(user, ':')) {
      if (is_dir(d))
        sp.add_dir(d);
      else
        note += " (" + d + ": no such directory)";
    }
    sp.looked.push_back(std::move(note));
  }
  // 2. The CUDA install.
  const std::vector<std::string> cuda_subdirs = {"lib64", "lib",
                                                 "targets/" STRATA_CUDA_TARGET_ARCH "-linux/lib"};
  std::vector<std::string> roots;
  for (const char* var : {"CUDA_HOME", "CUDA_PATH"})
    if (const std::string root = env(var); !root.empty()) roots.push_back(root);
  roots.push_back("/usr/local/cuda");
  roots.push_back("/usr/local/cuda-*");
  std::string note =
      "the CUDA install ({lib64,lib,targets/" STRATA_CUDA_TARGET_ARCH "-linux/lib} of ";
  std::vector<std::string> seen;
  for (std::size_t i = 0; i < roots.size(); ++i) {
    if (std::find(seen.begin(), seen.end(), roots[i]) != seen.end()) continue;
    seen.push_back(roots[i]);
    note += (i ? ", " : "") + sp.add(roots[i], cuda_subdirs, " (no libraries)");
  }
  sp.looked.push_back(note + ")");
  // 3. The nvidia-* wheels (CUDA 13 wheels share nvidia/cu13/lib; NCCL and CUDA 12 wheels
  // have one folder per library).
  const std::vector<std::string> wheel_subdirs = {"nvidia/cu" STRATA_CUDA_MAJOR "/lib",
                                                  "nvidia/cuda_runtime/lib", "nvidia/cublas/lib",
                                                  "nvidia/nccl/lib"};
  std::vector<std::string> prefixes;
  for (const char* var : {"VIRTUAL_ENV", "CONDA_PREFIX"})
    if (const std::string p = env(var); !p.empty()) prefixes.push_back(p);
  if (const std::string home = env("HOME"); !home.empty()) prefixes.push_back(home + "/.local");
  for (const char* p : {"/usr/local", "/usr", "/opt/conda"}) prefixes.push_back(p);
  note = "the nvidia-* Python wheels (nvidia/{cu" STRATA_CUDA_MAJOR
         ",cuda_runtime,cublas,nccl}/lib in ";
  for (std::size_t i = 0; i < prefixes.size(); ++i) {
    // /usr/lib/python3/dist-packages (Debian's) matches python3* too.
    note += (i ? ", " : "") + sp.add(prefixes[i] + "/{lib,lib64}/python3*/{site,dist}-packages",
                                     wheel_subdirs, " (none)");
  }
  sp.looked.push_back(note + ")");
  // 4. The loader's default path: tried by name when a library is in none of the above.
  const std::string ld = env("LD_LIBRARY_PATH");
  sp.looked.push_back("the loader's default path (LD_LIBRARY_PATH " +
                      (ld.empty() ? std::string("unset") : ld) +
                      ", /etc/ld.so.cache, /lib, /usr/lib)");
  return sp;
}

// The file a handle came from.
std::string handle_path(void* handle, const std::string& fallback) {
  link_map* map = nullptr;
  if (::dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name && *map->l_name)
    return map->l_name;
  return fallback;
}

std::string this_library_dir() {
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&cuda_module), &info) == 0 || !info.dli_fname) return ".";
  // Canonical: the loader names it as found, e.g. <package>/bin/../lib/libstrata_gpu.so.
  char* real = ::realpath(info.dli_fname, nullptr);
  std::string path = real ? real : info.dli_fname;
  std::free(real);
  const std::size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

std::string join(const std::vector<std::string>& v, const char* sep) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + x;
  return s;
}

LoadResult load() {
  LoadResult r;
  // CUDA 12+ loads kernels lazily, and loading one may need a context synchronization: a cuBLAS
  // kernel first launched while a stream spins on a host function's flag (the CUDA stream's
  // wait for host work) would deadlock. Every module is loaded when the context is made instead,
  // unless the user chose otherwise. Set before cudart is loaded: it reads the variable then.
  ::setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  const std::vector<std::string> needed = split(STRATA_CUDA_LIBRARIES, ':');  // in dependency order
  const SearchPath sp = search_path();
  std::vector<std::string> missing, failed;
  for (const auto& name : needed) {
    // Already in the process (the program linked it, or LD_PRELOAD): use that one.
    if (void* h = ::dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD)) {
      r.loaded.push_back({name, handle_path(h, name)});
      continue;
    }
    std::string found;
    for (const auto& d : sp.dirs)
      if (is_file(d + "/" + name)) {
        found = d + "/" + name;
        break;
      }
    if (!found.empty()) {
      if (::dlopen(found.c_str(), RTLD_NOW | RTLD_GLOBAL) != nullptr) {
        r.loaded.push_back({name, found});
      } else {
        const char* e = ::dlerror();
        failed.push_back(fmt::format("{}: {}", found, e ? e : "dlopen failed"));
      }
      continue;
    }
    if (void* h = ::dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL)) {
      r.loaded.push_back({name, handle_path(h, name)});
      continue;
    }
    const char* e = ::dlerror();
    // dlopen by name says "cannot open shared object file" when it is simply absent.
    if (e && !std::strstr(e, "cannot open shared object file")) failed.push_back(e);
    missing.push_back(name);
  }
  if (!missing.empty() || !failed.empty()) {
    std::string why;
    if (!missing.empty())
      why = fmt::format("CUDA libraries not found: {}{}; looked in {}", join(missing, ", "),
                        missing.size() == needed.size()
                            ? ""
                            : " (strata's CUDA backend needs " + join(needed, ", ") + ")",
                        join(sp.looked, "; "));
    if (!failed.empty())
      why += (why.empty() ? "" : "; ") + std::string("failed to load ") + join(failed, "; ");
    r.reason = fmt::format(
        "{}. Set STRATA_CUDA_LIBS to the folders that hold them (colon-separated), or install the "
        "CUDA {} runtime, cuBLAS and NCCL (the CUDA toolkit and NCCL, or the CUDA {} "
        "nvidia-cuda-runtime, nvidia-cublas and nvidia-nccl wheels)",
        why, STRATA_CUDA_MAJOR, STRATA_CUDA_MAJOR);
    r.loaded.clear();
    return r;
  }

  const std::string module_path = this_library_dir() + "/" STRATA_CUDA_MODULE_FILE;
  if (!is_file(module_path)) {
    r.reason = fmt::format(
        "the CUDA module {} is missing: this strata installation is incomplete (unpack the "
        "whole package again) or the build did not finish",
        module_path);
    r.loaded.clear();
    return r;
  }
  void* h = ::dlopen(module_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = ::dlerror();
    r.reason = fmt::format("the CUDA module {} failed to load: {} (CUDA libraries used: {})",
                           module_path, e ? e : "dlopen failed", [&] {
                             std::vector<std::string> v;
                             for (const auto& l : r.loaded) v.push_back(l.path);
                             return join(v, ", ");
                           }());
    r.loaded.clear();
    return r;
  }
  using Entry = const CudaModule* (*)();
  auto entry = reinterpret_cast<Entry>(::dlsym(h, kCudaModuleEntry));
  const CudaModule* m = entry ? entry() : nullptr;
  if (!m || m->abi != kCudaModuleAbi || m->table_bytes != sizeof(CudaModule) ||
      std::strcmp(m->strata_version, STRATA_VERSION_STRING) != 0) {
    r.reason = fmt::format(
        "the CUDA module {} does not belong to this strata {} (abi {}): it is from another "
        "build; reinstall the package, or rebuild",
        module_path, STRATA_VERSION_STRING, kCudaModuleAbi);
    r.loaded.clear();
    return r;
  }
  r.loaded.push_back({STRATA_CUDA_MODULE_FILE, module_path});
  r.module = m;
  for (const auto& l : r.loaded) log::debug("cuda: {} from {}", l.name, l.path);
  return r;
}

#else

LoadResult load() {
  LoadResult r;
  r.reason = "built without CUDA (configure with -DSTRATA_CUDA=ON)";
  return r;
}

#endif  // STRATA_HAVE_CUDA

const LoadResult& loaded() {
  static const LoadResult r = load();
  return r;
}

// The rows component_versions() reports without the module, so tools print a stable set.
std::vector<ComponentVersion> absent_versions(const char* what) {
  return {{"cuda", what}, {"cuda driver", what}, {"cublas", what}, {"nccl", what}};
}

}  // namespace

const CudaModule* cuda_module() { return loaded().module; }
const std::string& cuda_unavailable_reason() { return loaded().reason; }

std::vector<ComponentVersion> component_versions() {
#if defined(STRATA_HAVE_CUDA)
  if (const CudaModule* m = cuda_module()) return m->component_versions();
  return absent_versions("not found");
#else
  return absent_versions("not built");
#endif
}

std::vector<std::string> device_descriptions() {
  const CudaModule* m = cuda_module();
  return m ? m->device_descriptions() : std::vector<std::string>{};
}

std::vector<LoadedLibrary> cuda_libraries() { return loaded().loaded; }

GemmBest best_cublaslt_gemm(Stream& stream, const MatmulDesc& desc, int max_candidates, int iters) {
  const CudaModule* m = cuda_module();
  if (!m) STRATA_THROW(kUnsupported, "cuBLASLt is unavailable: {}", cuda_unavailable_reason());
  return m->best_cublaslt_gemm(stream, desc, max_candidates, iters);
}

double time_queued_ms(Stream& stream, const std::function<void()>& queue) {
  const CudaModule* m = cuda_module();
  if (!m)
    STRATA_THROW(kUnsupported, "CUDA event timing is unavailable: {}", cuda_unavailable_reason());
  return m->time_queued_ms(stream, queue);
}

namespace model {
namespace {
// STRATA_GPU_KERNELS into the module's variant switch (unset or empty: left at its default).
void apply_kernel_variant_env(const Kernels& k) {
  const char* v = std::getenv("STRATA_GPU_KERNELS");
  if (v == nullptr || *v == '\0') return;
  if (std::strcmp(v, "simple") == 0)
    k.set_kernel_variant(KernelVariant::kSimple);
  else if (std::strcmp(v, "tiled") == 0)
    k.set_kernel_variant(KernelVariant::kTiled);
  else
    STRATA_THROW(
        kInvalidArgument,
        "STRATA_GPU_KERNELS='{}' is not one of simple (the reference kernels, the default), tiled "
        "(tensor-core attention, parallel column reductions): unset it or pick one",
        v);
}
}  // namespace

const Kernels& kernels() {
  const CudaModule* m = cuda_module();
  if (!m)
    STRATA_THROW(kUnsupported, "the CUDA model kernels are unavailable: {}",
                 cuda_unavailable_reason());
  // Once, at the first call; a bad value throws here and again at every later call (a static
  // whose initialisation throws is initialised again next time).
  static const bool env_applied = (apply_kernel_variant_env(*m->model_kernels), true);
  (void)env_applied;
  return *m->model_kernels;
}
}  // namespace model

void set_model_kernel_variant(KernelVariant variant) {
  model::kernels().set_kernel_variant(variant);
}
KernelVariant model_kernel_variant() { return model::kernels().kernel_variant(); }

}  // namespace gpu

CudaProbe probe_cuda() {
  if (const gpu::CudaModule* m = gpu::cuda_module()) return m->probe();
  CudaProbe p;
#if defined(STRATA_HAVE_CUDA)
  p.compiled = true;
#endif
  p.device_count = 0;
  p.reason = gpu::cuda_unavailable_reason();
  return p;
}

std::unique_ptr<Device> make_cuda_device(const CudaDeviceOptions& options) {
  if (const gpu::CudaModule* m = gpu::cuda_module()) {
    // The model kernels' variant from STRATA_GPU_KERNELS, set before the device's model kernels
    // (Device::model_kernels(), in the module) first launch; a bad value is refused here.
    (void)gpu::model::kernels();
    return m->make_device(options);
  }
  STRATA_THROW(kUnsupported, "no usable CUDA GPU ({}); use the CPU-emulated device",
               gpu::cuda_unavailable_reason());
}

}  // namespace strata
