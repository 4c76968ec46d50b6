// Typed errors raised inside the library. Nothing here crosses the C ABI: lib/capi catches
// every exception and turns it into a return value plus zeroalloc_last_error().
#pragma once

#include <stdexcept>
#include <string>

namespace zeroalloc {

/// Base of every error the library raises.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A ZEROALLOC_* variable (or an equivalent programmatic setting) is malformed.
/// The message names the variable, the value and the accepted form.
class config_error : public error {
 public:
  using error::error;
};

/// An error that carries the failing call's own code (a CUresult, an errno value).
class coded_error : public error {
 public:
  coded_error(const std::string& message, int code) : error(message), code_(code) {}
  [[nodiscard]] int code() const noexcept { return code_; }

 private:
  int code_;
};

/// A device (CUDA driver or simulated) call failed. The message names the call and the
/// driver's own error string; code() is the driver's result code (CUresult), or an errno
/// value for the simulated device.
class device_error : public coded_error {
 public:
  using coded_error::coded_error;
};

/// The CUDA driver is missing or unusable (no libcuda, no GPU). Distinct from device_error
/// so that callers can fall back or explain instead of treating it as a bug.
class no_driver_error : public error {
 public:
  using error::error;
};

/// An allocation could not be served. The message follows Note [Out-of-memory message]
/// in lib/alloc/caching_allocator.cpp.
class out_of_memory : public error {
 public:
  using error::error;
};

/// A caller passed something the library cannot accept (foreign pointer, bad device index).
class invalid_argument : public error {
 public:
  using error::error;
};

/// A device index that names no device the library drives.
class no_such_device : public invalid_argument {
 public:
  using invalid_argument::invalid_argument;
};

}  // namespace zeroalloc

/// Throws `type` with a message built by streaming the remaining arguments.
#define ZA_THROW(type, ...)                               \
  do {                                                    \
    throw type(::zeroalloc::detail::concat(__VA_ARGS__)); \
  } while (0)

/// Checks a condition that callers can violate; throws invalid_argument when it fails.
#define ZA_REQUIRE(condition, ...)                                          \
  do {                                                                      \
    if (!(condition)) ZA_THROW(::zeroalloc::invalid_argument, __VA_ARGS__); \
  } while (0)

#include <sstream>

namespace zeroalloc::detail {
template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}
}  // namespace zeroalloc::detail
