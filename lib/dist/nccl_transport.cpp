#include "dist/nccl_transport.hpp"

#include <dlfcn.h>
#include <nccl.h>

#include <cstring>
#include <utility>

#include "core/log.hpp"

namespace zeroalloc {

namespace {

// Note [NCCL at run time]: the functions used, looked up once.
struct nccl_api {
  ncclResult_t (*get_version)(int*) = nullptr;
  ncclResult_t (*get_unique_id)(ncclUniqueId*) = nullptr;
  ncclResult_t (*comm_init_rank)(ncclComm_t*, int, ncclUniqueId, int) = nullptr;
  ncclResult_t (*comm_destroy)(ncclComm_t) = nullptr;
  ncclResult_t (*comm_abort)(ncclComm_t) = nullptr;
  ncclResult_t (*comm_get_async_error)(ncclComm_t, ncclResult_t*) = nullptr;
  const char* (*get_error_string)(ncclResult_t) = nullptr;
  const char* (*get_last_error)(ncclComm_t) = nullptr;
  ncclResult_t (*all_gather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t,
                             cudaStream_t) = nullptr;
  ncclResult_t (*reduce_scatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                 ncclComm_t, cudaStream_t) = nullptr;
  ncclResult_t (*broadcast)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t,
                            cudaStream_t) = nullptr;
  ncclResult_t (*reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t,
                         cudaStream_t) = nullptr;
};

const nccl_api& nccl() {
  static const nccl_api loaded = [] {
    void* library = ::dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      const char* reason = ::dlerror();
      ZA_THROW(config_error, "NCCL (libnccl.so.2) could not be loaded: ",
               reason != nullptr ? reason : "unknown dlopen error",
               "; ZeRO partitions across GPUs need it: install libnccl2 (NVIDIA's packages) "
               "or put the CUDA Toolkit's lib directory on LD_LIBRARY_PATH");
    }
    nccl_api api;
    auto find = [&](auto& function, const char* name) {
      function =
          reinterpret_cast<std::remove_reference_t<decltype(function)>>(::dlsym(library, name));
      if (function == nullptr) {
        ZA_THROW(config_error, "NCCL (libnccl.so.2) has no ", name,
                 ": it is older than 2.13; install a newer one");
      }
    };
    find(api.get_version, "ncclGetVersion");
    find(api.get_unique_id, "ncclGetUniqueId");
    find(api.comm_init_rank, "ncclCommInitRank");
    find(api.comm_destroy, "ncclCommDestroy");
    find(api.comm_abort, "ncclCommAbort");
    find(api.comm_get_async_error, "ncclCommGetAsyncError");
    find(api.get_error_string, "ncclGetErrorString");
    find(api.get_last_error, "ncclGetLastError");
    find(api.all_gather, "ncclAllGather");
    find(api.reduce_scatter, "ncclReduceScatter");
    find(api.broadcast, "ncclBroadcast");
    find(api.reduce, "ncclReduce");
    return api;
  }();
  return loaded;
}

std::string describe(ncclResult_t result, ncclComm_t comm) {
  const nccl_api& api = nccl();
  std::string text = api.get_error_string(result);
  const char* last = api.get_last_error(comm);
  if (last != nullptr && *last != '\0') text += std::string(" (") + last + ")";
  return text;
}

}  // namespace

nccl_transport::unique_id nccl_transport::new_id() {
  ncclUniqueId made{};
  const ncclResult_t result = nccl().get_unique_id(&made);
  if (result != ncclSuccess) {
    ZA_THROW(collective_error, "ncclGetUniqueId failed: ", describe(result, nullptr));
  }
  unique_id id{};
  static_assert(sizeof(made.internal) == std::tuple_size_v<unique_id>);
  std::memcpy(id.data(), made.internal, id.size());
  return id;
}

std::string nccl_transport::version() {
  int code = 0;
  nccl().get_version(&code);
  return std::to_string(code / 10000) + "." + std::to_string(code % 10000 / 100) + "." +
         std::to_string(code % 100);
}

nccl_transport::nccl_transport(device& backing, int rank, int world_size, const unique_id& id,
                               std::chrono::milliseconds timeout)
    : device_(backing), rank_(rank), world_size_(world_size), timeout_(timeout) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    ZA_THROW(invalid_argument, "rank ", rank, " of a group of ", world_size);
  }
  if (backing.is_simulated()) {
    ZA_THROW(invalid_argument, "NCCL needs a GPU, not ", backing.name(),
             " (sim_transport serves the simulated device)");
  }
  ncclUniqueId joined{};
  std::memcpy(joined.internal, id.data(), id.size());
  ncclResult_t result = ncclSuccess;
  device_.run_current([&] { result = nccl().comm_init_rank(&comm_, world_size, joined, rank); });
  if (result != ncclSuccess) {
    ZA_THROW(collective_error, "rank ", rank, " of ", world_size, " on ", backing.name(),
             ": ncclCommInitRank failed: ", describe(result, nullptr));
  }
  watchdog_ = std::thread([this] { watch(); });
}

nccl_transport::~nccl_transport() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  watchdog_.join();
  try {
    for (const pending& each : pending_) {  // destroyed only once the GPU is done with them
      if (!failed_) device_.synchronize_event(each.done);
      device_.destroy_event(each.done);
    }
    // A failed communicator was aborted, which frees it, when it failed.
    if (comm_ != nullptr) device_.run_current([&] { nccl().comm_destroy(comm_); });
  } catch (const std::exception& failure) {
    log().error("rank {}: destroying the NCCL communicator failed: {}", rank_, failure.what());
  }
}

void nccl_transport::fail(const std::string& why) {
  if (failed_) return;
  failed_ = why;
  log().error("rank {}: aborting the NCCL communicator: {}", rank_, why);
  ncclComm* aborted = std::exchange(comm_, nullptr);         // nothing may use or free it again
  device_.run_current([&] { nccl().comm_abort(aborted); });  // which frees it
}

void nccl_transport::abort(const std::string& why) {
  std::lock_guard lock(mutex_);
  fail("rank " + std::to_string(rank_) + " failed: " + why);
  changed_.notify_all();
}

template <typename Call>
void nccl_transport::enqueue(const char* what, stream_handle stream, Call&& call) {
  std::lock_guard lock(mutex_);
  if (failed_) {
    ZA_THROW(collective_error, "rank ", rank_, ": the ", what, " cannot run: ", *failed_);
  }
  ncclResult_t result = ncclSuccess;
  device_.run_current([&] { result = call(static_cast<cudaStream_t>(stream)); });
  if (result != ncclSuccess) {
    const std::string why =
        std::string("the ") + what + " failed in NCCL: " + describe(result, comm_);
    fail(why);
    ZA_THROW(collective_error, "rank ", rank_, ": ", why);
  }
  event_handle done = device_.create_event();
  device_.record_event(done, stream);
  pending_.push_back({++sequence_, what, done, std::chrono::steady_clock::now() + timeout_});
  changed_.notify_all();
}

void nccl_transport::all_gather(const void* send, void* receive, std::size_t bytes,
                                stream_handle stream) {
  enqueue("all_gather", stream, [&](cudaStream_t on) {
    return nccl().all_gather(send, receive, bytes, ncclUint8, comm_, on);
  });
}

void nccl_transport::reduce_scatter(const void* send, void* receive, std::size_t count,
                                    element_type type, stream_handle stream) {
  const ncclDataType_t nccl_type = type == element_type::float32 ? ncclFloat32 : ncclBfloat16;
  enqueue("reduce_scatter", stream, [&](cudaStream_t on) {
    return nccl().reduce_scatter(send, receive, count, nccl_type, ncclSum, comm_, on);
  });
}

void nccl_transport::broadcast(void* buffer, std::size_t bytes, int root, stream_handle stream) {
  if (root < 0 || root >= world_size_) {
    ZA_THROW(invalid_argument, "broadcast from rank ", root, " in a group of ", world_size_);
  }
  enqueue("broadcast", stream, [&](cudaStream_t on) {
    return nccl().broadcast(buffer, buffer, bytes, ncclUint8, root, comm_, on);
  });
}

void nccl_transport::reduce(const void* send, void* receive, std::size_t count, element_type type,
                            int root, stream_handle stream) {
  if (root < 0 || root >= world_size_) {
    ZA_THROW(invalid_argument, "reduce to rank ", root, " in a group of ", world_size_);
  }
  const ncclDataType_t nccl_type = type == element_type::float32 ? ncclFloat32 : ncclBfloat16;
  enqueue("reduce", stream, [&](cudaStream_t on) {
    return nccl().reduce(send, receive, count, nccl_type, ncclSum, root, comm_, on);
  });
}

// Note [A watchdog per communicator].
void nccl_transport::watch() {
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    changed_.wait_for(lock, std::chrono::milliseconds(100));
    if (failed_) continue;
    try {
      ncclResult_t async = ncclSuccess;
      nccl().comm_get_async_error(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        fail("NCCL reported an error: " + describe(async, comm_));
        continue;
      }
      while (!pending_.empty() && device_.event_completed(pending_.front().done)) {
        device_.destroy_event(pending_.front().done);
        pending_.pop_front();
      }
      if (!pending_.empty() && std::chrono::steady_clock::now() > pending_.front().deadline) {
        fail("the " + std::string(pending_.front().what) + " (collective " +
             std::to_string(pending_.front().sequence) + ") did not complete within " +
             std::to_string(timeout_.count()) +
             " ms: a rank may have failed or stopped calling collectives");
      }
    } catch (const std::exception& failure) {
      fail(std::string("the watchdog could not check the communicator: ") + failure.what());
    }
  }
}

}  // namespace zeroalloc
