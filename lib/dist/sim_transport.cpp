#include "dist/sim_transport.hpp"

#include <bit>
#include <cstring>
#include <sstream>

#include "dist/reduction.hpp"

namespace zeroalloc {

sim_group::sim_group(device& backing, int world_size, std::chrono::milliseconds timeout)
    : device_(backing),
      world_size_(world_size),
      timeout_(timeout),
      posted_(static_cast<std::size_t>(world_size)),
      arrived_(static_cast<std::size_t>(world_size)),
      departed_(static_cast<std::size_t>(world_size)) {
  if (world_size < 1) ZA_THROW(invalid_argument, "a group of ", world_size, " ranks");
  if (!backing.is_simulated()) {
    ZA_THROW(invalid_argument, "sim_group needs the simulated device, not ", backing.name());
  }
}

void sim_group::throw_aborted(int rank, const char* what) const {
  ZA_THROW(collective_error, "rank ", rank, ": the ", what, " ended because rank ", aborted_->first,
           " failed: ", aborted_->second);
}

std::vector<sim_group::posted> sim_group::arrive(int rank, std::uint64_t sequence, const char* what,
                                                 posted mine) {
  std::unique_lock lock(mutex_);
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  // The previous collective must be over on every rank before this one's buffers are posted.
  if (!changed_.wait_until(lock, deadline, [&] { return aborted_ || sequence_ == sequence; })) {
    const std::string why =
        detail::concat("the ", what, " (collective ", sequence + 1, " of the group) waited ",
                       timeout_.count(), " ms for the previous collective to end on every rank");
    aborted_.emplace(rank, why);  // nobody waits on this group any more
    changed_.notify_all();
    ZA_THROW(collective_error, "rank ", rank, ": ", why);
  }
  if (aborted_) throw_aborted(rank, what);
  if (arrivals_ + 1 == world_size_) {  // the last to arrive: do the calls agree?
    for (int each = 0; each < world_size_; ++each) {
      const posted& other = posted_[static_cast<std::size_t>(each)];
      if (each == rank || other.call == mine.call) continue;
      const std::string why = detail::concat(
          "ranks called different collectives (collective ", sequence + 1, " of the group): rank ",
          each, " called ", other.call, ", rank ", rank, " ", mine.call);
      aborted_.emplace(rank, why);  // nobody reads: the group has not completed
      changed_.notify_all();
      ZA_THROW(collective_error, "rank ", rank, ": ", why);
    }
  }
  posted_[static_cast<std::size_t>(rank)] = mine;
  arrived_[static_cast<std::size_t>(rank)] = true;
  ++arrivals_;
  changed_.notify_all();
  // Every rank arrived: each reads the others' buffers and departs, whatever happens to
  // the group meanwhile. Otherwise nobody reads: a rank that gives up marks the group
  // aborted first, so that one arriving late throws instead of reading buffers already gone.
  if (!changed_.wait_until(lock, deadline, [&] { return aborted_ || arrivals_ == world_size_; })) {
    std::ostringstream missing;
    for (int each = 0; each < world_size_; ++each) {
      if (!arrived_[static_cast<std::size_t>(each)])
        missing << (missing.tellp() > 0 ? ", " : "") << each;
    }
    const std::string why = detail::concat(
        "the ", what, " (collective ", sequence + 1, " of the group) waited ", timeout_.count(),
        " ms for rank(s) ", missing.str(), ", which never arrived");
    aborted_.emplace(rank, why);
    changed_.notify_all();
    ZA_THROW(collective_error, "rank ", rank, ": ", why);
  }
  if (arrivals_ != world_size_) throw_aborted(rank, what);
  return posted_;
}

void sim_group::depart(int rank, std::uint64_t sequence, const char* what) {
  std::unique_lock lock(mutex_);
  departed_[static_cast<std::size_t>(rank)] = true;
  if (++departures_ == world_size_) {
    std::fill(arrived_.begin(), arrived_.end(), false);
    std::fill(departed_.begin(), departed_.end(), false);
    arrivals_ = departures_ = 0;
    ++sequence_;
    changed_.notify_all();
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  // The others are reading this rank's buffers (they never block while reading): wait for
  // them, aborted or not, so that the caller may reuse its buffers on return.
  if (!changed_.wait_until(lock, deadline, [&] { return sequence_ != sequence; })) {
    ZA_THROW(collective_error, "rank ", rank, ": the ", what, " (collective ", sequence + 1,
             " of the group) waited ", timeout_.count(),
             " ms for the other ranks to finish reading its buffers");
  }
}

void sim_group::abort(int rank, const std::string& why) {
  std::lock_guard lock(mutex_);
  if (!aborted_) aborted_.emplace(rank, why);  // the first failure is the cause
  changed_.notify_all();
}

sim_transport::sim_transport(sim_group& group, int rank) : group_(group), rank_(rank) {
  if (rank < 0 || rank >= group.world_size()) {
    ZA_THROW(invalid_argument, "rank ", rank, " of a group of ", group.world_size());
  }
}

void sim_transport::all_gather(const void* send, void* receive, std::size_t bytes,
                               stream_handle stream) {
  group_.device_.synchronize_stream(stream);  // the bytes to send are written
  const auto all =
      group_.arrive(rank_, sequence_, "all_gather",
                    {send, receive, detail::concat("all_gather of ", bytes, " bytes")});
  auto* into = static_cast<std::byte*>(receive);
  for (std::size_t each = 0; each < all.size(); ++each) {
    std::byte* part = into + each * bytes;
    if (all[each].send != part) std::memmove(part, all[each].send, bytes);
  }
  group_.depart(rank_, sequence_++, "all_gather");
}

void sim_transport::reduce_scatter(const void* send, void* receive, std::size_t count,
                                   element_type type, stream_handle stream) {
  group_.device_.synchronize_stream(stream);
  const auto all = group_.arrive(
      rank_, sequence_, "reduce_scatter",
      {send, receive,
       detail::concat("reduce_scatter of ", count,
                      type == element_type::float32 ? " float32" : " bfloat16", " per rank")});
  std::vector<const void*> inputs;
  for (const sim_group::posted& each : all) inputs.push_back(each.send);
  // Then the other ranks in rank order: the same sum every run.
  sum_in_rank_order(inputs, static_cast<std::size_t>(rank_) * count, count, type, receive);
  group_.depart(rank_, sequence_++, "reduce_scatter");
}

void sim_transport::broadcast(void* buffer, std::size_t bytes, int root, stream_handle stream) {
  if (root < 0 || root >= world_size()) {
    ZA_THROW(invalid_argument, "broadcast from rank ", root, " in a group of ", world_size());
  }
  group_.device_.synchronize_stream(stream);
  const auto all = group_.arrive(
      rank_, sequence_, "broadcast",
      {buffer, buffer, detail::concat("broadcast of ", bytes, " bytes from rank ", root)});
  if (rank_ != root) std::memmove(buffer, all[static_cast<std::size_t>(root)].send, bytes);
  group_.depart(rank_, sequence_++, "broadcast");
}

void sim_transport::reduce(const void* send, void* receive, std::size_t count, element_type type,
                           int root, stream_handle stream) {
  if (root < 0 || root >= world_size()) {
    ZA_THROW(invalid_argument, "reduce to rank ", root, " in a group of ", world_size());
  }
  group_.device_.synchronize_stream(stream);
  const auto all = group_.arrive(
      rank_, sequence_, "reduce",
      {send, receive,
       detail::concat("reduce of ", count, type == element_type::float32 ? " float32" : " bfloat16",
                      " to rank ", root)});
  if (rank_ == root) {
    std::vector<const void*> inputs;
    for (const sim_group::posted& each : all) inputs.push_back(each.send);
    sum_in_rank_order(inputs, 0, count, type, receive);  // in place: element by element
  }
  group_.depart(rank_, sequence_++, "reduce");
}

void sim_transport::abort(const std::string& why) { group_.abort(rank_, why); }

}  // namespace zeroalloc
