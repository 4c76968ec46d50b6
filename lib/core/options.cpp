#include "core/options.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/errors.hpp"
#include "core/units.hpp"

extern char** environ;

namespace zeroalloc {

namespace {

constexpr std::string_view kPrefix = "ZEROALLOC_";

std::string lowercase(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

std::string_view trim(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) {
    text.remove_prefix(1);
  }
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) {
    text.remove_suffix(1);
  }
  return text;
}

// Parses a non-negative decimal number ("12", "1.5"); nullopt on anything else.
std::optional<double> parse_decimal(std::string_view text) {
  if (text.empty() || text.front() == '-' || text.front() == '+') return std::nullopt;
  double value = 0;
  auto [end, status] =
      std::from_chars(text.data(), text.data() + text.size(), value, std::chars_format::fixed);
  if (status != std::errc() || end != text.data() + text.size() || !std::isfinite(value)) {
    return std::nullopt;
  }
  return value;
}

[[noreturn]] void reject(std::string_view name, std::string_view value, std::string_view form) {
  ZA_THROW(config_error, name, "='", value, "' is not valid: expected ", form, ".");
}

// ---- The readers: each parses one kind of value (trimmed; a text as it is) ---------------

std::string read_choice(const option_spec& spec, std::string_view value) {
  const std::string word = lowercase(trim(value));
  std::string_view rest = spec.choices;
  while (!rest.empty()) {
    const std::size_t bar = rest.find('|');
    if (rest.substr(0, bar) == word) return word;
    rest = bar == std::string_view::npos ? std::string_view() : rest.substr(bar + 1);
  }
  reject(spec.name, value, std::string("one of ") + std::string(accepted_form(spec)));
}

// A yes or a no, in any of the words the boolean settings accept; nothing for another word.
std::optional<bool> parse_yes_no(const std::string& word) {
  if (word == "1" || word == "true" || word == "yes" || word == "on") return true;
  if (word == "0" || word == "false" || word == "no" || word == "off") return false;
  return std::nullopt;
}

// A choice of auto, 1 or 0, where 1 and 0 may be written as any yes or no.
std::string read_choice_or_boolean(const option_spec& spec, std::string_view value) {
  const std::string word = lowercase(trim(value));
  if (const std::optional<bool> yes = parse_yes_no(word)) return *yes ? "1" : "0";
  if (word == "auto") return word;
  reject(spec.name, value, "auto, 1 or 0 (also true/false, yes/no, on/off)");
}

std::uint64_t read_byte_size(const option_spec& spec, std::string_view value) {
  const std::optional<std::uint64_t> bytes = parse_byte_size(value);
  if (!bytes || *bytes == 0) reject(spec.name, value, accepted_form(spec));
  return *bytes;
}

// A chunk is mapped as a unit: a whole number of the device's mapping granularity.
std::uint64_t read_chunk_size(const option_spec& spec, std::string_view value) {
  const std::uint64_t bytes = read_byte_size(spec, value);
  if (bytes % (2 * MiB) != 0) {
    reject(spec.name, value,
           "a multiple of 2MiB (the device's mapping granularity), such as 64MiB");
  }
  return bytes;
}

memory_limit read_memory_limit(const option_spec& spec, std::string_view value) {
  const std::string_view trimmed = trim(value);
  memory_limit limit;
  limit.text = std::string(trimmed);
  if (!trimmed.empty() && trimmed.back() == '%') {
    const std::optional<double> percent =
        parse_decimal(trim(trimmed.substr(0, trimmed.size() - 1)));
    if (!percent || *percent <= 0 || *percent > 100) reject(spec.name, value, accepted_form(spec));
    limit.share = *percent / 100.0;
  } else if (trimmed.find('.') != std::string_view::npos &&
             trimmed.find_first_not_of("0123456789.") == std::string_view::npos) {
    const std::optional<double> share = parse_decimal(trimmed);
    if (!share || *share <= 0 || *share > 1) {
      reject(spec.name, value,
             "a share between 0 and 1 (such as 0.9), or a byte size such as 80GB");
    }
    limit.share = *share;
  } else {
    const std::optional<std::uint64_t> bytes = parse_byte_size(trimmed);
    if (!bytes || *bytes == 0) reject(spec.name, value, accepted_form(spec));
    limit.bytes = *bytes;
  }
  return limit;
}

int read_count(const option_spec& spec, std::string_view value) {
  const std::string_view trimmed = trim(value);
  int number = 0;
  auto [end, status] = std::from_chars(trimmed.data(), trimmed.data() + trimmed.size(), number);
  if (status != std::errc() || end != trimmed.data() + trimmed.size() || number < 1 ||
      number > kMostDevices) {
    reject(spec.name, value, accepted_form(spec));
  }
  return number;
}

bool read_boolean(const option_spec& spec, std::string_view value) {
  if (const std::optional<bool> yes = parse_yes_no(lowercase(trim(value)))) return *yes;
  reject(spec.name, value, accepted_form(spec));
}

std::string read_text(const option_spec&, std::string_view value) { return std::string(value); }

// A row's `read`: parses with `read_value` and stores the result in `field`.
template <auto field, auto read_value>
void store(const option_spec& spec, std::string_view value, options& parsed) {
  parsed.*field = read_value(spec, value);
}

// A row's `read` for a variable the library checks but others act on (the Python package,
// the hooks): a bad value still stops the start, and names the variable.
template <auto read_value>
void check(const option_spec& spec, std::string_view value, options& /*parsed*/) {
  read_value(spec, value);
}

// Note [Before the library's constructors]: under LD_PRELOAD, the constructors of the
// program's own libraries run before this library's, and one may already call cudaMalloc,
// which starts zeroalloc. So nothing that start reads is a namespace-scope object with a
// dynamic initialiser (it would still be empty): the table and the logger are made on
// first use.
const std::vector<option_spec>& table() {
  static const std::vector<option_spec> kTable = {
      {"ZEROALLOC_DEVICE", option_kind::choice, "auto", "auto|cuda|sim",
       "Which device backs allocations: cuda (the GPU through the CUDA driver), sim (the "
       "simulated device in host memory), or auto (cuda when a driver and a GPU are present, "
       "else sim).",
       store<&options::device, read_choice>},
      {"ZEROALLOC_MEMORY_LIMIT", option_kind::byte_size_or_device_share, "", "",
       "Most device memory zeroalloc may hold per device, in bytes with a unit (512MiB, 80GB) "
       "or as a share of the device (0.9, 90%). Unset: the whole device.",
       store<&options::limit, read_memory_limit>},
      {"ZEROALLOC_CHUNK_SIZE", option_kind::byte_size, "64MiB", "",
       "Size of the physical memory chunks that back large allocations and that later tiers "
       "move as a unit; a multiple of the device's 2 MiB granularity.",
       store<&options::chunk_bytes, read_chunk_size>},
      {"ZEROALLOC_LOG_LEVEL", option_kind::choice, "warn", "trace|debug|info|warn|error|off",
       "Least severe message that is logged.", store<&options::log_level, read_choice>},
      {"ZEROALLOC_LOG_FILE", option_kind::text, "", "",
       "Write the log to this file instead of standard error.",
       store<&options::log_file, read_text>},
      {"ZEROALLOC_SIM_MEMORY", option_kind::byte_size, "8GiB", "",
       "Memory of each simulated device (ZEROALLOC_DEVICE=sim).",
       store<&options::sim_memory_bytes, read_byte_size>},
      {"ZEROALLOC_SIM_DEVICES", option_kind::count, "2", "",
       "Number of simulated devices (ZEROALLOC_DEVICE=sim).",
       store<&options::sim_device_count, read_count>},
      {"ZEROALLOC_SIM_MAPS_SLICES", option_kind::boolean, "1", "",
       "0 makes the simulated device map only whole physical allocations, as CUDA drivers do "
       "(the host tier then takes the paths it takes on a GPU).",
       store<&options::sim_maps_slices, read_boolean>},
      {"ZEROALLOC_REPORT", option_kind::text, "", "",
       "Path prefix of memory reports: prefix.json and prefix.html are written at exit, when an "
       "allocation fails out of memory, and on SIGUSR1, with a summary in the log.",
       store<&options::report_prefix, read_text>},
      {"ZEROALLOC_DISABLE", option_kind::boolean, "0", "",
       "1 makes a preloaded libzeroalloc.so inert: every CUDA call goes to the real runtime and "
       "driver.",
       check<read_boolean>},
      {"ZEROALLOC_OFFLOAD", option_kind::choice, "none", "none|host",
       "host: when the device runs short, chunks of parameters, gradients and optimizer states "
       "move to pinned host memory (same addresses; kernels still reach them over PCIe) and come "
       "back before they are needed; the host pool is created in the background at start-up. "
       "none: everything stays on the device.",
       store<&options::offload, read_choice>},
      {"ZEROALLOC_ACCESS", option_kind::choice, "any", "any|hinted",
       "With ZEROALLOC_OFFLOAD=host, which kernels may touch the memory the engine moves. any: "
       "every kernel, on any stream, at any time (an EMA of the weights, a norm logged, a "
       "checkpoint): each move waits for the device to finish its queued work and ends before "
       "the program launches more, so a kernel never meets a chunk in motion. hinted: only "
       "the uses the Python package's hooks announce (the model's forward and backward, the "
       "optimizer's step); moves overlap compute and evicted parameters may be parked "
       "(ZEROALLOC_PARK_PARAMETERS). Under hinted, a kernel outside those uses may fail with "
       "CUDA's illegal-address error or read stale bytes.",
       store<&options::access, read_choice>},
      {"ZEROALLOC_OFFLOAD_GRADIENTS", option_kind::choice, "auto", "auto|0|1",
       "With ZEROALLOC_OFFLOAD=host, whether the Python package copies each parameter's gradient "
       "into the gradient class once a step (zeroalloc.torch.offload's gradient_class), where it "
       "can move to the host before the activations do. auto: off until a step had to move "
       "class other (activations) to the host, then on for a trial of a few steps, kept only "
       "where it was not slower. 1 (or yes, on): always; training fits under a lower limit, at "
       "a cost in speed where the states alone could make room. 0 (or no, off): never.",
       store<&options::offload_gradients, read_choice_or_boolean>},
      {"ZEROALLOC_RECIPE", option_kind::choice, "exact", "exact|fast",
       "With ZEROALLOC_OFFLOAD=host, what the Python package may change in the numbers to train "
       "faster. exact: nothing; a run computes what it computes natively, bit for bit. fast: "
       "DeepSpeed's bf16 recipe with its optimizer on the CPUs: the model computes in bf16 "
       "against fp32 master weights (ZEROALLOC_MASTER_WEIGHTS=bf16), and AdamW steps the "
       "masters the host holds on the CPUs (ZEROALLOC_HOST_STEP=1), whose rounding differs "
       "from the device's. On a 1.3B Llama at a 13.3 GiB limit, fast ran 5 x exact. Unset "
       "(exact), a run whose steps move memory says once, in the log and the report, the step "
       "time fast would give it; set to exact, it says nothing. Either variable set on its own "
       "overrides the recipe; under ZEROALLOC_ZERO_STAGE, fast leaves master weights out (they "
       "do not combine with ZeRO yet).",
       check<read_choice>},
      {"ZEROALLOC_HOST_STEP", option_kind::boolean, "", "",
       "1: with ZEROALLOC_OFFLOAD=host, the Python package's windowed optimizer step runs AdamW "
       "on the CPUs of the GPU's NUMA node for each window whose parameters and states are all "
       "on the host, copying only the gradients there (not bit for bit the device's AdamW: "
       "rounding differs). 0: every window steps on the device. Unset: 1 under "
       "ZEROALLOC_RECIPE=fast, else 0.",
       check<read_boolean>},
      {"ZEROALLOC_HOST_STEP_OVERLAP", option_kind::boolean, "1", "",
       "1: under ZEROALLOC_ACCESS=hinted, with ZEROALLOC_HOST_STEP=1 and master weights, "
       "optimizer.step() returns once the device's windows are done, and the CPUs finish "
       "theirs while the next forward runs: each module's hinted use of a working copy waits "
       "for that copy's update (reads outside the model go through zeroalloc.torch.using). "
       "0: the step returns once every window is done. Under ZEROALLOC_ACCESS=any the step "
       "returns with the CPUs done, unless ZEROALLOC_HOST_STEP_GUARDED=1 asks for the guarded "
       "form, which 0 here turns off too.",
       check<read_boolean>},
      {"ZEROALLOC_HOST_STEP_GUARDED", option_kind::boolean, "0", "",
       "1: under ZEROALLOC_ACCESS=any, the CPUs may finish the host step's windows of master "
       "weights while the next forward runs, as under hinted, where the step can show that "
       "every read of a working copy goes through its parameter object: each is then of class "
       "GuardedParameter until its update is done, and any PyTorch call that reads it waits. "
       "The step checks that each is a plain nn.Parameter, that no other tensor holds its "
       "storage, that no CUDA graph was captured and that torch.compile compiled nothing; "
       "else it finishes within the step. Not seen: raw pointers outside PyTorch's calls (a "
       "C++ extension given a parameter outside its module's forward) and torch.distributed's "
       "collectives on a parameter. On a 1.3B Llama it ran 1.05 x the default at 13.3 GiB and "
       "1.23 x with checkpointing at 5.5 GiB.",
       check<read_boolean>},
      {"ZEROALLOC_BACKWARD_USES", option_kind::choice, "saved", "saved|all",
       "saved: the Python package's module hooks begin a parameter's use in the backward only "
       "when its module's forward saved it for the backward (under autocast a Linear saves "
       "the bf16 copy of its weight, and the fp32 weight stays where it is until the step). "
       "all: every parameter of a module is brought back for its backward (for an "
       "autograd.Function that keeps a parameter outside save_for_backward).",
       check<read_choice>},
      {"ZEROALLOC_MASTER_WEIGHTS", option_kind::choice, "", "none|bf16",
       "bf16: with ZEROALLOC_OFFLOAD=host, the Python package trains the model in bf16 as "
       "DeepSpeed's bf16 mode does: each fp32 parameter of an optimizer becomes a bf16 working "
       "copy and the optimizer steps an fp32 master copy that the engine keeps with the "
       "optimizer's states (on the host under pressure, stepped there with "
       "ZEROALLOC_HOST_STEP=1). none: parameters keep their dtype. Unset: bf16 under "
       "ZEROALLOC_RECIPE=fast, else none. zeroalloc.torch.offload's master_weights overrides "
       "it.",
       check<read_choice>},
      {"ZEROALLOC_HOST_LIMIT", option_kind::byte_size_or_host_share, "0.5", "",
       "Most pinned host memory the host tier holds, in bytes with a unit (64GiB) or as a share "
       "of the host's memory (0.5, 50%), split among the GPUs of the process and the processes "
       "of the machine (LOCAL_WORLD_SIZE); a byte size is per GPU. The default leaves half to the "
       "host itself. Whatever the limit, pinned memory is never created past what leaves the "
       "host a sixteenth of its memory available (other processes may pin theirs): beyond "
       "that, offloading fails with a message instead of calling the out-of-memory killer. It "
       "comes from the GPU's NUMA node when that node has room, else from any node.",
       store<&options::host_limit, read_memory_limit>},
      {"ZEROALLOC_PREFETCH_BYTES", option_kind::byte_size, "512MiB", "",
       "How far ahead along the learned access order the offload engine brings chunks back to "
       "the device, in bytes; it keeps that much device memory free for them.",
       store<&options::prefetch_bytes, read_byte_size>},
      {"ZEROALLOC_VERIFY", option_kind::boolean, "0", "",
       "1 checksums every chunk the offload engine moves, before and after, and stops with an "
       "error naming the chunk when the bytes changed in transit (for tests and bug hunts).",
       store<&options::verify, read_boolean>},
      {"ZEROALLOC_TORCH", option_kind::choice, "native", "native|zeroalloc",
       "Which allocator PyTorch uses when the Python package's start-up hook is active "
       "(libzeroalloc.so preloaded, or this variable set): native keeps PyTorch's caching "
       "allocator on top of zeroalloc; zeroalloc makes zeroalloc PyTorch's allocator the moment "
       "torch is imported, as zeroalloc.torch.install() does.",
       check<read_choice>},
      {"ZEROALLOC_COLLECTIVES", option_kind::choice, "nccl", "nccl|tcp",
       "How the ranks of a group on GPUs exchange bytes (the ZeRO stages' collectives). nccl: "
       "NCCL, one GPU per rank. tcp: through rank 0 over TCP, each rank's bytes copied to "
       "the host and back: slow, but ranks may share a GPU (NCCL refuses two ranks on one), "
       "so a job of several ranks runs on one GPU, as tests do. Every rank must set the same "
       "value. Ranks on the simulated device always use tcp.",
       store<&options::collectives, read_choice>},
      {"ZEROALLOC_ZERO_STAGE", option_kind::choice, "0", "0|1|2|3",
       "With the Python package's start-up hook under torchrun: partitions every optimizer "
       "across the ranks (ZeRO). 1: each rank steps its share of the parameters, holds only "
       "their optimizer states and broadcasts them to the others (the gradients reduced as "
       "DistributedDataParallel does); 2: and each gradient goes to its owner alone (the "
       "script's DistributedDataParallel leaves them to it); 3: and a rank keeps only its "
       "own parameters, the others gathered while a module uses them. Every rank must set "
       "the same value.",
       check<read_choice>},
      {"ZEROALLOC_NVME_PATH", option_kind::text, "", "",
       "Directories for the NVMe tier behind the host tier, separated by ':' (one per drive; "
       "a swap file in each, striped, with no name on disk). With ZEROALLOC_OFFLOAD=host and "
       "ZEROALLOC_NVME_SIZE, optimizer states the host tier cannot hold go there and come back "
       "through it before they are used; without ZEROALLOC_OFFLOAD=host the path is ignored, "
       "with a warning. Needs ZEROALLOC_ACCESS=hinted: a state on disk has "
       "nothing readable behind its addresses, so only the hooks' announced uses may read it. "
       "`python -m zeroalloc doctor` checks that each directory accepts O_DIRECT and measures "
       "its speed.",
       store<&options::nvme_path, read_text>},
      {"ZEROALLOC_NVME_SIZE", option_kind::byte_size, "", "",
       "Bytes of swap space the NVMe tier takes over the directories of ZEROALLOC_NVME_PATH, "
       "per GPU, preallocated when the GPU is first used (a drive without room is an error "
       "then, naming it and the bytes needed). Needed with ZEROALLOC_NVME_PATH.",
       store<&options::nvme_bytes, read_byte_size>},
      {"ZEROALLOC_NVME_PARAMETERS", option_kind::boolean, "0", "",
       "1 lets parameters go to the NVMe tier too when the host tier is full, the chunk "
       "needed farthest ahead first: only chunks every use of which came with hints "
       "(zt.offload, or the no-code-change mode's hooks) and untouched by any allocation "
       "since. A parameter on disk must not be read without a hint: model.state_dict() or "
       "torch.save then fail with CUDA's illegal-address error (fetch first: "
       "zt.fetch_tensor), rather than read wrong bytes.",
       store<&options::nvme_parameters, read_boolean>},
      {"ZEROALLOC_PARK_PARAMETERS", option_kind::boolean, "1", "",
       "With ZEROALLOC_ACCESS=hinted only (never under any). "
       "1: a parameter evicted while every use of it is hinted (zt.offload, or the "
       "no-code-change mode's hooks) keeps its bytes in pinned host memory with its addresses "
       "unmapped until its next use brings it back: mapping host memory costs the driver "
       "about 1 ms per 64 MiB, mapping none 4 us. A read of such a parameter outside the "
       "model's forward and backward (a kernel the hooks do not see) fails with CUDA's "
       "illegal-address error instead of reading wrong bytes; model.state_dict() is safe. "
       "0 keeps evicted parameters mapped, readable over PCIe by any kernel (slower under "
       "pressure; for scripts that read parameters outside the model's calls).",
       store<&options::park_parameters, read_boolean>},
      {"ZEROALLOC_LIBRARY", option_kind::text, "", "",
       "Path of libzeroalloc.so for the Python package, when it is not next to the package or "
       "in the build tree.",
       check<read_text>},
  };
  return kTable;
}

}  // namespace

const std::vector<option_spec>& option_table() { return table(); }

std::string_view accepted_form(const option_spec& spec) {
  switch (spec.kind) {
    case option_kind::byte_size:
      return "a byte size such as 512MiB, 80GB or 1048576";
    case option_kind::byte_size_or_device_share:
      return "a byte size such as 512MiB or 80GB, or a share of the device such as 0.9 or 90%";
    case option_kind::byte_size_or_host_share:
      return "a byte size such as 64GiB, or a share of the host's memory such as 0.5 or 50%";
    case option_kind::boolean:
      return "1 or 0 (also true/false, yes/no, on/off)";
    case option_kind::count:
      return "a whole number from 1 to 64";
    case option_kind::choice:
      return spec.choices;
    case option_kind::text:
      return "a non-empty text";
  }
  return "";
}

std::uint64_t memory_limit::resolve(std::uint64_t total_bytes) const {
  if (bytes) return std::min(*bytes, total_bytes);
  if (share) return static_cast<std::uint64_t>(static_cast<double>(total_bytes) * *share);
  return total_bytes;
}

std::optional<std::uint64_t> parse_byte_size(std::string_view text) {
  text = trim(text);
  std::size_t split = 0;
  while (split < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[split])) || text[split] == '.')) {
    ++split;
  }
  const std::optional<double> number = parse_decimal(text.substr(0, split));
  if (!number) return std::nullopt;
  const std::string unit = lowercase(trim(text.substr(split)));
  double multiplier = 0;
  if (unit.empty() || unit == "b") {
    multiplier = 1;
  } else if (unit == "k" || unit == "kib") {
    multiplier = 0x1p10;
  } else if (unit == "m" || unit == "mib") {
    multiplier = 0x1p20;
  } else if (unit == "g" || unit == "gib") {
    multiplier = 0x1p30;
  } else if (unit == "t" || unit == "tib") {
    multiplier = 0x1p40;
  } else if (unit == "kb") {
    multiplier = 1e3;
  } else if (unit == "mb") {
    multiplier = 1e6;
  } else if (unit == "gb") {
    multiplier = 1e9;
  } else if (unit == "tb") {
    multiplier = 1e12;
  } else {
    return std::nullopt;
  }
  // "16.1KB" is 16100.000000000002 in binary floating point: accept what is whole within
  // rounding error, refuse real fractions of a byte.
  const double bytes = *number * multiplier;
  const double whole = std::round(bytes);
  if (whole >= 0x1p64 || std::fabs(bytes - whole) > 1e-6 * std::max(1.0, whole))
    return std::nullopt;
  return static_cast<std::uint64_t>(whole);
}

options options::parse(const std::function<const char*(const char*)>& lookup,
                       const std::vector<std::string>& variable_names) {
  for (const std::string& name : variable_names) {
    const std::vector<option_spec>& known_names = table();
    const bool known = std::any_of(known_names.begin(), known_names.end(),
                                   [&](const option_spec& spec) { return spec.name == name; });
    if (!known) {
      ZA_THROW(config_error, name,
               " is not a zeroalloc variable: unset it, or check its spelling against the "
               "list in docs/settings.md (python -m zeroalloc settings prints it too).");
    }
  }

  options parsed;
  for (const option_spec& spec : table()) {
    const std::string name(spec.name);
    const char* raw = lookup(name.c_str());
    const bool from_user = raw != nullptr;
    const std::string_view value = from_user ? std::string_view(raw) : spec.default_value;
    if (from_user && trim(value).empty()) {
      ZA_THROW(config_error, name, " is set but empty: expected ", accepted_form(spec),
               ". Unset it to use the default",
               spec.default_value.empty()
                   ? ""
                   : std::string(" (") + std::string(spec.default_value) + ")",
               ".");
    }
    if (value.empty()) continue;  // unset, no default
    spec.read(spec, value, parsed);
  }
  return parsed;
}

options options::from_environment() {
  std::vector<std::string> names;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string_view variable(*entry);
    if (variable.substr(0, kPrefix.size()) != kPrefix) continue;
    names.emplace_back(variable.substr(0, variable.find('=')));
  }
  return parse([](const char* name) { return std::getenv(name); }, names);
}

}  // namespace zeroalloc
