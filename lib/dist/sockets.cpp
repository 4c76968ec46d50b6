#include "dist/sockets.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

namespace zeroalloc::sockets {

socket_fd::~socket_fd() {
  if (fd_ >= 0) ::close(fd_);
}

socket_fd& socket_fd::operator=(socket_fd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

namespace {

// Rounded up: poll() must not return before the deadline (a wait cut short by the rounding
// would read as a closed connection to callers that compare the time with the deadline).
int remaining_ms(clock_type::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - clock_type::now());
  return static_cast<int>(std::clamp<std::int64_t>(left.count(), 0, 1 << 30));
}

// Connected sockets never block: every wait is a poll with the caller's deadline (a send
// that blocked in the kernel would outlive any timeout once the peer stops reading).
void no_delay_no_block(int fd) {
  const int yes = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof yes);
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
}

/// connect() bounded by the deadline (a host that drops SYNs would take minutes).
bool connect_by(int fd, const sockaddr* address, socklen_t length, clock_type::time_point deadline,
                std::string& error) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  if (::connect(fd, address, length) == 0) return true;
  if (errno != EINPROGRESS) {
    error = std::strerror(errno);
    return false;
  }
  if (!wait_ready(fd, POLLOUT, deadline)) {
    error = "timed out";
    return false;
  }
  int failure = 0;
  socklen_t size = sizeof failure;
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &failure, &size) != 0 || failure != 0) {
    error = std::strerror(failure != 0 ? failure : errno);
    return false;
  }
  return true;
}

}  // namespace

bool wait_ready(int fd, short events, clock_type::time_point deadline) {
  for (;;) {
    pollfd waited{fd, events, 0};
    const int ready = ::poll(&waited, 1, remaining_ms(deadline));
    if (ready > 0) return true;
    if (ready == 0 && clock_type::now() >= deadline) return false;
    if (ready < 0 && errno != EINTR) return false;
  }
}

bool send_all(int fd, const void* data, std::size_t bytes, clock_type::time_point deadline) {
  const char* at = static_cast<const char*>(data);
  while (bytes > 0) {
    if (!wait_ready(fd, POLLOUT, deadline)) return false;
    const ssize_t sent = ::send(fd, at, bytes, MSG_NOSIGNAL);
    if (sent < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (sent <= 0) return false;
    at += sent;
    bytes -= static_cast<std::size_t>(sent);
  }
  return true;
}

bool receive_all(int fd, void* data, std::size_t bytes, clock_type::time_point deadline) {
  char* at = static_cast<char*>(data);
  while (bytes > 0) {
    if (!wait_ready(fd, POLLIN, deadline)) return false;
    const ssize_t got = ::recv(fd, at, bytes, 0);
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (got <= 0) return false;  // closed, or failed
    at += got;
    bytes -= static_cast<std::size_t>(got);
  }
  return true;
}

bool send_u32(int fd, std::uint32_t value, clock_type::time_point deadline) {
  const std::uint32_t wire = htonl(value);
  return send_all(fd, &wire, sizeof wire, deadline);
}

std::optional<std::uint32_t> receive_u32(int fd, clock_type::time_point deadline) {
  std::uint32_t wire = 0;
  if (!receive_all(fd, &wire, sizeof wire, deadline)) return std::nullopt;
  return ntohl(wire);
}

bool send_u64(int fd, std::uint64_t value, clock_type::time_point deadline) {
  return send_u32(fd, static_cast<std::uint32_t>(value >> 32), deadline) &&
         send_u32(fd, static_cast<std::uint32_t>(value), deadline);
}

std::optional<std::uint64_t> receive_u64(int fd, clock_type::time_point deadline) {
  const std::optional<std::uint32_t> high = receive_u32(fd, deadline);
  const std::optional<std::uint32_t> low = high ? receive_u32(fd, deadline) : std::nullopt;
  if (!low) return std::nullopt;
  return (static_cast<std::uint64_t>(*high) << 32) | *low;
}

bool send_string(int fd, const std::string& text, clock_type::time_point deadline) {
  return send_u64(fd, text.size(), deadline) && send_all(fd, text.data(), text.size(), deadline);
}

std::optional<std::string> receive_string(int fd, clock_type::time_point deadline,
                                          std::uint64_t longest) {
  const std::optional<std::uint64_t> size = receive_u64(fd, deadline);
  if (!size || *size > longest) return std::nullopt;
  std::string text(*size, '\0');
  if (!receive_all(fd, text.data(), text.size(), deadline)) return std::nullopt;
  return text;
}

bool send_hello(int fd, const char* magic, int rank, int world_size,
                clock_type::time_point deadline) {
  return send_all(fd, magic, 4, deadline) &&
         send_u32(fd, static_cast<std::uint32_t>(rank), deadline) &&
         send_u32(fd, static_cast<std::uint32_t>(world_size), deadline);
}

std::optional<hello> receive_hello(int fd, const char* magic, clock_type::time_point deadline) {
  hello said;
  said.by = std::min(deadline, clock_type::now() + std::chrono::seconds(5));
  char got[4] = {};
  if (!receive_all(fd, got, sizeof got, said.by) || std::memcmp(got, magic, sizeof got) != 0) {
    return std::nullopt;
  }
  const std::optional<std::uint32_t> rank = receive_u32(fd, said.by);
  const std::optional<std::uint32_t> world = rank ? receive_u32(fd, said.by) : std::nullopt;
  if (!world) return std::nullopt;
  said.rank = *rank;
  said.world_size = *world;
  return said;
}

socket_fd listen_on(int port, int backlog, std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (const int failed = ::getaddrinfo(nullptr, service.c_str(), &hints, &found); failed != 0) {
    error = ::gai_strerror(failed);
    return socket_fd();
  }
  socket_fd listening;
  for (addrinfo* each = found; each != nullptr; each = each->ai_next) {
    socket_fd candidate(::socket(each->ai_family, each->ai_socktype | SOCK_CLOEXEC, 0));
    if (!candidate.valid()) {
      error = std::strerror(errno);
      continue;
    }
    const int yes = 1;
    ::setsockopt(candidate.get(), SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    if (::bind(candidate.get(), each->ai_addr, each->ai_addrlen) == 0 &&
        ::listen(candidate.get(), backlog) == 0) {
      listening = std::move(candidate);
      break;
    }
    error = std::strerror(errno);
  }
  ::freeaddrinfo(found);
  return listening;
}

socket_fd connect_until(const std::string& address, int port, clock_type::time_point deadline,
                        std::string& error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string service = std::to_string(port);
  error = "no answer";
  for (;;) {
    addrinfo* found = nullptr;
    if (const int failed = ::getaddrinfo(address.c_str(), service.c_str(), &hints, &found);
        failed != 0) {
      error = std::string("the address does not resolve: ") + ::gai_strerror(failed);
    } else {
      for (addrinfo* each = found; each != nullptr; each = each->ai_next) {
        socket_fd candidate(::socket(each->ai_family, each->ai_socktype | SOCK_CLOEXEC, 0));
        if (!candidate.valid()) {
          error = std::strerror(errno);
          continue;
        }
        if (connect_by(candidate.get(), each->ai_addr, each->ai_addrlen, deadline, error)) {
          ::freeaddrinfo(found);
          no_delay_no_block(candidate.get());
          return candidate;
        }
      }
      ::freeaddrinfo(found);
    }
    if (clock_type::now() >= deadline) return socket_fd();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the listener may start later
  }
}

void hang_up(int fd) {
  if (fd >= 0) ::shutdown(fd, SHUT_RDWR);
}

socket_fd accept_until(int listening, clock_type::time_point deadline) {
  while (wait_ready(listening, POLLIN, deadline)) {
    socket_fd peer(::accept4(listening, nullptr, nullptr, SOCK_CLOEXEC));
    if (peer.valid()) {
      no_delay_no_block(peer.get());
      return peer;
    }
  }
  return socket_fd();
}

}  // namespace zeroalloc::sockets
