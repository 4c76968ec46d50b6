#include "capi/runtime.hpp"

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "core/errors.hpp"
#include "core/host_memory.hpp"
#include "core/log.hpp"
#include "core/units.hpp"

namespace zeroalloc {

namespace {

reporter* g_exit_reporter = nullptr;
runtime* g_forking_runtime = nullptr;
pid_t g_reporting_process = 0;

// The outcome of the one start-up attempt: a runtime, or the reason there is none.
struct startup {
  runtime* started = nullptr;
  std::string failure;
};

std::atomic<runtime*> g_started{nullptr};  // constant-initialised: if_started() reads it

// An allocator tells one paging_listener: its device's offload engine. When a memory report
// is written, the report must hear of out-of-memory failures too, with offload on or off:
// this listener passes everything on to the engine (when there is one) and reports them.
class reporting_listener final : public paging_listener {
 public:
  reporting_listener(runtime& owner, caching_allocator& allocator, paging_listener* tier)
      : owner_(owner), allocator_(allocator), tier_(tier) {}
  ~reporting_listener() override { allocator_.paging().detach(*this); }
  reporting_listener(const reporting_listener&) = delete;
  reporting_listener& operator=(const reporting_listener&) = delete;

  std::uint64_t relieve_pressure(std::size_t bytes_needed) override {
    return tier_ != nullptr ? tier_->relieve_pressure(bytes_needed) : 0;
  }
  std::string pressure_note() override {
    return tier_ != nullptr ? tier_->pressure_note() : std::string();
  }
  void allocated_on_host(const void* pointer, stream_handle stream) override {
    if (tier_ != nullptr) tier_->allocated_on_host(pointer, stream);
  }
  void chunk_gained(allocation_class cls, std::size_t chunk_bytes) override {
    if (tier_ != nullptr) tier_->chunk_gained(cls, chunk_bytes);
  }
  void chunk_lost(allocation_class cls, std::size_t chunk_bytes) override {
    if (tier_ != nullptr) tier_->chunk_lost(cls, chunk_bytes);
  }
  void host_chunk_released(physical_handle chunk, std::uintptr_t address) override {
    if (tier_ != nullptr) tier_->host_chunk_released(chunk, address);
  }
  void out_of_memory(const std::string& message) override {
    if (tier_ != nullptr) tier_->out_of_memory(message);
    if (owner_.reporting_process()) owner_.memory_reporter()->out_of_memory(message);
  }

 private:
  runtime& owner_;
  caching_allocator& allocator_;
  paging_listener* const tier_;
};

}  // namespace

runtime::runtime(const options& parsed) : options_(parsed), registry_(parsed) {
  if (!parsed.nvme_path.empty() && parsed.nvme_bytes == 0 && parsed.offload == "host") {
    ZA_THROW(config_error, "ZEROALLOC_NVME_PATH=", parsed.nvme_path,
             " is set but ZEROALLOC_NVME_SIZE is not: set the bytes of swap space the NVMe "
             "tier may take per GPU (for example ZEROALLOC_NVME_SIZE=200GiB), or unset "
             "ZEROALLOC_NVME_PATH");
  }
  // Note [Moves any kernel may see] in tier/migrator.hpp: while a chunk's bytes are on disk,
  // its addresses map memory no kernel may touch. Only hinted access can promise that none
  // does, so the NVMe tier is never on under the default.
  if (!parsed.nvme_path.empty() && parsed.offload == "host" && parsed.access != "hinted") {
    ZA_THROW(config_error, "ZEROALLOC_NVME_PATH=", parsed.nvme_path,
             " needs ZEROALLOC_ACCESS=hinted: while a chunk's bytes are on disk its addresses "
             "map nothing readable, so every read of a parameter or optimizer state must be a "
             "use the hooks announce (zeroalloc.torch.offload or the no-code-change mode). Set "
             "ZEROALLOC_ACCESS=hinted to accept that contract (docs/known-limits.md), or unset "
             "ZEROALLOC_NVME_PATH to keep every state in device and host memory");
  }
  // The NVMe tier is the offload engine's: without it the path would be silently unused.
  if (!parsed.nvme_path.empty() && parsed.offload != "host") {
    log().warn(
        "ZEROALLOC_NVME_PATH={} is ignored: the NVMe tier belongs to the offload engine, which "
        "runs only under ZEROALLOC_OFFLOAD=host. Set ZEROALLOC_OFFLOAD=host and "
        "ZEROALLOC_ACCESS=hinted to use it (docs/offload.md), or unset ZEROALLOC_NVME_PATH",
        parsed.nvme_path);
  }
  if (!parsed.report_prefix.empty()) {
    reporter::settings_list shown;
    for (const option_spec& spec : option_table()) {
      const char* value = std::getenv(std::string(spec.name).c_str());
      shown.emplace_back(
          std::string(spec.name),
          value != nullptr
              ? std::string(value)
              : detail::concat(spec.default_value.empty() ? "(unset)" : spec.default_value,
                               " (default)"));
    }
    // Under torchrun every rank inherits the variable: each writes its own files.
    std::string prefix = parsed.report_prefix;
    if (const char* rank = std::getenv("RANK")) prefix += std::string(".rank") + rank;
    reporter::tier_probe tiers;
    if (parsed.offload == "host") {
      tiers.offload_json = [this](int ordinal) { return offload_json(ordinal); };
      tiers.host_resident_bytes = [this](int ordinal) -> std::uint64_t {
        offload_engine* engine =
            ordinal < kMaxDevices ? engines_[ordinal].load(std::memory_order_acquire) : nullptr;
        return engine != nullptr ? engine->mover().figures().host_resident_bytes : 0;
      };
      tiers.counters = [this](int ordinal) {
        reporter::tier_counters counters;
        offload_engine* engine =
            ordinal < kMaxDevices ? engines_[ordinal].load(std::memory_order_acquire) : nullptr;
        if (engine == nullptr) return counters;
        const migration_figures moved = engine->mover().figures();
        counters.host_resident_class_bytes = moved.host_resident_class_bytes;
        counters.bytes_to_host = moved.bytes_to_host;
        counters.bytes_to_device = moved.bytes_to_device;
        const offload_figures uses = engine->figures();
        counters.device_waited_ns = uses.device_waited_ns;
        counters.waited_for_room_ns = uses.waited_ns;
        counters.waited_for_moves_ns = moved.waited_ns;
        counters.disk_resident_bytes = moved.disk_resident_bytes;
        counters.bytes_to_disk = moved.bytes_to_disk;
        counters.bytes_from_disk = moved.bytes_from_disk;
        counters.disk_ns = moved.disk_ns;
        return counters;
      };
    }
    reporter_ = std::make_unique<reporter>(
        prefix, [this] { return started_allocators(); }, std::move(shown), 200, std::move(tiers));
    reporter_->start();
    // The runtime is never destroyed, so the exit report runs while everything it reads is
    // alive. (Not through runtime::get(): its static may already be destroyed by then.)
    // A forked child that exits must neither join the parent's sampler thread (it does not
    // exist there) nor overwrite the parent's report.
    g_exit_reporter = reporter_.get();
    g_reporting_process = ::getpid();
    std::atexit([] {
      if (::getpid() != g_reporting_process) return;
      g_exit_reporter->stop();
      g_exit_reporter->write("exit");
    });
  }
  // Note [Fork] in alloc/caching_allocator.cpp. Last, so that a constructor that throws
  // leaves no handler behind; the runtime then lives for the whole process.
  g_forking_runtime = this;
  pthread_atfork([] { g_forking_runtime->prepare_fork(); }, [] { g_forking_runtime->after_fork(); },
                 [] { g_forking_runtime->after_fork(); });
  log().info("zeroalloc started: {} {} device(s), chunk size {}", registry_.count(),
             registry_.kind(), format_bytes(parsed.chunk_bytes));
}

runtime& runtime::get() {
  // Leaked: static destructors of other libraries may still allocate after ours would run.
  static startup& outcome = *new startup([] {
    startup attempt;
    try {
      const options parsed = options::from_environment();
      configure_logging(parsed);
      attempt.started = new runtime(parsed);
      g_started.store(attempt.started, std::memory_order_release);
    } catch (const std::exception& failure) {
      attempt.failure = detail::concat("zeroalloc cannot start: ", failure.what());
      log().error("{}", attempt.failure);
    }
    return attempt;
  }());
  if (outcome.started == nullptr) throw config_error(outcome.failure);
  return *outcome.started;
}

runtime* runtime::if_started() noexcept { return g_started.load(std::memory_order_acquire); }

caching_allocator& runtime::allocator(int ordinal) {
  if (ordinal < 0 || ordinal >= registry_.count() || ordinal >= kMaxDevices) {
    ZA_THROW(no_such_device, "device ", ordinal, " does not exist: zeroalloc drives ",
             registry_.count(), " ", registry_.kind(), " device(s), numbered from 0");
  }
  if (caching_allocator* ready = allocators_[ordinal].load(std::memory_order_acquire))
    return *ready;
  std::lock_guard lock(create_mutex_);
  if (caching_allocator* ready = allocators_[ordinal].load(std::memory_order_acquire))
    return *ready;
  devices_.push_back(registry_.open(ordinal));
  device& opened = *devices_.back();
  allocator_settings settings;
  settings.chunk_bytes = options_.chunk_bytes;
  // Note [Released after every stream] (alloc/heap_release.cpp)
  settings.drain_before_release = options_.access != "hinted";
  // Note [Address regions]: the paged classes' chunks stay mapped in their segments on the
  // host too, so their regions hold the host tier besides the device.
  if (offload_enabled()) {
    settings.host_tier_bytes = std::min(host_tier_limit(), host_memory_bytes());
    if (disk_tier_enabled()) settings.host_tier_bytes += options_.nvme_bytes;  // and the disk's
  }
  if (options_.limit.is_set()) {
    settings.limit_bytes = options_.limit.resolve(opened.query_memory().total_bytes);
    settings.limit_source = "ZEROALLOC_MEMORY_LIMIT=" + options_.limit.text;
  }
  owned_allocators_.push_back(std::make_unique<caching_allocator>(opened, settings));
  caching_allocator* created = owned_allocators_.back().get();
  if (offload_enabled()) start_offload(ordinal, *created);
  offload_engine* engine = engines_[ordinal].load(std::memory_order_acquire);
  if (reporter_) {
    owned_listeners_.push_back(std::make_unique<reporting_listener>(*this, *created, engine));
    created->paging().attach(*owned_listeners_.back());
  } else if (engine != nullptr) {
    created->paging().attach(*engine);
  }
  allocators_[ordinal].store(created, std::memory_order_release);
  log().info("device {}: {}, limit {}", ordinal, opened.name(),
             format_bytes(created->limit_bytes()));
  return *created;
}

namespace {

runtime* g_offloading_runtime = nullptr;
pid_t g_offloading_process = 0;

}  // namespace

void runtime::stop_background_work() {
  std::lock_guard lock(create_mutex_);
  for (const auto& pool : owned_host_pools_) pool->stop_prefill();
  for (const auto& engine : owned_engines_) engine->stop_threads();
}

std::uint64_t runtime::host_sharers() const {
  // A share of the host is shared out: among the processes of this machine (torchrun sets
  // LOCAL_WORLD_SIZE) and among this process's devices, or every rank would pin that share.
  std::uint64_t sharers = static_cast<std::uint64_t>(std::max(1, registry_.count()));
  if (const char* local_ranks = std::getenv("LOCAL_WORLD_SIZE")) {
    sharers *= static_cast<std::uint64_t>(std::max(1, std::atoi(local_ranks)));
  }
  return sharers;
}

std::uint64_t runtime::host_tier_limit() const {
  const std::uint64_t host_bytes = host_memory_bytes();
  return options_.host_limit.bytes ? options_.host_limit.resolve(host_bytes)
                                   : options_.host_limit.resolve(host_bytes) / host_sharers();
}

void runtime::start_offload(int ordinal, caching_allocator& allocator) {
  if (g_offloading_runtime == nullptr) {
    // Pinned-memory creation must not run on into exit, past the logger it writes to; a
    // forked child has no such thread to stop.
    g_offloading_runtime = this;
    g_offloading_process = ::getpid();
    std::atexit([] {
      if (::getpid() == g_offloading_process) g_offloading_runtime->stop_background_work();
    });
  }
  device& backing = allocator.backing();
  const int node = backing.host_numa_node();
  const std::uint64_t host_bytes = host_memory_bytes();
  const std::uint64_t node_bytes = std::min(host_node_bytes(node), host_bytes);
  const std::uint64_t sharers = host_sharers();
  const std::uint64_t limit = host_tier_limit();
  if (options_.host_limit.bytes && *options_.host_limit.bytes > host_bytes) {
    log().warn(
        "ZEROALLOC_HOST_LIMIT={} is more than the host's memory ({}): the host tier holds "
        "at most {}",
        options_.host_limit.text, format_bytes(host_bytes), format_bytes(host_bytes));
  }
  // Pinned memory on the GPU's own NUMA node is the fastest to reach, but some hosts (VMs
  // in particular) have small nodes: a tier larger than 90% of the node takes any node.
  const bool any_node = limit > node_bytes / 10 * 9;
  if (any_node) backing.place_host_memory_on_any_node();
  const std::string source = detail::concat(
      "ZEROALLOC_HOST_LIMIT=", options_.host_limit.text.empty() ? "0.5" : options_.host_limit.text,
      " of the host's ", format_bytes(host_bytes),
      options_.host_limit.bytes
          ? ""
          : detail::concat(", shared by ", sharers, " device(s) and processes"),
      "; ",
      any_node
          ? detail::concat("from any NUMA node, node ", node, " having ", format_bytes(node_bytes))
          : detail::concat("on NUMA node ", node, ", nearest the GPU"));
  owned_host_pools_.push_back(std::make_unique<host_pool>(backing, limit, source));
  host_pool* pool = owned_host_pools_.back().get();
  // Pinned memory takes about 0.25 s per GiB to create: in the background, from now.
  pool->start_prefill(allocator.paging().arena().chunk_bytes(), limit);
  offload_settings settings;
  settings.prefetch_bytes = options_.prefetch_bytes;
  settings.parameters_to_disk = options_.nvme_parameters;
  settings.park_parameters = options_.park_parameters;
  if (options_.access != "hinted" && options_.park_parameters &&
      std::getenv("ZEROALLOC_PARK_PARAMETERS") != nullptr) {
    log().warn(
        "ZEROALLOC_PARK_PARAMETERS=1 is ignored under ZEROALLOC_ACCESS=any: a parked "
        "parameter maps nothing, and any kernel may read it. Set ZEROALLOC_ACCESS=hinted to "
        "park (docs/known-limits.md)");
  }
  settings.any_access = options_.access != "hinted";
  disk_store* disk = nullptr;
  if (disk_tier_enabled()) {  // Note [Chunks on disk] in tier/migrator.hpp
    disk_store_options disk_options;
    disk_options.directories = split_directories(options_.nvme_path);
    disk_options.capacity_bytes = options_.nvme_bytes;
    disk_options.verify = options_.verify;
    owned_disk_stores_.push_back(std::make_unique<disk_store>(disk_options));
    disk = owned_disk_stores_.back().get();
    log().info("device {}: NVMe tier on, {} in {}", ordinal, format_bytes(options_.nvme_bytes),
               options_.nvme_path);
  }
  owned_engines_.push_back(
      std::make_unique<offload_engine>(allocator, *pool, options_.verify, settings, disk));
  offload_engine* engine = owned_engines_.back().get();
  host_pools_[ordinal].store(pool, std::memory_order_release);
  engines_[ordinal].store(engine, std::memory_order_release);
  log().info("device {}: offload to host memory on, up to {} ({})", ordinal, format_bytes(limit),
             source);
}

offload_engine* runtime::engine(int ordinal) {
  allocator(ordinal);  // creates the engine with the allocator
  return engines_[ordinal].load(std::memory_order_acquire);
}

host_pool* runtime::host_tier(int ordinal) {
  allocator(ordinal);
  return host_pools_[ordinal].load(std::memory_order_acquire);
}

nlohmann::ordered_json runtime::offload_json(int ordinal) {
  offload_engine* engine = this->engine(ordinal);
  host_pool* pool = host_tier(ordinal);
  if (engine == nullptr || pool == nullptr) return nullptr;
  const offload_figures uses = engine->figures();
  const migration_figures moved = engine->mover().figures();
  const host_pool_figures host = pool->figures();
  const double hit_rate =
      uses.uses == 0 ? 1.0 : static_cast<double>(uses.hits) / static_cast<double>(uses.uses);
  nlohmann::ordered_json figures = {
      {"host_limit_bytes", host.limit_bytes},
      {"host_created_bytes", host.created_bytes},
      {"host_in_use_bytes", host.in_use_bytes},
      {"host_peak_in_use_bytes", host.peak_in_use_bytes},
      {"host_chunks_created_on_demand", host.created_on_demand},
      {"host_resident_bytes", moved.host_resident_bytes},
      {"bytes_to_host", moved.bytes_to_host},
      {"bytes_to_device", moved.bytes_to_device},
      {"chunks_to_host", moved.chunks_to_host},
      {"chunks_to_device", moved.chunks_to_device},
      {"verified_chunks", moved.verified_chunks},
      {"remap_ns", moved.remap_ns},
      {"parked_bytes", moved.parked_bytes},
      {"chunks_parked", moved.chunks_parked},
      {"chunks_unparked", moved.chunks_unparked},
      {"settle_waits", moved.waits},
      {"settle_waited_ns", moved.waited_ns},
      {"disk_capacity_bytes", disk_tier_enabled() ? options_.nvme_bytes : 0},
      {"disk_resident_bytes", moved.disk_resident_bytes},
      {"bytes_to_disk", moved.bytes_to_disk},
      {"bytes_from_disk", moved.bytes_from_disk},
      {"chunks_to_disk", moved.chunks_to_disk},
      {"chunks_from_disk", moved.chunks_from_disk},
      {"disk_ns", moved.disk_ns},
      {"uses", uses.uses},
      {"prefetch_hits", uses.hits},
      {"prefetch_hit_rate", hit_rate},
      {"prefetches", uses.prefetches},
      {"disk_prefetches", uses.disk_prefetches},
      {"evictions", uses.evictions},
      {"pressure_evictions", uses.pressure_evictions},
      {"in_place_fetches", uses.in_place_fetches},
      {"device_waited_ns", uses.device_waited_ns},
      {"host_waited_ns", uses.waited_ns},
      {"steps", uses.steps},
      {"learned_order_chunks", uses.learned_order_chunks},
      {"in_place_uses", uses.in_place_uses},
      {"in_place_host_bytes", uses.in_place_host_bytes},
      {"headroom_searches", uses.headroom_searches},
      {"headroom_search_ns", uses.headroom_search_ns},
      {"chunks_in_use", uses.chunks_in_use}};
  // What moved, by class (flat keys: a step's change reads as any other counter's).
  for (allocation_class cls : kAllocationClasses) {
    const std::string name(class_name(cls));
    figures["bytes_to_host_" + name] = moved.to_host_class_bytes[class_index(cls)];
    figures["bytes_to_device_" + name] = moved.to_device_class_bytes[class_index(cls)];
  }
  return figures;
}

host_workers& runtime::host_step_workers(int ordinal) {
  caching_allocator& owner = allocator(ordinal);  // checks the ordinal
  std::lock_guard lock(create_mutex_);
  std::unique_ptr<host_workers>& workers = host_step_workers_[ordinal];
  if (!workers) {
    std::vector<int> cpus = host_step_cpus(owner.backing().host_numa_node());
    // One CPU stays with the training thread, which queues the device's part of the step
    // meanwhile (Note [Host windows] in the Python package).
    if (cpus.size() > 2) cpus.pop_back();
    workers = std::make_unique<host_workers>(cpus);
    log().info("the host step runs on {} CPUs (NUMA node {})", workers->threads(),
               owner.backing().host_numa_node());
  }
  return *workers;
}

pinned_buffers& runtime::pinned(int ordinal) {
  caching_allocator& owner = allocator(ordinal);  // checks the ordinal
  std::lock_guard lock(create_mutex_);
  std::unique_ptr<pinned_buffers>& buffers = pinned_[ordinal];
  if (!buffers) {
    buffers = std::make_unique<pinned_buffers>(owner.backing());
    // Note [Pinned buffers made ahead]: every host tier's growth to its limit stays free
    // (each device's of this process: they share the host). The runtime is never destroyed.
    buffers->set_kept([this] {
      std::uint64_t kept = 0;
      for (const std::atomic<host_pool*>& each : host_pools_) {
        const host_pool* pool = each.load(std::memory_order_acquire);
        if (pool == nullptr) continue;
        // What it may still hold, not only what it may still create: the sim device's
        // slabs take none of the host's available memory until touched, so counting the
        // created ones as taken made the answer depend on how far the prefill had got.
        const host_pool_figures figures = pool->figures();
        if (figures.limit_bytes > figures.in_use_bytes) {
          kept += figures.limit_bytes - figures.in_use_bytes;
        }
      }
      return kept;
    });
  }
  return *buffers;
}

pinned_buffers* runtime::pinned_owner(const void* address) {
  std::lock_guard lock(create_mutex_);
  for (const std::unique_ptr<pinned_buffers>& buffers : pinned_) {
    if (buffers && buffers->owns(address)) return buffers.get();
  }
  return nullptr;
}

offload_engine* runtime::engine_of(const void* pointer) {
  caching_allocator* owner = owner_of(pointer);
  if (owner == nullptr) return nullptr;
  const int ordinal = owner->backing().ordinal();
  return ordinal < kMaxDevices ? engines_[ordinal].load(std::memory_order_acquire) : nullptr;
}

caching_allocator* runtime::owner_of(const void* pointer) {
  for (int ordinal = 0; ordinal < registry_.count() && ordinal < kMaxDevices; ++ordinal) {
    caching_allocator* candidate = allocators_[ordinal].load(std::memory_order_acquire);
    if (candidate != nullptr && candidate->owns(pointer)) return candidate;
  }
  return nullptr;
}

bool runtime::reporting_process() const { return ::getpid() == g_reporting_process; }

void runtime::prepare_fork() {
  create_mutex_.lock();
  for (caching_allocator* each : started_allocators()) each->prepare_fork();
}

void runtime::after_fork() {
  for (caching_allocator* each : started_allocators()) each->after_fork();
  create_mutex_.unlock();
}

bool runtime::deallocate(void* pointer) {
  for (int ordinal = 0; ordinal < registry_.count() && ordinal < kMaxDevices; ++ordinal) {
    caching_allocator* candidate = allocators_[ordinal].load(std::memory_order_acquire);
    if (candidate != nullptr && candidate->deallocate(pointer)) return true;
  }
  return false;
}

std::vector<caching_allocator*> runtime::started_allocators() {
  std::vector<caching_allocator*> started;
  for (int ordinal = 0; ordinal < registry_.count() && ordinal < kMaxDevices; ++ordinal) {
    if (caching_allocator* each = allocators_[ordinal].load(std::memory_order_acquire)) {
      started.push_back(each);
    }
  }
  return started;
}

}  // namespace zeroalloc
