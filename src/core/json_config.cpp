#include "core/json_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <unordered_set>
#include <vector>

#include "strata/error.h"
#include "strata/log.h"

namespace strata::config {

namespace {

// The deepest nesting of arrays and objects in `text` (strings skipped), counted up to `limit` + 1.
int nesting_depth(std::string_view text, int limit) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
      if (deepest > limit) break;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

// A pass over the text that refuses a key given twice in one object, naming it and the keys that
// lead to its object. (nlohmann's callback parser, which could do it while building, walks an
// object's members at the end of each object inside it: a safetensors header of 300k tensors took
// minutes.)
class UniqueKeys : public nlohmann::json_sax<Json> {
 public:
  explicit UniqueKeys(std::string_view what) : what_(what) {}
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    frames_.push_back(Frame{true, {}, {}});
    return true;
  }
  bool key(string_t& key) override {
    Frame& f = frames_.back();
    if (!f.keys.insert(key).second) {
      std::string in;
      for (std::size_t i = 0; i + 1 < frames_.size(); ++i)
        if (frames_[i].object) in += (in.empty() ? "" : ".") + frames_[i].key;
      STRATA_THROW(kInvalidArgument,
                   "{}: the key '{}' is given twice{}{}: keep one (the values would be merged "
                   "by no rule)",
                   what_, key, in.empty() ? "" : " in ", in);
    }
    f.key = key;
    return true;
  }
  bool end_object() override {
    frames_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    frames_.push_back(Frame{false, {}, {}});
    return true;
  }
  bool end_array() override {
    frames_.pop_back();
    return true;
  }
  // The parse that builds the value reports it, with the place.
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;
  }

 private:
  struct Frame {
    bool object;
    std::unordered_set<std::string> keys;
    std::string key;  // the key being read (objects)
  };
  std::string_view what_;
  std::vector<Frame> frames_;
};

}  // namespace

bool nested_too_deep(std::string_view text) {
  return nesting_depth(text, kMaxJsonDepth) > kMaxJsonDepth;
}

Json parse(std::string_view text, std::string_view what, bool duplicates_last_wins) {
  // Deeper values would overflow the stack of whatever walks them (a copy, dump(), a recursive
  // reader): no file strata reads comes near.
  STRATA_REQUIRE(!nested_too_deep(text),
                 "{}: arrays and objects nested more than {} deep: no file strata reads needs "
                 "that; the file is damaged or not the one meant",
                 what, kMaxJsonDepth);
  try {
    if (!duplicates_last_wins) {
      UniqueKeys unique(what);
      (void)Json::sax_parse(text.begin(), text.end(), &unique);
    }
    return Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {  // a syntax error; a number too large for a double
    // nlohmann's text without its "[json.exception.parse_error.101] " tag; a '}' or ']' where a
    // value was due is most often a trailing comma.
    std::string said = e.what();
    if (said.starts_with("[json.exception.")) said.erase(0, said.find("] ") + 2);
    const bool trailing = said.find("unexpected '}'") != std::string::npos ||
                          said.find("unexpected ']'") != std::string::npos;
    STRATA_THROW(kInvalidArgument, "{} is not valid JSON: {}{}", what, said,
                 trailing ? " (a comma after the last item?)" : "");
  }
}

std::optional<Json> try_parse(std::string_view text) {
  if (nested_too_deep(text)) return std::nullopt;
  Json j = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return std::nullopt;
  return j;
}

static const char* type_name(const Json& j) { return j.type_name(); }

Section::Section(const Json* obj, std::string path) : obj_(obj), path_(std::move(path)) {
  if (obj_ && obj_->is_null()) obj_ = nullptr;
  STRATA_REQUIRE(obj_ == nullptr || obj_->is_object(), "config key '{}' must be an object, got {}",
                 path_.empty() ? "(top level)" : path_, obj_ ? type_name(*obj_) : "null");
}

bool Section::has(std::string_view key) const { return raw(key) != nullptr; }

std::vector<std::string> Section::keys() const {
  std::vector<std::string> out;
  if (obj_)
    for (auto it = obj_->begin(); it != obj_->end(); ++it) out.push_back(it.key());
  return out;
}

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
    // DeepSpeed keys whose setting strata takes elsewhere: where, named.
    static const std::pair<std::string_view, std::string_view> elsewhere[] = {
        {"activation_checkpointing",
         "strata-train recomputes layers with --checkpoint-activations (its cpu_checkpointing: "
         "--checkpoint-on-host)"},
        {"wall_clock_breakdown", "strata-train --trace FILE times each step's work"},
        {"tensorboard", "strata-train --log-json FILE logs each step, --plot FILE draws them"},
        {"wandb", "strata-train --log-json FILE logs each step, --plot FILE draws them"},
    };
    std::string where;
    for (const auto& [k, w] : elsewhere)
      if (full == k) where = fmt::format(": {}", w);
    log::warn_once("config.unknown." + full,
                   fmt::format("config key '{}' is not used by strata; ignored{}", full, where));
  }
}

}  // namespace strata::config
