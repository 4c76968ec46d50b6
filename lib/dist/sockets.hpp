// TCP between the ranks of a job on the host: what the bootstrap (Note [Bootstrap]) and the
// simulated device's TCP transport send. Every call takes a deadline and says whether it
// made it; the callers name what failed.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace zeroalloc::sockets {

using clock_type = std::chrono::steady_clock;

/// A socket, closed with its owner.
class socket_fd {
 public:
  explicit socket_fd(int fd = -1) : fd_(fd) {}
  ~socket_fd();
  socket_fd(socket_fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  socket_fd& operator=(socket_fd&& other) noexcept;
  socket_fd(const socket_fd&) = delete;
  socket_fd& operator=(const socket_fd&) = delete;
  [[nodiscard]] int get() const { return fd_; }
  [[nodiscard]] bool valid() const { return fd_ >= 0; }

 private:
  int fd_;
};

/// Waits until `fd` is ready for `events` (poll's); false at the deadline.
bool wait_ready(int fd, short events, clock_type::time_point deadline);
bool send_all(int fd, const void* data, std::size_t bytes, clock_type::time_point deadline);
bool receive_all(int fd, void* data, std::size_t bytes, clock_type::time_point deadline);
bool send_u32(int fd, std::uint32_t value, clock_type::time_point deadline);
std::optional<std::uint32_t> receive_u32(int fd, clock_type::time_point deadline);
bool send_u64(int fd, std::uint64_t value, clock_type::time_point deadline);
std::optional<std::uint64_t> receive_u64(int fd, clock_type::time_point deadline);
/// A length, then the bytes.
bool send_string(int fd, const std::string& text, clock_type::time_point deadline);
/// Nothing when the peer closed, the deadline passed, or the length exceeds `longest`.
std::optional<std::string> receive_string(int fd, clock_type::time_point deadline,
                                          std::uint64_t longest = 1u << 20);

/// A rank's greeting: `magic` (4 bytes, one per protocol), its rank and the world size.
bool send_hello(int fd, const char* magic, int rank, int world_size,
                clock_type::time_point deadline);
struct hello {
  std::uint32_t rank = 0;
  std::uint32_t world_size = 0;
  clock_type::time_point by;  ///< the greeting's deadline: what follows it is read by then
};
/// A greeting with `magic`, read within 5 s and the deadline: a connection that says
/// nothing (not one of ours) must not hold up the ranks behind it. Nothing when it is not
/// one, or came too late.
std::optional<hello> receive_hello(int fd, const char* magic, clock_type::time_point deadline);

/// A socket listening on `port` of every interface; on failure, an invalid one and the
/// reason in `error`.
socket_fd listen_on(int port, int backlog, std::string& error);
/// Connects to `address`:`port`, retrying until the deadline (the listener may start
/// later); on failure, an invalid socket and the last reason in `error`.
socket_fd connect_until(const std::string& address, int port, clock_type::time_point deadline,
                        std::string& error);
/// Ends the connection both ways: the peer's next read or write fails at once.
void hang_up(int fd);
/// The next connection to `listening` before the deadline, or an invalid socket.
socket_fd accept_until(int listening, clock_type::time_point deadline);

}  // namespace zeroalloc::sockets
