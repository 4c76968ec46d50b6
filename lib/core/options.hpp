// The options table: every ZEROALLOC_* environment variable, its type, default and help,
// parsed once at start-up (mimalloc's options.c is the model). A bad value is a
// config_error naming the variable, the value and the accepted form; the library then
// refuses to start rather than run with a guess.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace zeroalloc {

struct options;

/// How a variable's value is read, and so the accepted form its messages give.
enum class option_kind {
  byte_size,                  ///< "512MiB", "80GB", "1048576"
  byte_size_or_device_share,  ///< a byte_size, or a share of the device: "0.9", "90%"
  byte_size_or_host_share,    ///< a byte_size, or a share of the host's memory: "0.5", "50%"
  boolean,                    ///< 1/0, true/false, yes/no, on/off
  count,                      ///< a positive whole number
  choice,                     ///< one of a listed set of words
  text,                       ///< free text (a path, a name)
};

/// One row of the table. Adding a variable is adding a row: its `read` parses the value and
/// stores it in its field of `options` (or only checks it, for a variable the Python
/// package or the hooks read).
struct option_spec {
  std::string_view name;  ///< "ZEROALLOC_MEMORY_LIMIT"
  option_kind kind;
  std::string_view default_value;  ///< as the user would write it; empty = unset
  std::string_view choices;        ///< for option_kind::choice: "auto|cuda|sim"
  std::string_view help;           ///< one sentence, shown by zeroalloc_options_json
  /// Parses `value` (as set, or the default; never empty) into `parsed`. Throws
  /// config_error naming the variable, the value and the accepted form.
  void (*read)(const option_spec& spec, std::string_view value, options& parsed);
};

/// Every variable the library reads, in the order of docs/settings.md's table (options_test checks
/// that the two agree).
const std::vector<option_spec>& option_table();

/// The accepted form of a variable's value, as error messages and `doctor` say it.
std::string_view accepted_form(const option_spec& spec);

/// A memory limit: nothing, an absolute byte count, or a share of each device's memory.
struct memory_limit {
  std::optional<std::uint64_t> bytes;
  std::optional<double> share;  ///< in (0, 1]
  std::string text;             ///< as the user wrote it, for messages

  [[nodiscard]] bool is_set() const { return bytes || share; }
  /// The limit for a device with `total_bytes` of memory; total_bytes when unset.
  [[nodiscard]] std::uint64_t resolve(std::uint64_t total_bytes) const;
};

/// The most devices one process drives (ZEROALLOC_SIM_DEVICES accepts up to this many).
inline constexpr int kMostDevices = 64;

/// The parsed options. Field names follow the variables (ZEROALLOC_CHUNK_SIZE -> chunk_bytes).
struct options {
  std::string device = "auto";         ///< ZEROALLOC_DEVICE
  memory_limit limit;                  ///< ZEROALLOC_MEMORY_LIMIT
  std::size_t chunk_bytes = 0;         ///< ZEROALLOC_CHUNK_SIZE
  std::string log_level = "warn";      ///< ZEROALLOC_LOG_LEVEL
  std::string log_file;                ///< ZEROALLOC_LOG_FILE
  std::string report_prefix;           ///< ZEROALLOC_REPORT
  std::uint64_t sim_memory_bytes = 0;  ///< ZEROALLOC_SIM_MEMORY
  int sim_device_count = 0;            ///< ZEROALLOC_SIM_DEVICES
  bool sim_maps_slices = true;         ///< ZEROALLOC_SIM_MAPS_SLICES
  std::string offload = "none";        ///< ZEROALLOC_OFFLOAD
  std::string access = "any";          ///< ZEROALLOC_ACCESS: any|hinted
  std::string offload_gradients =
      "auto";               ///< ZEROALLOC_OFFLOAD_GRADIENTS: auto|0|1 (read by the Python side)
  memory_limit host_limit;  ///< ZEROALLOC_HOST_LIMIT (a share of the host's memory)
  bool verify = false;      ///< ZEROALLOC_VERIFY
  std::uint64_t prefetch_bytes = 0;  ///< ZEROALLOC_PREFETCH_BYTES
  std::string nvme_path;             ///< ZEROALLOC_NVME_PATH
  std::uint64_t nvme_bytes = 0;      ///< ZEROALLOC_NVME_SIZE (0: unset)
  bool nvme_parameters = false;      ///< ZEROALLOC_NVME_PARAMETERS
  bool park_parameters = true;       ///< ZEROALLOC_PARK_PARAMETERS
  std::string collectives = "nccl";  ///< ZEROALLOC_COLLECTIVES (ranks on GPUs)

  /// Reads every ZEROALLOC_* variable through `lookup` (getenv by default) and rejects
  /// names not in the table. Throws config_error on the first bad value.
  static options parse(const std::function<const char*(const char*)>& lookup,
                       const std::vector<std::string>& variable_names);

  /// parse() over the process environment.
  static options from_environment();
};

/// Parses "512MiB", "80GB", "2m", "1048576" into bytes. Binary units (KiB, MiB, GiB, TiB,
/// and the bare letters K, M, G, T) are powers of 1024; KB, MB, GB, TB are powers of 1000.
/// Returns nullopt when the text is not such a size or overflows 64 bits.
std::optional<std::uint64_t> parse_byte_size(std::string_view text);

}  // namespace zeroalloc
