#include "core/json_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "strata/error.h"
#include "strata/log.h"

namespace strata::config {

Json parse(std::string_view text, std::string_view what, bool duplicates_last_wins) {
  if (duplicates_last_wins) {
    try {
      return Json::parse(text.begin(), text.end());
    } catch (const Json::exception& e) {  // a syntax error; a number too large for a double
      STRATA_THROW(kInvalidArgument, "{} is not valid JSON: {}", what, e.what());
    }
  }
  // A key twice in one object: the last would win without a word (DeepSpeed refuses it too).
  // The keys of each open object, and the path to it, for the message.
  std::vector<std::vector<std::string>> keys;
  std::vector<std::string> path;
  std::string last_key;
  const auto where = [&] {
    std::string p;
    for (const std::string& k : path) p += (p.empty() ? "" : ".") + k;
    return p;
  };
  const Json::parser_callback_t unique = [&](int, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        if (!keys.empty()) path.push_back(last_key);
        keys.emplace_back();
        break;
      case Json::parse_event_t::object_end:
        keys.pop_back();
        if (!path.empty() && !keys.empty()) path.pop_back();
        break;
      case Json::parse_event_t::key: {
        last_key = parsed.get<std::string>();
        auto& seen = keys.back();
        if (std::find(seen.begin(), seen.end(), last_key) != seen.end()) {
          const std::string in = where();
          STRATA_THROW(kInvalidArgument,
                       "{}: the key '{}' is given twice{}{}: keep one (the values would be "
                       "merged by no rule)",
                       what, last_key, in.empty() ? "" : " in ", in);
        }
        seen.push_back(last_key);
        break;
      }
      default:
        break;
    }
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), unique);
  } catch (const Json::exception& e) {  // a syntax error; a number too large for a double
    STRATA_THROW(kInvalidArgument, "{} is not valid JSON: {}", what, e.what());
  }
}

static const char* type_name(const Json& j) { return j.type_name(); }

Section::Section(const Json* obj, std::string path) : obj_(obj), path_(std::move(path)) {
  if (obj_ && obj_->is_null()) obj_ = nullptr;
  STRATA_REQUIRE(obj_ == nullptr || obj_->is_object(), "config key '{}' must be an object, got {}",
                 path_.empty() ? "(top level)" : path_, obj_ ? type_name(*obj_) : "null");
}

bool Section::has(std::string_view key) const { return raw(key) != nullptr; }

std::string Section::key_path(std::string_view key) const {
  return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
}

const Json* Section::raw(std::string_view key) const {
  if (!obj_) return nullptr;
  auto it = obj_->find(key);
  if (it == obj_->end() || it->is_null()) return nullptr;
  return &*it;
}

std::uint64_t Section::get_uint(std::string_view key, std::uint64_t def, std::uint64_t min) const {
  const Json* v = raw(key);
  if (!v) return def;
  const auto too_small = [&] {
    return fmt::format(
        "config key '{}' must be a whole number of at least {} (5e8 and 500000000 both work), got "
        "{}",
        key_path(key), min, v->dump());
  };
  std::uint64_t out = 0;
  if (v->is_number_unsigned()) {
    out = v->get<std::uint64_t>();
  } else if (v->is_number_integer()) {
    const auto i = v->get<std::int64_t>();
    STRATA_REQUIRE(i >= 0, "{}", too_small());
    out = static_cast<std::uint64_t>(i);
  } else if (v->is_number_float()) {
    const double d = v->get<double>();
    STRATA_REQUIRE(d < 1.8e19, "config key '{}' = {} is too large (at most 1.8e19)", key_path(key),
                   v->dump());
    STRATA_REQUIRE(d >= 0 && d == std::floor(d), "{}", too_small());
    out = static_cast<std::uint64_t>(d);
  } else {
    STRATA_THROW(kInvalidArgument, "config key '{}' must be a number, got {} {}", key_path(key),
                 type_name(*v), v->dump());
  }
  STRATA_REQUIRE(out >= min, "{}", too_small());
  return out;
}

std::int64_t Section::get_int(std::string_view key, std::int64_t def) const {
  const Json* v = raw(key);
  if (!v) return def;
  // (JSON's 18446744073709551615 is an unsigned integer; read as int64 it was -1)
  STRATA_REQUIRE(
      !v->is_number_unsigned() ||
          v->get<std::uint64_t>() <= std::uint64_t(std::numeric_limits<std::int64_t>::max()),
      "config key '{}' = {} is too large (at most 9.2e18)", key_path(key), v->dump());
  if (v->is_number_integer()) return v->get<std::int64_t>();
  if (v->is_number_float()) {
    const double d = v->get<double>();
    STRATA_REQUIRE(d == std::floor(d) && std::fabs(d) < 9e18,
                   "config key '{}' must be a whole number, got {}", key_path(key), v->dump());
    return static_cast<std::int64_t>(d);
  }
  STRATA_THROW(kInvalidArgument, "config key '{}' must be a number, got {} {}", key_path(key),
               type_name(*v), v->dump());
}

double Section::get_double(std::string_view key, double def) const {
  const Json* v = raw(key);
  if (!v) return def;
  STRATA_REQUIRE(v->is_number(), "config key '{}' must be a number, got {} {}", key_path(key),
                 type_name(*v), v->dump());
  return v->get<double>();
}

bool Section::get_bool(std::string_view key, bool def) const {
  const Json* v = raw(key);
  if (!v) return def;
  STRATA_REQUIRE(v->is_boolean(), "config key '{}' must be true or false, got {} {}", key_path(key),
                 type_name(*v), v->dump());
  return v->get<bool>();
}

std::string Section::get_string(std::string_view key, std::string_view def) const {
  const Json* v = raw(key);
  if (!v) return std::string(def);
  STRATA_REQUIRE(v->is_string(), "config key '{}' must be a string, got {} {}", key_path(key),
                 type_name(*v), v->dump());
  return v->get<std::string>();
}

std::string Section::get_choice(std::string_view key, std::string_view def,
                                std::initializer_list<std::string_view> allowed) const {
  std::string s = get_string(key, def);
  std::string list;
  for (auto a : allowed) {
    if (s == a) return s;
    list += fmt::format("{}\"{}\"", list.empty() ? "" : ", ", a);
  }
  STRATA_THROW(kInvalidArgument, "config key '{}' is \"{}\": use one of {}", key_path(key), s,
               list);
}

Section Section::child(std::string_view key) const { return Section(raw(key), key_path(key)); }

// Edits (insert, delete, substitute, swap two neighbours) from a to b, case and '-' / '_' aside.
static std::size_t edit_distance(std::string_view a, std::string_view b) {
  const auto norm = [](char ch) {
    return ch == '-' ? '_' : char(std::tolower(static_cast<unsigned char>(ch)));
  };
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const bool same = norm(a[i - 1]) == norm(b[j - 1]);
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (same ? 0 : 1)});
      if (i > 1 && j > 1 && norm(a[i - 1]) == norm(b[j - 2]) && norm(a[i - 2]) == norm(b[j - 1]))
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

template <class List>
static std::string_view nearest(std::string_view key, const List& known) {
  // Short keys are too close to each other to guess (DeepSpeed's "amp" is one edit from "aio").
  if (key.size() < 5) return {};
  const std::size_t allowed = key.size() < 8 ? 1 : 2;
  std::string_view best;
  std::size_t best_d = allowed + 1;
  for (const auto& k : known) {
    const std::size_t d = edit_distance(key, k);
    if (d < best_d) best = k, best_d = d;
  }
  return best;
}

std::string_view near_miss(std::string_view key, std::initializer_list<std::string_view> known) {
  return nearest(key, known);
}
std::string near_miss(std::string_view key, const std::vector<std::string>& known) {
  return std::string(nearest(key, known));
}

void Section::warn_unknown(std::initializer_list<std::string_view> known) const {
  if (!obj_) return;
  for (auto it = obj_->begin(); it != obj_->end(); ++it) {
    bool ok = false;
    for (auto k : known) ok = ok || it.key() == k;
    if (ok) continue;
    const std::string full = key_path(it.key());
    // A key a typo away from one strata reads is a typo: ignoring it would run with the default
    // of the setting the user meant to change.
    const std::string_view guess = near_miss(it.key(), known);
    // (Beside the key it is a typo of, it is a leftover: the setting is given, but which value
    // was meant is not known.)
    STRATA_REQUIRE(guess.empty() || obj_->contains(guess),
                   "config key '{}' is not a key strata knows; did you mean '{}'? (left as it is, "
                   "'{}' would silently keep its default)",
                   full, key_path(guess), key_path(guess));
    STRATA_REQUIRE(
        guess.empty(),
        "config key '{}' is not a key strata knows, a typo away from '{}', which is given too: "
        "remove '{}' (or merge what it holds into '{}')",
        full, key_path(guess), full, key_path(guess));
    log::warn_once("config.unknown." + full,
                   fmt::format("config key '{}' is not used by strata; ignored", full));
  }
}

}  // namespace strata::config
