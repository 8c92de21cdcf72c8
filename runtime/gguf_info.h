// Reading a GGUF file's header: architecture, key-values and tensor table, no tensor data.
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

namespace dflash {

// A metadata value: scalars widen to int64/uint64/double; arrays keep their element kind.
using gguf_value = std::variant<bool, int64_t, uint64_t, double, std::string,
                                std::vector<int64_t>, std::vector<uint64_t>, std::vector<double>,
                                std::vector<bool>, std::vector<std::string>>;

struct gguf_kv_entry {
    std::string key;
    gguf_value  value;
};

struct gguf_tensor_entry {
    std::string          name;
    std::vector<int64_t> shape;   // ggml order: shape[0] is the fastest-moving dimension (ne0)
    std::string          type;    // ggml type name, e.g. "f32", "q4_1"
    uint64_t             offset;  // from the start of the data section
    uint64_t             nbytes;
};

struct gguf_file_info {
    std::string                    path;
    std::string                    architecture;  // general.architecture, "" if absent
    uint32_t                       version = 0;
    uint64_t                       alignment = 0;
    uint64_t                       data_offset = 0;
    std::vector<gguf_kv_entry>     metadata;
    std::vector<gguf_tensor_entry> tensors;
};

// Throws std::invalid_argument naming the path and the reason: missing, unreadable, not a GGUF,
// corrupt header, or truncated (tensor data extends past the end of the file).
gguf_file_info read_gguf_info(const std::string & path);

} // namespace dflash
