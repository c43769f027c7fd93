// Typed access to DeepSpeed-style JSON config sections, with errors that name the key.
// Numbers may be written as 5e8 or 500000000 (both accepted where an integer is meant);
// a wrong type stops with the key, what was found and what is allowed; unknown keys warn
// once (a user's ds_config.json carries keys strata does not use).
// Parsing and the near-miss rule are public: strata/json_config.h.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "strata/json_config.h"

namespace strata::config {

class Section {
 public:
  // `obj` may be null (every key takes its default) or an object; anything else throws.
  Section(const Json* obj, std::string path);

  bool has(std::string_view key) const;
  std::vector<std::string> keys() const;  // the object's keys (none for a null section)
  // "aio.block_size": the full key for messages.
  std::string key_path(std::string_view key) const;

  // A whole number >= `min` (5e8 as a float too), or `def` when the key is absent; an error
  // naming the key and the range otherwise.
  std::uint64_t get_uint(std::string_view key, std::uint64_t def, std::uint64_t min = 0) const;
  std::int64_t get_int(std::string_view key, std::int64_t def) const;
  double get_double(std::string_view key, double def) const;
  bool get_bool(std::string_view key, bool def) const;
  std::string get_string(std::string_view key, std::string_view def) const;
  // A string restricted to `allowed`.
  std::string get_choice(std::string_view key, std::string_view def,
                         std::initializer_list<std::string_view> allowed) const;
  Section child(std::string_view key) const;
  const Json* raw(std::string_view key) const;

  // Warns once per unknown key; refuses one a typo away from a known key (did you mean ...).
  void warn_unknown(std::initializer_list<std::string_view> known) const;

 private:
  const Json* obj_;
  std::string path_;
};

}  // namespace strata::config
