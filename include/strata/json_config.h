// Reading JSON the way strata reads its configuration files: a parse error that names the
// source and the place, and the near-miss rule behind every "did you mean ...?" (a config key,
// a command-line flag a typo away from a known one). The typed reading of a DeepSpeed-style
// config itself is parse_engine_config (strata/engine_config.h).
#pragma once

#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace strata::config {

using Json = nlohmann::json;

// Arrays and objects nested deeper than this are refused by parse (try_parse: nullopt): walking
// them (a copy, dump()) would overflow the stack.
inline constexpr int kMaxJsonDepth = 512;

// Parses JSON text; `what` names its source ("ds_config.json") in the error (kInvalidArgument,
// with the line and column). A key given twice in one object is refused, naming it and where, as
// DeepSpeed refuses it in a ds_config; with `duplicates_last_wins` the last one is taken, as
// Python's json (and so Hugging Face) reads a model's config.json. Every file strata reads is
// parsed here (or by try_parse).
Json parse(std::string_view text, std::string_view what, bool duplicates_last_wins = false);

// Whether `text` nests arrays and objects deeper than kMaxJsonDepth (for a reader with its own
// message; parse and try_parse check it).
bool nested_too_deep(std::string_view text);

// The value of `text`, or nullopt where it is not JSON or nests deeper than kMaxJsonDepth (a
// line of a log read as far as it is whole). A key given twice: the last wins.
std::optional<Json> try_parse(std::string_view text);

// The key of `known` at most one edit (keys under 8 characters) or two (longer) away from
// `key`, case and '-' / '_' aside; empty when none is, or `key` is under 5 characters.
std::string_view near_miss(std::string_view key, std::initializer_list<std::string_view> known);
std::string near_miss(std::string_view key, const std::vector<std::string>& known);

}  // namespace strata::config
