#include "dist/bootstrap.hpp"

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
#include "dist/sockets.hpp"
#include "dist/transport.hpp"

namespace zeroalloc {

namespace {

using namespace sockets;
constexpr char kMagic[4] = {'Z', 'A', 'B', '1'};

std::string endpoint(const bootstrap_settings& settings) {
  return settings.address + ":" + std::to_string(settings.port);
}

std::string prefix(const bootstrap_settings& settings) {
  return "bootstrap of " + std::to_string(settings.world_size) + " ranks at " + endpoint(settings) +
         ": ";
}

socket_fd listen_for_ranks(const bootstrap_settings& settings) {
  std::string error;
  socket_fd listening = listen_on(settings.port, settings.world_size, error);
  if (!listening.valid()) {
    ZA_THROW(collective_error, prefix(settings), "rank 0 cannot listen on port ", settings.port,
             ": ", error, "; another program holds it, or the last job has not let it go");
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
  const socket_fd listening = listen_for_ranks(settings);
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
    socket_fd peer = accept_until(listening.get(), deadline);
    if (!peer.valid()) break;
    const std::optional<hello> greeting = receive_hello(peer.get(), kMagic, deadline);
    const std::optional<std::string> agreement =
        greeting ? receive_string(peer.get(), greeting->by) : std::nullopt;
    if (!agreement) continue;  // not one of ours, or gone: it does not count
    const std::uint32_t world = greeting->world_size;
    const int who = static_cast<int>(greeting->rank);
    if (failure.empty()) {
      if (static_cast<int>(world) != settings.world_size) {
        failure = "rank " + std::to_string(who) + " says the world has " + std::to_string(world) +
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
  std::string last;
  socket_fd peer = connect_until(settings.address, settings.port, deadline, last);
  if (!peer.valid()) {
    ZA_THROW(collective_error, prefix(settings), "rank ", settings.rank,
             " could not reach rank 0 within ", settings.timeout.count(), " ms (", last,
             "): is rank 0 running, and is MASTER_ADDR its host?");
  }
  return peer;
}

std::string join(const bootstrap_settings& settings) {
  const auto deadline = clock_type::now() + settings.timeout;
  const socket_fd peer = connect_to_rank0(settings, deadline);
  const bool said = send_hello(peer.get(), kMagic, settings.rank, settings.world_size, deadline) &&
                    send_string(peer.get(), settings.agreement, deadline);
  // Rank 0 answers once every rank came, up to its own timeout, which starts when it
  // arrives: later than ours, when it came last.
  const auto answer_by = deadline + settings.timeout + std::chrono::seconds(10);
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
