#include "strata/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>

#include "strata/error.h"

namespace strata::log {
namespace {

spdlog::level::level_enum to_spd(Level l) {
  switch (l) {
    case Level::kTrace:
      return spdlog::level::trace;
    case Level::kDebug:
      return spdlog::level::debug;
    case Level::kInfo:
      return spdlog::level::info;
    case Level::kWarn:
      return spdlog::level::warn;
    case Level::kError:
      return spdlog::level::err;
    case Level::kOff:
      return spdlog::level::off;
  }
  return spdlog::level::info;
}

Level initial_level() {
  const char* env = std::getenv("STRATA_LOG_LEVEL");
  if (!env || !*env) return Level::kInfo;
  try {
    return parse_level(env);
  } catch (const Error& e) {
    std::fprintf(stderr, "[strata] [warning] STRATA_LOG_LEVEL: %s; using info\n",
                 e.message().c_str());
    return Level::kInfo;
  }
}

std::atomic<Level>& current() {
  static std::atomic<Level> lvl{initial_level()};
  return lvl;
}

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> l = [] {
    auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
    auto lg = std::make_shared<spdlog::logger>("strata", sink);
    lg->set_pattern("[strata] [%l] %v");
    lg->set_level(spdlog::level::trace);  // filtering happens in level()
    return lg;
  }();
  return *l;
}

}  // namespace

void set_level(Level l) { current().store(l, std::memory_order_relaxed); }
Level level() { return current().load(std::memory_order_relaxed); }

Level parse_level(std::string_view n) {
  if (n == "trace") return Level::kTrace;
  if (n == "debug") return Level::kDebug;
  if (n == "info") return Level::kInfo;
  if (n == "warn" || n == "warning") return Level::kWarn;
  if (n == "error") return Level::kError;
  if (n == "off") return Level::kOff;
  STRATA_THROW(kInvalidArgument,
               "unknown log level '{}': use trace, debug, info, warn, error or off", n);
}

std::string human_bytes(double b, int decimals) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int u = 0;
  while (b >= 1024 && u < 5) {
    b /= 1024;
    ++u;
  }
  if (u == 0) return fmt::format("{:.0f} B", b);
  std::string num = fmt::format("{:.{}f}", b, decimals < 0 ? -decimals : decimals);
  if (decimals < 0 && num.find('.') != std::string::npos) {
    num.erase(num.find_last_not_of('0') + 1);
    if (num.back() == '.') num.pop_back();
  }
  return num + " " + units[u];
}

void write(Level l, std::string_view message) { logger().log(to_spd(l), "{}", message); }

void warn_once(std::string_view key, std::string_view message) {
  static std::mutex mu;
  static std::set<std::string, std::less<>> seen;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (seen.find(key) != seen.end()) return;
    seen.emplace(key);
  }
  if (level() <= Level::kWarn) write(Level::kWarn, message);
}

}  // namespace strata::log
