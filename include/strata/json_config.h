// Reading JSON the way strata reads its configuration files: a parse error that names the
// source and the place, and the near-miss rule behind every "did you mean ...?" (a config key,
// a command-line flag a typo away from a known one). The typed reading of a DeepSpeed-style
// config itself is parse_engine_config (strata/engine_config.h).
#pragma once

#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace strata::config {

using Json = nlohmann::json;

// Parses JSON text; `what` names its source ("ds_config.json") in the error (kInvalidArgument,
// with the line and column). A key given twice in one object is refused, naming it and where, as
// DeepSpeed refuses it in a ds_config; with `duplicates_last_wins` the last one is taken, as
// Python's json (and so Hugging Face) reads a model's config.json.
Json parse(std::string_view text, std::string_view what, bool duplicates_last_wins = false);

// The key of `known` at most one edit (keys under 8 characters) or two (longer) away from
// `key`, case and '-' / '_' aside; empty when none is, or `key` is under 5 characters.
std::string_view near_miss(std::string_view key, std::initializer_list<std::string_view> known);
std::string near_miss(std::string_view key, const std::vector<std::string>& known);

}  // namespace strata::config
