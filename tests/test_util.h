// Small helpers shared by the test suites.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <string>

#include "strata/error.h"

namespace strata::testing {

// A fresh directory (under `parent`, by default the system's temp directory), removed with
// everything in it when the object goes away.
struct TempDir {
  explicit TempDir(const std::string& prefix = "strata-test",
                   const std::string& parent = std::filesystem::temp_directory_path().string()) {
    std::string tmpl = (std::filesystem::path(parent) / (prefix + "-XXXXXX")).string();
    STRATA_CHECK(::mkdtemp(tmpl.data()) != nullptr, "cannot create a temporary directory {}", tmpl);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string path;
};

}  // namespace strata::testing
