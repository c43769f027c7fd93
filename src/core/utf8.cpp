#include "core/utf8.h"

namespace strata::utf8 {

std::size_t sequence_length(std::string_view s, std::size_t i, std::size_t* bad) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return 1;
  std::size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  }
  std::size_t k = 1;
  for (; k < n && i + k < s.size(); ++k) {
    const auto x = static_cast<unsigned char>(s[i + k]);
    if (x < (k == 1 ? lo : 0x80) || x > (k == 1 ? hi : 0xBF)) break;
  }
  if (n > 0 && k == n) return n;
  if (bad) *bad = k;
  return 0;
}

std::size_t first_invalid(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = sequence_length(s, i);
    if (n == 0) return i;
    i += n;
  }
  return std::string_view::npos;
}

std::string_view prefix(std::string_view s, std::size_t max_bytes) {
  std::size_t end = 0;
  while (end < s.size()) {
    const std::size_t n = std::max<std::size_t>(1, sequence_length(s, end));
    if (end + n > max_bytes) break;
    end += n;
  }
  return s.substr(0, end);
}

std::string lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    std::size_t bad = 0;
    const std::size_t n = sequence_length(s, i, &bad);
    if (n > 0) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out.append("\xEF\xBF\xBD");  // U+FFFD
      i += bad;
    }
  }
  return out;
}

}  // namespace strata::utf8
