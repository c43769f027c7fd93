// Logging: spdlog underneath, level from STRATA_LOG_LEVEL (trace, debug, info, warn,
// error, off; default info). Messages go to stderr as "[strata] [level] text".
#pragma once

#include <fmt/format.h>

#include <string>
#include <string_view>

namespace strata::log {

enum class Level { kTrace, kDebug, kInfo, kWarn, kError, kOff };

void set_level(Level level);
Level level();
// Parses a level name; throws strata::Error naming the allowed values.
Level parse_level(std::string_view name);
void write(Level level, std::string_view message);

// Bytes for people: "512 B", "1.50 MiB", "4.00 GiB" (binary units, `decimals` after the point;
// a negative value: up to -decimals, trailing zeros dropped: "4 GiB", "1.5 GiB").
std::string human_bytes(double bytes, int decimals = 2);

template <class... Args>
void info(fmt::format_string<Args...> f, Args&&... args) {
  if (level() <= Level::kInfo) write(Level::kInfo, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void warn(fmt::format_string<Args...> f, Args&&... args) {
  if (level() <= Level::kWarn) write(Level::kWarn, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void error(fmt::format_string<Args...> f, Args&&... args) {
  if (level() <= Level::kError) write(Level::kError, fmt::format(f, std::forward<Args>(args)...));
}
template <class... Args>
void debug(fmt::format_string<Args...> f, Args&&... args) {
  if (level() <= Level::kDebug) write(Level::kDebug, fmt::format(f, std::forward<Args>(args)...));
}

// Emits a warning only the first time `key` is seen in this process (for fallbacks).
void warn_once(std::string_view key, std::string_view message);

// A scope that says less: the log level raised to at least `floor` while it lives, and put back
// however the scope ends — for work whose messages are said elsewhere already (every rank
// parsing the same config; trial parses of a config the user was warned about when it was read).
class Quiet {
 public:
  explicit Quiet(Level floor, bool on = true) : saved_(level()) {
    if (on && saved_ < floor) set_level(floor);
  }
  ~Quiet() { set_level(saved_); }
  Quiet(const Quiet&) = delete;
  Quiet& operator=(const Quiet&) = delete;

 private:
  Level saved_;
};

}  // namespace strata::log
