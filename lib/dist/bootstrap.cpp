#include "dist/bootstrap.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "core/errors.hpp"
#include "dist/transport.hpp"

namespace zeroalloc {

namespace {

using clock_type = std::chrono::steady_clock;
constexpr char kMagic[4] = {'Z', 'A', 'B', '1'};
constexpr std::uint32_t kLongestString = 1u << 20;  // an agreement or an id, far above either

class socket_fd {
 public:
  explicit socket_fd(int fd = -1) : fd_(fd) {}
  ~socket_fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  socket_fd(socket_fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  socket_fd& operator=(socket_fd&& other) noexcept {
    if (this != &other) {
      if (fd_ >= 0) ::close(fd_);
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  [[nodiscard]] int get() const { return fd_; }

 private:
  int fd_;
};

int remaining_ms(clock_type::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_type::now());
  return static_cast<int>(std::clamp<std::int64_t>(left.count(), 0, 1 << 30));
}

/// Waits until `fd` is ready for `events`; false at the deadline.
bool wait_ready(int fd, short events, clock_type::time_point deadline) {
  for (;;) {
    pollfd waited{fd, events, 0};
    const int ready = ::poll(&waited, 1, remaining_ms(deadline));
    if (ready > 0) return true;
    if (ready == 0) return false;
    if (errno != EINTR) return false;
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

bool send_string(int fd, const std::string& text, clock_type::time_point deadline) {
  return send_u32(fd, static_cast<std::uint32_t>(text.size()), deadline) &&
         send_all(fd, text.data(), text.size(), deadline);
}

std::optional<std::string> receive_string(int fd, clock_type::time_point deadline) {
  const std::optional<std::uint32_t> size = receive_u32(fd, deadline);
  if (!size || *size > kLongestString) return std::nullopt;
  std::string text(*size, '\0');
  if (!receive_all(fd, text.data(), text.size(), deadline)) return std::nullopt;
  return text;
}

std::string endpoint(const bootstrap_settings& settings) {
  return settings.address + ":" + std::to_string(settings.port);
}

std::string prefix(const bootstrap_settings& settings) {
  return "bootstrap of " + std::to_string(settings.world_size) + " ranks at " + endpoint(settings) +
         ": ";
}

socket_fd listen_on(const bootstrap_settings& settings) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(settings.port);
  if (const int failed = ::getaddrinfo(nullptr, port.c_str(), &hints, &found); failed != 0) {
    ZA_THROW(collective_error, prefix(settings), "rank 0 cannot listen: ", ::gai_strerror(failed));
  }
  int last_error = 0;
  socket_fd listening;
  for (addrinfo* each = found; each != nullptr; each = each->ai_next) {
    socket_fd candidate(::socket(each->ai_family, each->ai_socktype | SOCK_CLOEXEC, 0));
    if (candidate.get() < 0) {
      last_error = errno;
      continue;
    }
    const int yes = 1;
    ::setsockopt(candidate.get(), SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    if (::bind(candidate.get(), each->ai_addr, each->ai_addrlen) == 0 &&
        ::listen(candidate.get(), settings.world_size) == 0) {
      listening = std::move(candidate);
      break;
    }
    last_error = errno;
  }
  ::freeaddrinfo(found);
  if (listening.get() < 0) {
    ZA_THROW(collective_error, prefix(settings), "rank 0 cannot listen on port ", settings.port,
             ": ", std::strerror(last_error),
             "; another program holds it, or the last job has not let it go");
  }
  return listening;
}

/// Rank 0's side: the others' hellos, checked, then every rank's answer.
std::string serve(const bootstrap_settings& settings, const std::function<std::string()>& make_id) {
  auto deadline = clock_type::now() + settings.timeout;
  std::string id;
  std::string failure;  // the one cause every rank gets
  try {
    id = make_id();
  } catch (const std::exception& error) {
    failure = std::string("rank 0 could not make the group's id: ") + error.what();
  }
  const socket_fd listening = listen_on(settings);
  std::vector<socket_fd> peers;
  std::vector<bool> came(static_cast<std::size_t>(settings.world_size), false);
  came[0] = true;
  int joined = 1;
  auto answer = [&](const socket_fd& peer) {
    const auto reply_by = clock_type::now() + std::chrono::seconds(5);
    if (!send_u32(peer.get(), failure.empty() ? 0 : 1, reply_by)) return;
    send_string(peer.get(), failure.empty() ? id : failure, reply_by);
  };
  while (joined < settings.world_size) {
    if (!wait_ready(listening.get(), POLLIN, deadline)) break;
    socket_fd peer(::accept4(listening.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (peer.get() < 0) continue;
    const int yes = 1;
    ::setsockopt(peer.get(), IPPROTO_TCP, TCP_NODELAY, &yes, sizeof yes);
    char magic[sizeof kMagic] = {};
    const bool greeted = receive_all(peer.get(), magic, sizeof magic, deadline) &&
                         std::memcmp(magic, kMagic, sizeof kMagic) == 0;
    const std::optional<std::uint32_t> rank =
        greeted ? receive_u32(peer.get(), deadline) : std::nullopt;
    const std::optional<std::uint32_t> world =
        rank ? receive_u32(peer.get(), deadline) : std::nullopt;
    const std::optional<std::string> agreement =
        world ? receive_string(peer.get(), deadline) : std::nullopt;
    if (!agreement) continue;  // not one of ours, or gone: it does not count
    const int who = static_cast<int>(*rank);
    if (failure.empty()) {
      if (static_cast<int>(*world) != settings.world_size) {
        failure = "rank " + std::to_string(who) + " says the world has " + std::to_string(*world) +
                  " ranks, rank 0 says " + std::to_string(settings.world_size) +
                  " (WORLD_SIZE differs between ranks)";
      } else if (who <= 0 || who >= settings.world_size) {
        failure = "a rank says it is rank " + std::to_string(who) + " of " +
                  std::to_string(settings.world_size) + " (RANK out of range)";
      } else if (came[static_cast<std::size_t>(who)]) {
        failure = "rank " + std::to_string(who) +
                  " joined twice (two processes with RANK=" + std::to_string(who) + ")";
      } else if (*agreement != settings.agreement) {
        failure = "rank " + std::to_string(who) + " has settings '" + *agreement +
                  "' where rank 0 has '" + settings.agreement +
                  "': every rank must run with the same settings";
      }
    }
    if (who > 0 && who < settings.world_size && !came[static_cast<std::size_t>(who)]) {
      came[static_cast<std::size_t>(who)] = true;
      ++joined;
    }
    if (!failure.empty()) {  // the ranks that came so far learn it now, the others as they come
      for (const socket_fd& earlier : peers) answer(earlier);
      peers.clear();
      answer(peer);
      // The job ends anyway: the ranks still starting get a few seconds to hear why.
      deadline = std::min(deadline, clock_type::now() + std::chrono::seconds(5));
      continue;
    }
    peers.push_back(std::move(peer));
  }
  if (failure.empty() && joined < settings.world_size) {
    std::string missing;
    for (int rank = 1; rank < settings.world_size; ++rank) {
      if (!came[static_cast<std::size_t>(rank)]) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(rank);
      }
    }
    failure = "rank(s) " + missing + " did not join within " +
              std::to_string(settings.timeout.count()) + " ms";
  }
  for (const socket_fd& peer : peers) answer(peer);
  if (!failure.empty()) ZA_THROW(collective_error, prefix(settings), failure);
  return id;
}

socket_fd connect_to_rank0(const bootstrap_settings& settings, clock_type::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string port = std::to_string(settings.port);
  std::string last = "no answer";
  for (;;) {
    addrinfo* found = nullptr;
    if (const int failed = ::getaddrinfo(settings.address.c_str(), port.c_str(), &hints, &found);
        failed != 0) {
      last = std::string("MASTER_ADDR does not resolve: ") + ::gai_strerror(failed);
    } else {
      for (addrinfo* each = found; each != nullptr; each = each->ai_next) {
        socket_fd candidate(::socket(each->ai_family, each->ai_socktype | SOCK_CLOEXEC, 0));
        if (candidate.get() >= 0 &&
            ::connect(candidate.get(), each->ai_addr, each->ai_addrlen) == 0) {
          ::freeaddrinfo(found);
          const int yes = 1;
          ::setsockopt(candidate.get(), IPPROTO_TCP, TCP_NODELAY, &yes, sizeof yes);
          return candidate;
        }
        last = std::strerror(errno);
      }
      ::freeaddrinfo(found);
    }
    if (clock_type::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // rank 0 may start later
  }
  ZA_THROW(collective_error, prefix(settings), "rank ", settings.rank,
           " could not reach rank 0 within ", settings.timeout.count(), " ms (", last,
           "): is rank 0 running, and is MASTER_ADDR its host?");
}

std::string join(const bootstrap_settings& settings) {
  const auto deadline = clock_type::now() + settings.timeout;
  const socket_fd peer = connect_to_rank0(settings, deadline);
  const bool said =
      send_all(peer.get(), kMagic, sizeof kMagic, deadline) &&
      send_u32(peer.get(), static_cast<std::uint32_t>(settings.rank), deadline) &&
      send_u32(peer.get(), static_cast<std::uint32_t>(settings.world_size), deadline) &&
      send_string(peer.get(), settings.agreement, deadline);
  // Rank 0 answers once every rank came: up to its own timeout, started no later than ours.
  const auto answer_by = deadline + std::chrono::seconds(10);
  const std::optional<std::uint32_t> status =
      said ? receive_u32(peer.get(), answer_by) : std::nullopt;
  const std::optional<std::string> payload =
      status ? receive_string(peer.get(), answer_by) : std::nullopt;
  if (!payload) {
    ZA_THROW(collective_error, prefix(settings), "rank ", settings.rank,
             " reached rank 0 but had no answer: rank 0 failed or stopped");
  }
  if (*status != 0) ZA_THROW(collective_error, prefix(settings), *payload);
  return *payload;
}

int integer_variable(const char* name, std::optional<int> fallback, int lowest) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') {
    if (fallback) return *fallback;
    ZA_THROW(config_error, name,
             " is not set: ZeRO across ranks runs under torchrun (or a "
             "launcher that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT)");
  }
  char* end = nullptr;
  errno = 0;
  const long value = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || value < lowest || value > 1 << 24) {
    ZA_THROW(config_error, name, "='", text, "' is not a whole number of at least ", lowest);
  }
  return static_cast<int>(value);
}

}  // namespace

bootstrap_settings bootstrap_settings::from_environment(std::string agreement, int port) {
  bootstrap_settings settings;
  settings.world_size = integer_variable("WORLD_SIZE", std::nullopt, 1);
  settings.rank = integer_variable("RANK", std::nullopt, 0);
  if (settings.rank >= settings.world_size) {
    ZA_THROW(config_error, "RANK=", settings.rank,
             " is not below WORLD_SIZE=", settings.world_size);
  }
  settings.local_rank = integer_variable("LOCAL_RANK", 0, 0);
  const char* address = std::getenv("MASTER_ADDR");
  if (address == nullptr || *address == '\0') {
    ZA_THROW(config_error,
             "MASTER_ADDR is not set: the ranks find rank 0 there (torchrun "
             "sets it)");
  }
  settings.address = address;
  const int master_port = integer_variable("MASTER_PORT", std::nullopt, 1);
  settings.port = port != 0 ? port : master_port + 1;
  if (settings.port > 65535) {
    ZA_THROW(config_error, "MASTER_PORT=", master_port,
             ": the bootstrap's port, MASTER_PORT + 1, is not a TCP port");
  }
  settings.agreement = std::move(agreement);
  return settings;
}

std::string bootstrap_exchange(const bootstrap_settings& settings,
                               const std::function<std::string()>& make_id) {
  if (settings.world_size < 1 || settings.rank < 0 || settings.rank >= settings.world_size) {
    ZA_THROW(invalid_argument, "rank ", settings.rank, " of a group of ", settings.world_size);
  }
  if (settings.world_size == 1) return make_id();
  return settings.rank == 0 ? serve(settings, make_id) : join(settings);
}

}  // namespace zeroalloc
