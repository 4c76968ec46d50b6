#include "dist/tcp_transport.hpp"

#include <algorithm>

#include "core/errors.hpp"
#include "dist/reduction.hpp"

namespace zeroalloc {

namespace {

using namespace sockets;
constexpr char kMagic[4] = {'Z', 'A', 'T', '1'};
constexpr std::uint32_t kCollective = 0;
constexpr std::uint32_t kAbort = 1;
constexpr std::uint64_t kLongestInput = std::uint64_t(1) << 36;

const char* name_of(std::uint32_t what) {
  switch (what) {
    case 0:
      return "all_gather";
    case 1:
      return "reduce_scatter";
    case 2:
      return "broadcast";
    case 3:
      return "reduce";
    default:
      return "an unknown collective";
  }
}

}  // namespace

std::string tcp_transport::call::describe() const {
  std::string text = name_of(static_cast<std::uint32_t>(what));
  if (what == kind::reduce_scatter) {
    return text + " of " + std::to_string(bytes) +
           (type == element_type::float32 ? " float32" : " bfloat16") + " per rank";
  }
  if (what == kind::reduce) {
    return text + " of " + std::to_string(bytes) +
           (type == element_type::float32 ? " float32" : " bfloat16") + " to rank " +
           std::to_string(root);
  }
  text += " of " + std::to_string(bytes) + " bytes";
  if (what == kind::broadcast) text += " from rank " + std::to_string(root);
  return text;
}

tcp_transport::tcp_transport(device& backing, const bootstrap_settings& settings,
                             std::optional<std::chrono::milliseconds> collective_timeout)
    : device_(backing),
      settings_(settings),
      collective_timeout_(collective_timeout.value_or(settings.timeout)) {
  if (settings.world_size < 1 || settings.rank < 0 || settings.rank >= settings.world_size) {
    ZA_THROW(invalid_argument, "rank ", settings.rank, " of a group of ", settings.world_size);
  }
  if (settings.world_size == 1) return;
  const auto deadline = clock_type::now() + settings.timeout;
  const std::string where = settings.address + ":" + std::to_string(settings.port);
  if (settings.rank != 0) {
    std::string error;
    to_rank0_ = connect_until(settings.address, settings.port, deadline, error);
    if (!to_rank0_.valid()) {
      ZA_THROW(collective_error, "rank ", settings.rank, " could not reach rank 0 at ", where,
               " within ", settings.timeout.count(), " ms (", error, ")");
    }
    const int fd = to_rank0_.get();
    const bool said = send_hello(fd, kMagic, settings.rank, settings.world_size, deadline);
    const auto answer_by = deadline + std::chrono::seconds(10);
    const std::optional<std::uint32_t> status = said ? receive_u32(fd, answer_by) : std::nullopt;
    const std::optional<std::string> message =
        status ? receive_string(fd, answer_by) : std::nullopt;
    if (!message) {
      ZA_THROW(collective_error, "rank ", settings.rank, " reached rank 0 at ", where,
               " but had no answer: rank 0 failed or stopped");
    }
    if (*status != 0) ZA_THROW(collective_error, "rank ", settings.rank, ": ", *message);
    return;
  }
  std::string error;
  const socket_fd listening = listen_on(settings.port, settings.world_size, error);
  if (!listening.valid()) {
    ZA_THROW(collective_error, "rank 0 cannot listen on ", where, ": ", error);
  }
  to_rank_.resize(static_cast<std::size_t>(settings.world_size));
  std::string failure;
  int joined = 1;
  while (joined < settings.world_size) {
    socket_fd peer = accept_until(listening.get(), deadline);
    if (!peer.valid()) break;
    const std::optional<hello> greeting = receive_hello(peer.get(), kMagic, deadline);
    if (!greeting) continue;
    const std::uint32_t rank = greeting->rank;
    const std::uint32_t world = greeting->world_size;
    const auto who = static_cast<std::size_t>(rank);
    if (static_cast<int>(world) != settings.world_size || who == 0 || who >= to_rank_.size() ||
        to_rank_[who].valid()) {
      if (failure.empty()) {
        failure = "rank " + std::to_string(rank) + " of " + std::to_string(world) +
                  " cannot join a group of " + std::to_string(settings.world_size) +
                  " (a rank out of range, twice, or another WORLD_SIZE)";
      }
      send_u32(peer.get(), 1, deadline);
      send_string(peer.get(), failure, deadline);
      continue;
    }
    to_rank_[who] = std::move(peer);
    ++joined;
  }
  if (failure.empty() && joined < settings.world_size) {
    std::string missing;
    for (std::size_t each = 1; each < to_rank_.size(); ++each) {
      if (!to_rank_[each].valid()) missing += (missing.empty() ? "" : ", ") + std::to_string(each);
    }
    failure = "rank(s) " + missing + " did not join within " +
              std::to_string(settings.timeout.count()) + " ms";
  }
  const auto reply_by = clock_type::now() + std::chrono::seconds(5);
  for (std::size_t each = 1; each < to_rank_.size(); ++each) {
    if (!to_rank_[each].valid()) continue;
    send_u32(to_rank_[each].get(), failure.empty() ? 0 : 1, reply_by);
    send_string(to_rank_[each].get(), failure, reply_by);
  }
  if (!failure.empty()) ZA_THROW(collective_error, "rank 0: ", failure);
}

void tcp_transport::fail_with(const std::string& why) {
  if (!failed_) failed_ = why;
  ZA_THROW(collective_error, "rank ", settings_.rank, ": ", *failed_);
}

std::string tcp_transport::round(const call& mine, std::string input) {
  std::lock_guard lock(mutex_);
  if (failed_) fail_with(*failed_);
  const std::uint64_t number = ++sequence_;
  if (settings_.world_size == 1) return serve(mine, std::move(input));
  if (settings_.rank == 0) return serve(mine, std::move(input));
  const auto deadline = clock_type::now() + collective_timeout_;
  const int fd = to_rank0_.get();
  const bool sent = send_u32(fd, kCollective, deadline) &&
                    send_u32(fd, static_cast<std::uint32_t>(mine.what), deadline) &&
                    send_u64(fd, mine.bytes, deadline) &&
                    send_u32(fd, static_cast<std::uint32_t>(mine.type), deadline) &&
                    send_u32(fd, static_cast<std::uint32_t>(mine.root), deadline) &&
                    send_string(fd, input, deadline);
  // Rank 0 answers once every rank came, up to its own timeout, which starts when it
  // arrives: later than ours, when it came last. So the wait here is longer, and a rank that
  // still gives up tells rank 0 and hangs up, so that rank 0 names it instead of waiting.
  const auto answer_by = deadline + collective_timeout_ + std::chrono::seconds(10);
  const std::optional<std::uint32_t> status = sent ? receive_u32(fd, answer_by) : std::nullopt;
  std::optional<std::string> payload =
      status ? receive_string(fd, answer_by, kLongestInput) : std::nullopt;
  if (!payload) {
    const std::string why = "the " + mine.describe() + " (collective " + std::to_string(number) +
                            " of the group) had no answer from rank 0 within " +
                            std::to_string(2 * collective_timeout_.count()) +
                            " ms: rank 0 failed or stopped";
    const auto by = clock_type::now() + std::chrono::seconds(2);
    if (send_u32(fd, kAbort, by)) send_string(fd, why, by);
    hang_up(fd);
    fail_with(why);
  }
  if (*status != 0) fail_with(*payload);
  return std::move(*payload);
}

std::string tcp_transport::serve(const call& mine, std::string input) {
  const std::size_t ranks = static_cast<std::size_t>(settings_.world_size);
  std::vector<std::string> inputs(ranks);
  inputs[0] = std::move(input);
  const auto deadline = clock_type::now() + collective_timeout_;
  std::string failure;
  std::string missing;
  for (std::size_t each = 1; each < ranks; ++each) {
    const int fd = to_rank_[each].get();
    const std::optional<std::uint32_t> frame = receive_u32(fd, deadline);
    if (frame && *frame == kAbort) {
      const std::optional<std::string> why = receive_string(fd, deadline);
      if (failure.empty())
        failure = "rank " + std::to_string(each) + " failed: " + why.value_or("");
      continue;
    }
    call theirs{};
    const std::optional<std::uint32_t> what = frame ? receive_u32(fd, deadline) : std::nullopt;
    const std::optional<std::uint64_t> bytes = what ? receive_u64(fd, deadline) : std::nullopt;
    const std::optional<std::uint32_t> type = bytes ? receive_u32(fd, deadline) : std::nullopt;
    const std::optional<std::uint32_t> root = type ? receive_u32(fd, deadline) : std::nullopt;
    std::optional<std::string> data =
        root ? receive_string(fd, deadline, kLongestInput) : std::nullopt;
    if (!data) {
      if (clock_type::now() < deadline && failure.empty()) {  // not late: gone
        failure = "rank " + std::to_string(each) + "'s connection closed during the " +
                  mine.describe() + " (collective " + std::to_string(sequence_) +
                  " of the group): the process exited or crashed";
      }
      missing += (missing.empty() ? "" : ", ") + std::to_string(each);
      continue;
    }
    theirs.what = static_cast<kind>(*what);
    theirs.bytes = *bytes;
    theirs.type = static_cast<element_type>(*type);
    theirs.root = static_cast<int>(*root);
    const std::size_t expected =
        theirs.what == kind::reduce_scatter ? theirs.bytes * ranks * element_bytes(theirs.type)
        : theirs.what == kind::reduce       ? theirs.bytes * element_bytes(theirs.type)
        : (theirs.what == kind::broadcast && theirs.root != static_cast<int>(each)) ? 0
                                                                                    : theirs.bytes;
    if (data->size() != expected && failure.empty()) {
      failure = "rank " + std::to_string(each) + " sent " + std::to_string(data->size()) +
                " bytes for its " + theirs.describe() + " (expected " + std::to_string(expected) +
                ")";
    }
    if (!(theirs == mine) && failure.empty()) {
      failure = "ranks called different collectives (collective " + std::to_string(sequence_) +
                " of the group): rank 0 called " + mine.describe() + ", rank " +
                std::to_string(each) + " " + theirs.describe();
    }
    inputs[each] = std::move(*data);
  }
  if (failure.empty() && !missing.empty()) {
    failure = "the " + mine.describe() + " (collective " + std::to_string(sequence_) +
              " of the group) waited " + std::to_string(collective_timeout_.count()) +
              " ms for rank(s) " + missing + ", which never arrived";
  }
  const auto reply_by = clock_type::now() + collective_timeout_;
  if (!failure.empty()) {
    failed_ = failure;
    for (std::size_t each = 1; each < ranks; ++each) {  // now, or as the answer to their next
      send_u32(to_rank_[each].get(), 1, reply_by);
      send_string(to_rank_[each].get(), failure, reply_by);
    }
    fail_with(failure);
  }
  if (mine.what == kind::reduce) {  // the sum to the root, nothing to the others
    std::string sum(mine.bytes * element_bytes(mine.type), '\0');
    std::vector<const void*> sources;
    for (const std::string& each : inputs) sources.push_back(each.data());
    sum_in_rank_order(sources, 0, mine.bytes, mine.type, sum.data());
    const auto root = static_cast<std::size_t>(mine.root);
    for (std::size_t each = 1; each < ranks; ++each) {
      send_u32(to_rank_[each].get(), 0, reply_by);
      send_string(to_rank_[each].get(), each == root ? sum : std::string(), reply_by);
    }
    return root == 0 ? sum : std::string();
  }
  if (mine.what != kind::reduce_scatter) {  // one output for every rank, sent as it is
    std::string same;
    if (mine.what == kind::all_gather) {
      for (const std::string& each : inputs) same += each;
    } else {
      same = std::move(inputs[static_cast<std::size_t>(mine.root)]);
    }
    for (std::size_t each = 1; each < ranks; ++each) {
      send_u32(to_rank_[each].get(), 0, reply_by);
      send_string(to_rank_[each].get(), same, reply_by);
    }
    return same;
  }
  std::vector<std::string> outputs(ranks);
  {
    std::vector<const void*> sources;
    for (const std::string& each : inputs) sources.push_back(each.data());
    const std::size_t element = element_bytes(mine.type);
    for (std::size_t each = 0; each < ranks; ++each) {
      outputs[each].resize(mine.bytes * element);
      sum_in_rank_order(sources, each * mine.bytes, mine.bytes, mine.type, outputs[each].data());
    }
  }
  for (std::size_t each = 1; each < ranks; ++each) {
    send_u32(to_rank_[each].get(), 0, reply_by);
    send_string(to_rank_[each].get(), outputs[each], reply_by);
  }
  return std::move(outputs[0]);
}

// Note [Collectives through rank 0]: a rank's bytes are device memory (simulated, or a GPU's
// with ZEROALLOC_COLLECTIVES=tcp). They reach the socket through a copy to the host in the
// order of the caller's stream, after the work that wrote them, and come back the same way,
// before the stream's next work. On the simulated device those copies are memcpys.
std::string tcp_transport::read_on(stream_handle stream, const void* source, std::size_t bytes) {
  std::string copied(bytes, '\0');
  if (bytes != 0) device_.copy_async(copied.data(), source, bytes, stream);
  device_.synchronize_stream(stream);
  return copied;
}

void tcp_transport::write_on(stream_handle stream, void* destination, const std::string& bytes) {
  if (bytes.empty()) return;
  device_.copy_async(destination, bytes.data(), bytes.size(), stream);
  device_.synchronize_stream(stream);  // `bytes` is the caller's until the copy is done
}

void tcp_transport::all_gather(const void* send, void* receive, std::size_t bytes,
                               stream_handle stream) {
  std::string input = read_on(stream, send, bytes);
  write_on(stream, receive, round({kind::all_gather, bytes}, std::move(input)));
}

void tcp_transport::reduce_scatter(const void* send, void* receive, std::size_t count,
                                   element_type type, stream_handle stream) {
  const std::size_t all = count * static_cast<std::size_t>(world_size()) * element_bytes(type);
  std::string input = read_on(stream, send, all);
  write_on(stream, receive, round({kind::reduce_scatter, count, type}, std::move(input)));
}

void tcp_transport::broadcast(void* buffer, std::size_t bytes, int root, stream_handle stream) {
  if (root < 0 || root >= world_size()) {
    ZA_THROW(invalid_argument, "broadcast from rank ", root, " in a group of ", world_size());
  }
  // Only the root's bytes matter; the others send none (but wait for their stream: the
  // buffer's earlier work must be done before the answer lands in it).
  std::string input = read_on(stream, buffer, rank() == root ? bytes : 0);
  std::string output =
      round({kind::broadcast, bytes, element_type::float32, root}, std::move(input));
  if (rank() != root) write_on(stream, buffer, output);  // the root's bytes are there
}

void tcp_transport::reduce(const void* send, void* receive, std::size_t count, element_type type,
                           int root, stream_handle stream) {
  if (root < 0 || root >= world_size()) {
    ZA_THROW(invalid_argument, "reduce to rank ", root, " in a group of ", world_size());
  }
  std::string input = read_on(stream, send, count * element_bytes(type));
  std::string output = round({kind::reduce, count, type, root}, std::move(input));
  if (rank() == root) write_on(stream, receive, output);
}

void tcp_transport::abort(const std::string& why) {
  std::lock_guard lock(mutex_);
  if (failed_) return;
  failed_ = "rank " + std::to_string(settings_.rank) + " failed: " + why;
  const auto by = clock_type::now() + std::chrono::seconds(5);
  if (settings_.rank != 0 && to_rank0_.valid()) {
    send_u32(to_rank0_.get(), kAbort, by);
    send_string(to_rank0_.get(), why, by);
    return;
  }
  for (std::size_t each = 1; each < to_rank_.size(); ++each) {  // their next answer
    send_u32(to_rank_[each].get(), 1, by);
    send_string(to_rank_[each].get(), *failed_, by);
  }
}

}  // namespace zeroalloc
