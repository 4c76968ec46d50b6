/*
 * zeroalloc: the C ABI of libzeroalloc.so.
 *
 * Everything a user, a binding or PyTorch calls. The allocation functions have exactly the
 * signatures of PyTorch's pluggable allocator, so
 *
 *   torch.cuda.memory.CUDAPluggableAllocator("libzeroalloc.so",
 *                                            "zeroalloc_malloc", "zeroalloc_free")
 *
 * works as it is, and the optional hooks (set_init_fn, set_reset_fn,
 * set_memory_fraction_fn, set_record_stream_fn) take zeroalloc_init, zeroalloc_empty_cache,
 * zeroalloc_set_memory_fraction and zeroalloc_record_stream.
 *
 * Nothing crosses this boundary as an exception. A function that fails returns its failure
 * value (documented with it) and zeroalloc_last_error() then describes the failure in one
 * readable message. A function that returns nothing clears that message when called, sets
 * it when it fails, and logs the failure. The library starts on first use: it reads the
 * ZEROALLOC_* environment variables once (docs/settings.md lists them) and, if one is malformed,
 * refuses to start; every allocation then fails and zeroalloc_last_error() names the
 * variable.
 */
#ifndef ZEROALLOC_ZEROALLOC_H
#define ZEROALLOC_ZEROALLOC_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h> /* ssize_t */

#ifdef __cplusplus
extern "C" {
#endif

/**
 * A CUDA stream (cudaStream_t and CUstream are the same pointer). NULL: default stream.
 * CUDA's special handles cudaStreamLegacy (0x1) and cudaStreamPerThread (0x2) are accepted
 * wherever work is ordered on a stream; on the simulated device, which has one default
 * stream, they are that stream.
 */
typedef struct CUstream_st* zeroalloc_stream_t;

/**
 * Version of this ABI: major * 10000 + minor * 100 + patch. 200 added
 * zeroalloc_free_if_owned, zeroalloc_memory_info, zeroalloc_forget_stream and
 * zeroalloc_last_error_code.
 */
#define ZEROALLOC_ABI_VERSION 200
int zeroalloc_abi_version(void);

/**
 * Allocation classes. Each class lives in its own chunks, so that memory of one kind
 * (and one lifetime) can later be paged without touching another.
 */
typedef enum zeroalloc_class {
  ZEROALLOC_CLASS_OTHER = 0,     /**< activations, workspaces: the default */
  ZEROALLOC_CLASS_PARAMETER = 1, /**< model parameters */
  ZEROALLOC_CLASS_GRADIENT = 2,  /**< gradients */
  /** optimizer states (Adam moments, ...). With the NVMe tier (ZEROALLOC_NVME_PATH), an
   *  idle one may go to disk, where its addresses fault: use them only inside a use hint
   *  (zeroalloc_use_begins / zeroalloc_use_in_place ... zeroalloc_use_ends), which brings
   *  it back first, from its first use after it is allocated on. */
  ZEROALLOC_CLASS_OPTIMIZER_STATE = 3,
  ZEROALLOC_CLASS_COUNT = 4
} zeroalloc_class;

/**
 * Allocates `size` bytes on `device` for use on `stream`, aligned to 512 bytes, in the
 * calling thread's current class (zeroalloc_set_thread_class).
 * Returns NULL with zeroalloc_last_error() set when memory is exhausted (the message says
 * how much was requested, free, cached and the limit in force), when `device` is not a
 * valid device index, when `size` is negative, or when the library could not start.
 * A size of 0 returns a unique, non-NULL pointer that must not be dereferenced and may be
 * passed to zeroalloc_free.
 */
void* zeroalloc_malloc(ssize_t size, int device, zeroalloc_stream_t stream);

/** zeroalloc_malloc with an explicit class. */
void* zeroalloc_malloc_class(ssize_t size, int device, zeroalloc_stream_t stream,
                             zeroalloc_class allocation_class);

/**
 * zeroalloc_malloc for PyTorch's CUDAPluggableAllocator, the one function of this header that
 * throws: when the allocation fails it throws a C++ std::runtime_error carrying
 * zeroalloc_last_error(), which PyTorch raises as a RuntimeError at the failing allocation
 * (PyTorch does not check the pointer its allocator returns). zeroalloc.torch uses it; C
 * callers use zeroalloc_malloc.
 */
void* zeroalloc_torch_malloc(ssize_t size, int device, zeroalloc_stream_t stream);

/**
 * Frees memory from zeroalloc_malloc. The memory is reused on its allocation stream at
 * once (stream order makes that safe) and on other streams only once the work enqueued
 * on its streams so far has completed. `size`, `device` and `stream` are accepted for
 * PyTorch's signature; the allocator knows them already. NULL is ignored. A pointer that
 * zeroalloc did not hand out is ignored and recorded in zeroalloc_last_error().
 */
void zeroalloc_free(void* ptr, ssize_t size, int device, zeroalloc_stream_t stream);

/**
 * Starts the library for `device_count` devices (PyTorch calls it through set_init_fn).
 * Optional: the first allocation starts the library too. Calling it again is harmless.
 */
void zeroalloc_init(int device_count);

/** Returns free cached physical memory of every device to the driver (empty_cache). */
void zeroalloc_empty_cache(void);

/**
 * Limits the memory zeroalloc may hold on `device` to `fraction` of the device's total
 * (PyTorch's set_per_process_memory_fraction). Fraction in (0, 1]; anything else is
 * ignored and recorded in zeroalloc_last_error().
 */
void zeroalloc_set_memory_fraction(double fraction, int device);

/**
 * Records that the allocation containing `ptr` is used on `stream` too: when it is freed,
 * it is not reused until the work enqueued on `stream` by then has completed.
 */
void zeroalloc_record_stream(void* ptr, zeroalloc_stream_t stream);

/**
 * Sets the class of the calling thread's later zeroalloc_malloc calls and returns the
 * previous one (so callers can restore it). An out-of-range value leaves it unchanged.
 */
zeroalloc_class zeroalloc_set_thread_class(zeroalloc_class allocation_class);

/** Resets the peak statistics of `device` (all classes) to the current values. */
void zeroalloc_reset_peak_stats(int device);

/**
 * Room for a new allocation of `allocation_class` on `device`: `*largest_free` receives the
 * class's largest cached free block (a request up to that size is served without new
 * memory), `*unallocated` the limit minus the bytes allocated in every class (cached free
 * memory included: using it may take releasing the cache). A cheap read (no JSON), for a
 * caller deciding whether an optional buffer fits now (zeroalloc.torch stages optimizer
 * states during backward with it). Returns 0, or -1 with zeroalloc_last_error() set when
 * `device` or the class is not valid or a pointer is NULL.
 */
int zeroalloc_room(int device, zeroalloc_class allocation_class, uint64_t* largest_free,
                   uint64_t* unallocated);

/**
 * The bytes of `allocation_class` the offload engine of `device` has moved to the host (or
 * disk) and back since the process started: a cheap read, unlike zeroalloc_stats_json, for
 * a caller that asks once a step (the Python package reads class "other" to learn whether a
 * step ran at the limit, Note [Gradients' class, decided]). Both are 0 when offload is off.
 * Returns 0, or -1 with zeroalloc_last_error() set when `device` or the class is not valid
 * or a pointer is NULL.
 */
int zeroalloc_moved_bytes(int device, zeroalloc_class allocation_class, uint64_t* to_host,
                          uint64_t* to_device);

/**
 * Writes the statistics of `device` as a JSON object into `buffer` (at most `length`
 * bytes, NUL-terminated when length > 0) and returns the length of the full text without
 * its NUL, so a caller can size the buffer with a first call of length 0.
 * Its "passthrough" object counts, for the whole process, the CUDA calls a preloaded
 * zeroalloc saw and left to CUDA (cuMemCreate, cudaMallocManaged, IPC, frees of memory it
 * does not own): {"cuMemCreate":{"calls":N,"bytes":B},...}.
 * Returns -1 with zeroalloc_last_error() set when `device` is not valid.
 */
int zeroalloc_stats_json(int device, char* buffer, size_t length);

/**
 * Creates a stream on `device` of the kind zeroalloc drives (a CUDA stream, or a stream of
 * the simulated device, where it is the only way to get one). NULL on failure.
 */
zeroalloc_stream_t zeroalloc_stream_create(int device);

/**
 * Waits for the work enqueued on `stream` so far and destroys it. NULL and CUDA's special
 * handles are ignored.
 */
void zeroalloc_stream_destroy(int device, zeroalloc_stream_t stream);

/**
 * Writes every segment of `device` with its blocks as JSON into `buffer`, with the same
 * length protocol as zeroalloc_stats_json: {"devices":[{"device":0,"segments":[{"address",
 * "total_size","class","kind","stream","blocks":[{"address","size","requested_size",
 * "state"}]}]}]}, where a block's state is "active_allocated", "active_pending_free"
 * (freed, waiting for another stream) or "inactive" (free). `device` -1 lists every
 * device the library has started (and starts none). The Python package turns this into
 * PyTorch's memory-snapshot format. Returns -1 with zeroalloc_last_error() set when
 * `device` is not valid.
 */
int zeroalloc_snapshot_json(int device, char* buffer, size_t length);

/**
 * How this library was built, as a JSON object: {"version","abi","cuda_version",
 * "nccl_version"} (CUDA and NCCL as their headers' version codes: 13000, 22809).
 */
const char* zeroalloc_build_info(void);

/**
 * Every ZEROALLOC_* variable of the options table with its value in this environment, its
 * default, accepted form and help, and whether the environment parses, as JSON:
 * {"valid":true,"error":"","options":[{"name","value","default","accepted","help"}]}
 * ("value" is null when unset). Reads the environment now; starts nothing. Same length
 * protocol as zeroalloc_stats_json.
 */
int zeroalloc_options_json(char* buffer, size_t length);

/**
 * Writes the memory report now (ZEROALLOC_REPORT=prefix: prefix.json and prefix.html),
 * giving `reason` as why. Returns 0, or -1 with zeroalloc_last_error() set when no report
 * was asked for or a file could not be written.
 */
int zeroalloc_report_write(const char* reason);

/**
 * Sets the section `name` of the memory report (its JSON's "sections", and a table of the
 * page) to `json_object`, a JSON object's text, replacing the section's last value: what
 * the layers above know (the Python package's ZeRO partition puts its stage and bytes per
 * rank there). Returns 0; 1 when no report was asked for (ZEROALLOC_REPORT unset: nothing
 * kept); -1 with zeroalloc_last_error() set when the text is not a JSON object.
 */
int zeroalloc_report_section(const char* name, const char* json_object);

/**
 * Renders the page of a report: reads the JSON at `json_path` (a prefix.json) and writes
 * the self-contained HTML page to `html_path`. Returns 0, or -1 with zeroalloc_last_error().
 */
int zeroalloc_report_render(const char* json_path, const char* html_path);

/** Number of devices the library drives (starting it if needed); -1 if it cannot start. */
int zeroalloc_device_count(void);

/**
 * The message of the last failure in the calling thread, or "" when nothing failed.
 * Valid until the thread's next call into zeroalloc.
 */
const char* zeroalloc_last_error(void);

/**
 * The CUDA error that stands for the calling thread's last failure, numbered as the runtime
 * (cudaError_t) and the driver (CUresult) both number it: 2 out of memory, 3 the library
 * could not start (not initialised: a malformed ZEROALLOC_* variable), 1 an invalid
 * argument (a pointer that is no live allocation, a negative size), 101 no such device, 999
 * anything else (a failing device). 0 when the thread's last call that can fail did not.
 */
int zeroalloc_last_error_code(void);

/* ---- Serving CUDA's own calls ---------------------------------------------------------- *
 * For a caller that serves a program's cudaFree, cudaMemGetInfo and cudaStreamDestroy with
 * zeroalloc while the program also holds memory from elsewhere: the LD_PRELOAD hooks
 * (hooks/cuda_hooks.cpp) are such a caller, and call nothing else of zeroalloc's besides
 * zeroalloc_malloc. None of these functions logs. */

/** What zeroalloc_free_if_owned did with a pointer. */
typedef enum zeroalloc_free_result {
  ZEROALLOC_FREED = 0,       /**< it was a live allocation of zeroalloc's, and is freed */
  ZEROALLOC_NOT_OWNED = 1,   /**< not zeroalloc's memory: nothing done, the caller frees it */
  ZEROALLOC_FREE_FAILED = -1 /**< zeroalloc's memory, but see zeroalloc_last_error() */
} zeroalloc_free_result;

/**
 * Frees `ptr` when it is zeroalloc's, as cudaFree or cudaFreeAsync would, and leaves any
 * other pointer alone. With `synchronize` NULL, the free is ordered on `stream`, as
 * cudaFreeAsync's: the memory is reused on other streams only once the work enqueued on
 * `stream` so far has completed (on its allocation stream at once). With `synchronize` set,
 * the free is ordered on no stream, as cudaFree's, and `stream` is ignored: zeroalloc first
 * calls `synchronize` (the caller's real cudaDeviceSynchronize or cuCtxSynchronize, which
 * wait for the calling thread's current device as cudaFree does), so work on any stream
 * that may still use the memory has finished before it can be reused. `synchronize` is
 * called only for memory zeroalloc owns; its result is the device's, reported by the
 * program's next call, and is ignored here.
 * Returns a zeroalloc_free_result: ZEROALLOC_NOT_OWNED for NULL, for memory zeroalloc did not
 * allocate, and when the library could not start (it owns nothing then); ZEROALLOC_FREE_FAILED
 * with zeroalloc_last_error() and zeroalloc_last_error_code() set when `ptr` lies in
 * zeroalloc's memory but is not a live allocation (freed twice, or inside one: code 1, as
 * CUDA answers) or the device failed (code 999); the allocation then stays live.
 */
int zeroalloc_free_if_owned(void* ptr, zeroalloc_stream_t stream, int (*synchronize)(void));

/**
 * What cudaMemGetInfo answers under zeroalloc for `device`: `*total_bytes` receives the limit
 * in force (ZEROALLOC_MEMORY_LIMIT, zeroalloc_set_memory_fraction, else the device's memory),
 * `*free_bytes` that limit less the memory zeroalloc holds (its cache included), and never
 * more than the device has free: memory held outside zeroalloc (other processes, VMM calls
 * that pass it by) is not zeroalloc's to give. Either pointer may be NULL. Returns 0, or -1
 * with zeroalloc_last_error() set when `device` is not valid or the library could not start.
 */
int zeroalloc_memory_info(int device, uint64_t* free_bytes, uint64_t* total_bytes);

/**
 * Call before destroying a stream that zeroalloc memory was allocated, used or freed on
 * (cudaStreamDestroy, cuStreamDestroy): waits for the work enqueued on `stream` so far and
 * detaches the blocks zeroalloc cached for it on every device, so that no fence is ever
 * recorded on the destroyed stream and a new stream that gets the same handle back does not
 * reuse them before the old stream's work has run. A stream zeroalloc never saw costs
 * nothing. NULL and CUDA's special handles (never destroyed) are ignored, and so is every
 * stream before the library has started: it knows none then, and is not started for this.
 * zeroalloc_stream_destroy does this itself. Returns 0, or -1 with zeroalloc_last_error()
 * set when a device failed while waiting.
 */
int zeroalloc_forget_stream(zeroalloc_stream_t stream);

/* ---- Offload (ZEROALLOC_OFFLOAD=host) ------------------------------------------------- *
 * Hints are a promise. Once work on an allocation is hinted (use begins ... use ends), the
 * engine fetches and evicts its chunks ahead of need without waiting for the streams, and
 * so assumes that every use of memory in those chunks is hinted: a chunk holds several
 * allocations of one class, so hint all uses of a class's allocations, or none.
 * zeroalloc.torch's offload() does (module hooks, the windowed optimizer step). */

/** Where an allocation's bytes are (zeroalloc_residency). */
typedef enum zeroalloc_residency_kind {
  ZEROALLOC_ON_DEVICE = 0,       /**< every chunk in device memory */
  ZEROALLOC_ON_HOST = 1,         /**< every chunk in pinned host memory (kernels still reach it) */
  ZEROALLOC_SPLIT = 2,           /**< some chunks in one tier, some in another */
  ZEROALLOC_MOVING = 3,          /**< a chunk is moving */
  ZEROALLOC_ON_DISK = 4,         /**< every chunk in the NVMe tier (hint a use first) */
  ZEROALLOC_ON_HOST_UNMAPPED = 5 /**< every chunk in pinned host memory behind addresses no
                                      kernel may touch (ZEROALLOC_PARK_PARAMETERS: hint a use
                                      first) */
} zeroalloc_residency_kind;

/**
 * Hint: the allocation starting at `pointer` is about to be used by work enqueued on
 * `stream`. On return its bytes are on the device or arriving in `stream`'s order, and what
 * the learned access order says comes next is being fetched. Ignored for memory zeroalloc
 * does not offload. Never fails; errors go to the log.
 */
void zeroalloc_use_begins(const void* pointer, zeroalloc_stream_t stream);

/**
 * Hint: the allocation starting at `pointer` is about to be used on `stream` where it is,
 * on the device or in pinned host memory (kernels reach both; a caller may also copy it to
 * device scratch and back). On return no part of it is moving, and none moves until
 * zeroalloc_use_ends. Such uses are not fetched and not learned: meant for data a step
 * touches once, in one pass (optimizer states), for which a remap costs more than the
 * transfer. One exception: a parameter parked behind unmapped addresses
 * (ZEROALLOC_PARK_PARAMETERS) is fetched when the device has room, its bytes arriving in
 * `stream`'s order (work on other streams must wait for `stream`), else mapped on the host.
 * Never fails; errors go to the log.
 */
void zeroalloc_use_in_place(const void* pointer, zeroalloc_stream_t stream);

/** Hint: the work enqueued on `stream` so far is the allocation's last use for now
 *  (after zeroalloc_use_begins or zeroalloc_use_in_place). */
void zeroalloc_use_ends(const void* pointer, zeroalloc_stream_t stream);

/**
 * The three hints above for `count` allocations at once (a module's parameters, a window of
 * optimizer states): the same as one call per pointer, in order, at a fraction of the cost.
 * Each pointer is a use of its own, so uses begun together may end one by one.
 */
void zeroalloc_use_begins_many(const void* const* pointers, size_t count,
                               zeroalloc_stream_t stream);
void zeroalloc_use_in_place_many(const void* const* pointers, size_t count,
                                 zeroalloc_stream_t stream);
void zeroalloc_use_ends_many(const void* const* pointers, size_t count, zeroalloc_stream_t stream);

/** Hint: a training step ended; the access order recorded during it becomes the learned one.
 * A memory report (ZEROALLOC_REPORT) marks the boundary on its timeline and shows per step
 * what each allocation class held on the device, what moved and how long the device waited;
 * also without offload. */
void zeroalloc_step_boundary(void);

/**
 * Moves the allocation starting at `pointer` to pinned host memory (its address stays the
 * same; kernels still reach it, over PCIe), waiting for the move when `wait` is non-zero.
 * The move starts after the work already queued on the allocation's streams; with `wait`
 * zero, queue no new work on the allocation until zeroalloc_residency stops answering
 * ZEROALLOC_MOVING, or its writes may be lost. A chunk the allocation shares with another
 * allocation in use (between zeroalloc_use_begins and zeroalloc_use_ends) stays where it is.
 * 0 on success; -1 with zeroalloc_last_error() set when offload is off, `pointer` is not a
 * live allocation, or the host tier is full (ZEROALLOC_HOST_LIMIT).
 */
int zeroalloc_offload(const void* pointer, int wait);

/** Brings the allocation back to device memory; as zeroalloc_offload (with the same rule for
 *  `wait` zero, and a chunk with a use open stays where it is: moving it could lose the
 *  writes that use still queues). */
int zeroalloc_fetch(const void* pointer, int wait);

/** A zeroalloc_residency_kind, or -1 with zeroalloc_last_error() set. */
int zeroalloc_residency(const void* pointer);

/** torch.optim.AdamW's settings for one zeroalloc_adamw_on_host call (amsgrad off).
 *  `step` counts this step (1 on the first), as the bias corrections read it. */
typedef struct zeroalloc_adamw_settings {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  int64_t step;
  int maximize; /**< non-zero: ascend the gradient */
} zeroalloc_adamw_settings;

/**
 * One AdamW step of `count` parameters on the host's CPUs (those of the GPU's NUMA node),
 * where their bytes are: each parameter, its gradient and both moments are `counts[i]`
 * float32 elements, and every pointer is the start of an allocation (a gradient may also be
 * host memory of the caller's, pinned or not). The device's work on them queued on `stream`
 * (and on their own streams) is waited for first. Returns 1 when stepped; 0 when some
 * allocation has a chunk in device memory or on disk: nothing was changed, step them on the
 * device; 2 when this driver does not open host memory to the CPUs (nothing was changed, and
 * no later call will step either); -1 with zeroalloc_last_error() set. Not bit for bit the device's
 * AdamW: rounding differs by a few ulps per step.
 */
int zeroalloc_adamw_on_host(void* const* parameters, const void* const* gradients,
                            void* const* exp_avgs, void* const* exp_avg_sqs, const size_t* counts,
                            size_t count, const zeroalloc_adamw_settings* settings,
                            zeroalloc_stream_t stream);

/**
 * zeroalloc_adamw_on_host for fp32 master weights trained in bf16: each gradient is
 * `counts[i]` bf16 elements of host memory of the caller's (pinned or not), and the updated
 * master is also written to `copies[i]`, `counts[i]` bf16 elements of host memory of the
 * caller's, rounded to nearest, ties to even (PyTorch's cast): the working copy the device
 * computes with. Masters and moments are float32 allocations as above. Same answers.
 */
int zeroalloc_adamw_on_host_bf16(void* const* masters, const void* const* gradients,
                                 void* const* exp_avgs, void* const* exp_avg_sqs,
                                 void* const* copies, const size_t* counts, size_t count,
                                 const zeroalloc_adamw_settings* settings,
                                 zeroalloc_stream_t stream);

/**
 * Measures, in parameters a second, how fast the host step's CPUs (those of `device`'s NUMA
 * node, as zeroalloc_adamw_on_host_bf16 uses them) run AdamW with master weights, over
 * `parameters` of them (16 bytes each, held during the call; 0: 64 Mi). It takes about as
 * long as stepping them. Returns 0, or -1 with zeroalloc_last_error() set when the device
 * does not exist or the host has not that much memory available above its reserve.
 */
int zeroalloc_host_adamw_rate(int device, size_t parameters, double* parameters_per_second);

/**
 * Pinned host memory for copies between the host and `device`: at least `bytes` (a whole
 * number of the host's pages) of page-locked memory, on the device's NUMA node where the host
 * lets it, that the CPUs read and write at `*address` and copies on the device's streams
 * reach as they reach cudaHostAlloc's memory. It may take seconds (about 0.25 s a GiB), and
 * other threads run meanwhile: make it ahead, on a thread of its own. Returns 0, or -1 with
 * zeroalloc_last_error() set (and `*address` untouched) when `bytes` is 0, the device does
 * not exist, the buffer would leave the host less memory than the reserve it keeps (pinned
 * memory cannot be swapped), or the driver refuses to pin it.
 */
int zeroalloc_pinned_create(int device, size_t bytes, void** address);

/**
 * Releases a buffer zeroalloc_pinned_create made, once the work queued so far on `stream`
 * (the copies into and out of it) is done. Use it no more after this call. Returns 0, or -1
 * with zeroalloc_last_error() set when `address` is not such a buffer.
 */
int zeroalloc_pinned_release(void* address, zeroalloc_stream_t stream);

/** Bytes of pinned memory zeroalloc_pinned_create holds for `device` now (released buffers
 *  whose copies are still queued included), or -1 with zeroalloc_last_error() set. */
int64_t zeroalloc_pinned_bytes(int device);

/** Severities of zeroalloc_log, as ZEROALLOC_LOG_LEVEL names them. */
typedef enum zeroalloc_log_level {
  ZEROALLOC_LOG_DEBUG = 1,
  ZEROALLOC_LOG_INFO = 2,
  ZEROALLOC_LOG_WARN = 3,
  ZEROALLOC_LOG_ERROR = 4
} zeroalloc_log_level;

/** Writes `message` to the library's log (ZEROALLOC_LOG_FILE, else standard error) at
 *  `level`, when ZEROALLOC_LOG_LEVEL lets it through: what the layers above tell the user.
 *  Returns 0, or -1 with zeroalloc_last_error() set for an unknown level or a NULL message. */
int zeroalloc_log(int level, const char* message);

/**
 * Groups of ranks (ZeRO across GPUs). Joins this process to the group of the job it runs in,
 * from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): rank 0
 * hands the others the group's id over TCP at MASTER_PORT + 1, and every rank checks that all
 * share `agreement` (the settings that must match, say "ZEROALLOC_ZERO_STAGE=2"). On GPUs
 * the collectives run over NCCL on LOCAL_RANK's device; on the simulated device over TCP at
 * MASTER_PORT + 2, through rank 0. A collective or join that a rank cannot complete
 * (mixed settings, a rank that died or stopped calling) fails on every rank within
 * `timeout_ms` (0: five minutes) with one message naming the rank and the cause. 0 on
 * success; -1 with zeroalloc_last_error() set.
 */
int zeroalloc_group_join(const char* agreement, int timeout_ms);
/** This process's rank in its group and the group's size; -1 before zeroalloc_group_join. */
int zeroalloc_group_rank(void);
int zeroalloc_group_size(void);
/** Every rank's `bytes` at `send` into every rank's `receive` (size x `bytes`, in rank
 *  order), in `stream`'s order. 0 or -1. */
int zeroalloc_group_all_gather(const void* send, void* receive, size_t bytes,
                               zeroalloc_stream_t stream);
/** The sum over ranks of `send` (size x `count` elements, float32, or bfloat16 when
 *  `bfloat16` is not 0), cut by rank: this rank's `count` elements land in `receive`. */
int zeroalloc_group_reduce_scatter(const void* send, void* receive, size_t count, int bfloat16,
                                   zeroalloc_stream_t stream);
/** `root`'s `bytes` at `buffer` into every rank's `buffer`. 0 or -1. */
int zeroalloc_group_broadcast(void* buffer, size_t bytes, int root, zeroalloc_stream_t stream);
/** The sum over ranks of `send` (`count` elements, float32, or bfloat16 when `bfloat16` is
 *  not 0) into `root`'s `receive` (which may be `send`); the other ranks' `receive` is not
 *  touched. 0 or -1. */
int zeroalloc_group_reduce(const void* send, void* receive, size_t count, int bfloat16, int root,
                           zeroalloc_stream_t stream);
/** This rank failed for `why`: every rank's collectives from now on fail naming it. */
void zeroalloc_group_abort(const char* why);

#ifdef __cplusplus
}
#endif

#endif /* ZEROALLOC_ZEROALLOC_H */
