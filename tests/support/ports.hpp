// A TCP port for tests whose ranks meet over the loopback interface.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

namespace zeroalloc::testing {

/// A port nothing listens on now, below the kernel's range for outgoing connections
/// (32768 and up), so that no test's client takes it before rank 0 listens there.
inline int free_port() {
  static std::atomic<unsigned> seed{static_cast<unsigned>(::getpid()) * 7919u};
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const int port = 20000 + static_cast<int>((seed += 2654435761u) % 12000u);
    const int probe = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_ANY);
    address.sin_port = htons(static_cast<std::uint16_t>(port));
    const bool free = ::bind(probe, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0;
    ::close(probe);
    if (free) return port;
  }
  return 0;
}

}  // namespace zeroalloc::testing
