// Writing JSON strings: the library's JSON outputs (statistics, snapshots, options) are
// written by hand, small and flat; this is the one piece they share.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>

namespace zeroalloc {

/// `text` as a quoted JSON string, with quotes, backslashes and control characters escaped.
inline std::string json_quote(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\u%04x", static_cast<unsigned>(c));
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

}  // namespace zeroalloc
