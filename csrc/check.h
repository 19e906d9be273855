// Argument checks of the torch-free sources (copy engine, file tier, host arena, SIMD dispatch): a
// failed check throws std::runtime_error, which Python sees as a RuntimeError carrying the message,
// as it sees TORCH_CHECK's c10::Error. The parts are joined as TORCH_CHECK joins strings, characters
// and integers (the only parts these messages hold).
#pragma once

#include <stdexcept>
#include <string>
#include <type_traits>

namespace pystronghold {
namespace check_detail {

inline void append(std::string& out, const std::string& text) { out += text; }
inline void append(std::string& out, const char* text) { out += text; }
inline void append(std::string& out, char c) { out += c; }
template <typename Int, std::enable_if_t<std::is_integral_v<Int>, int> = 0>
void append(std::string& out, Int value) {
  out += std::to_string(value);
}

}  // namespace check_detail

template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::string message;
  (check_detail::append(message, parts), ...);
  throw std::runtime_error(message);
}

}  // namespace pystronghold

// PS_CHECK(condition, message parts...): a caller's error when the condition is false.
#define PS_CHECK(condition, ...)                                   \
  do {                                                             \
    if (!(condition)) ::pystronghold::fail(__VA_ARGS__);           \
  } while (0)
