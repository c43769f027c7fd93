// UTF-8 as strata reads text from anywhere (trace names, a tokenizer's input and output):
// well-formed sequences as Unicode defines them — no overlong forms, surrogates or code points
// above U+10FFFF.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace strata::utf8 {

// The length of the well-formed sequence at s[i] (1 for ASCII), or 0 when the bytes there are not
// one (a bad lead or continuation byte, or cut off by the end of `s`); then *bad, when given, is
// the length of its longest valid prefix (at least 1), which a lossy decoder replaces by one
// U+FFFD (Unicode's "maximal subpart" practice, as Python's errors="replace" does).
std::size_t sequence_length(std::string_view s, std::size_t i, std::size_t* bad = nullptr);

// The byte at which `s` stops being well-formed UTF-8, or std::string_view::npos when it is.
std::size_t first_invalid(std::string_view s);

// The longest prefix of `s` of at most `max_bytes` that ends on a character's edge (an ill-formed
// byte counts as one): a name cut to fit a file name's length.
std::string_view prefix(std::string_view s, std::size_t max_bytes);

// `s` with each ill-formed sequence (its maximal subpart) replaced by one U+FFFD: text any JSON or
// XML writer takes (a byte-level model's sample, a title given in Latin-1).
std::string lossy(std::string_view s);

}  // namespace strata::utf8
