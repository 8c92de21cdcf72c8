// Reading a GGUF file's header: architecture, key-values and tensor table, no tensor data.
#pragma once

#include <cstdint>
#include <string>
#include <variant>
#include <vector>

struct gguf_context;
struct ggml_context;

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

// gguf_init_from_file (no tensor data) with ggml's log kept quiet. Null when gguf cannot parse the
// file; `why` then holds gguf's own first error, naming the key or tensor and the value it refused
// ("tensor 'x' has offset 7, expected 0"), or "" when it gave none.
gguf_context * open_gguf(const std::string & path, ggml_context ** meta, std::string & why);

// Throws std::invalid_argument "<path>: truncated: tensor '<name>' ends at byte N but the file has M"
// unless every tensor's bytes lie inside the file.
void check_tensors_in_file(const gguf_context * ctx, const std::string & path);

// --- checked reads of one GGUF's key-values (the draft loader and the target pre-check) ----------

bool is_valid_utf8(const std::string & s);

// `s` for a message: invalid UTF-8 replaced by U+FFFD, cut to `max_bytes` with "...".
std::string display_string(const std::string & s, size_t max_bytes = 80);

// Every read checks the key's type, integer ranges (before any narrowing) and that floats are
// finite. A failure throws std::invalid_argument, one line: "<path>: <key>: <value>, expected <what>".
class gguf_keys {
public:
    gguf_keys(const gguf_context * ctx, const std::string & path) : ctx_(ctx), path_(path) {}

    bool    has(const std::string & key) const { return find(key) >= 0; }
    int64_t find(const std::string & key) const;

    int64_t     integer(const std::string & key, int64_t lo, int64_t hi) const;  // required
    int64_t     integer_or(const std::string & key, int64_t fallback, int64_t lo, int64_t hi) const;
    double      number(const std::string & key, double lo, double hi) const;      // required, finite
    double      number_or(const std::string & key, double fallback, double lo, double hi) const;
    bool        boolean_or(const std::string & key, bool fallback) const;
    std::string string_or(const std::string & key, const std::string & fallback) const;
    // An array of integers, at most max_n of them, each in lo..hi (required).
    std::vector<int64_t> integers(const std::string & key, size_t max_n, int64_t lo, int64_t hi) const;
    // The number of entries of an array of strings (required).
    size_t n_strings(const std::string & key) const;

    // The value of key `id` as a message shows it: "uint32 7", "string 'abc'", "array of 3 string".
    std::string describe(int64_t id) const;
    [[noreturn]] void fail(const std::string & what, const std::string & value, const std::string & expected) const;
    [[noreturn]] void missing(const std::string & key, const std::string & hint) const;

    const gguf_context * ctx() const { return ctx_; }
    const std::string &  path() const { return path_; }

private:
    int64_t require(const std::string & key) const;
    [[noreturn]] void wrong_type(const std::string & key, int64_t id, const std::string & expected) const;

    const gguf_context * ctx_;
    std::string          path_;
};

// What a tensor is used for decides which ggml types the CPU graph can compute with it: a matrix
// multiplies f32 activations (a float or quantised type with a CPU dot product), a norm or other
// 1-D weight is an operand of an f32 binary op (f32 only), and so are convolution taps; rows are
// read one by one on the host (a matrix type that ggml dequantises to f32).
enum class tensor_role { matrix, norm, index, taps, rows };  // index: i64 ids (a draft's d2t)

// Throws std::invalid_argument "<path>: tensor '<name>': type <t>, expected <allowed types>".
void check_tensor_type(const std::string & path, const std::string & name, int type, tensor_role role);

} // namespace dflash
