#include "gguf_info.h"

#include "ggml.h"
#include "ggml-cpu.h"
#include "gguf.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>
#include <stdexcept>

namespace dflash {

namespace {

[[noreturn]] void fail(const std::string & path, const std::string & reason) {
    throw std::invalid_argument(path + ": " + reason);
}

// Length of the valid UTF-8 sequence at s[i], 0 if there is none.
size_t utf8_seq_len(const std::string & s, size_t i) {
    const auto c = (unsigned char) s[i];
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size()) {
        return 0;
    }
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (size_t k = 1; k < n; ++k) {
        const auto b = (unsigned char) s[i + k];
        if ((b >> 6) != 0x2) {
            return 0;
        }
        cp = (cp << 6) | (b & 0x3F);
    }
    static const uint32_t min_cp[] = { 0, 0, 0x80, 0x800, 0x10000 };
    const bool ok = cp >= min_cp[n] && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF);
    return ok ? n : 0;
}

// String values are only displayed: invalid UTF-8 becomes U+FFFD rather than an error.
std::string utf8_or_replaced(const char * s) {
    const std::string str(s);
    return is_valid_utf8(str) ? str : display_string(str, std::string::npos);
}

template <typename T, typename Out>
std::vector<Out> read_array(const gguf_context * ctx, int64_t id) {
    const size_t n = gguf_get_arr_n(ctx, id);
    const T * data = static_cast<const T *>(gguf_get_arr_data(ctx, id));
    return std::vector<Out>(data, data + n);
}

gguf_value read_array_value(const gguf_context * ctx, int64_t id) {
    switch (gguf_get_arr_type(ctx, id)) {
        case GGUF_TYPE_UINT8:   return read_array<uint8_t,  uint64_t>(ctx, id);
        case GGUF_TYPE_UINT16:  return read_array<uint16_t, uint64_t>(ctx, id);
        case GGUF_TYPE_UINT32:  return read_array<uint32_t, uint64_t>(ctx, id);
        case GGUF_TYPE_UINT64:  return read_array<uint64_t, uint64_t>(ctx, id);
        case GGUF_TYPE_INT8:    return read_array<int8_t,   int64_t>(ctx, id);
        case GGUF_TYPE_INT16:   return read_array<int16_t,  int64_t>(ctx, id);
        case GGUF_TYPE_INT32:   return read_array<int32_t,  int64_t>(ctx, id);
        case GGUF_TYPE_INT64:   return read_array<int64_t,  int64_t>(ctx, id);
        case GGUF_TYPE_FLOAT32: return read_array<float,    double>(ctx, id);
        case GGUF_TYPE_FLOAT64: return read_array<double,   double>(ctx, id);
        case GGUF_TYPE_BOOL: {
            const size_t n = gguf_get_arr_n(ctx, id);
            const auto * data = static_cast<const int8_t *>(gguf_get_arr_data(ctx, id));
            std::vector<bool> out(n);
            for (size_t i = 0; i < n; ++i) out[i] = data[i] != 0;
            return out;
        }
        case GGUF_TYPE_STRING: {
            const size_t n = gguf_get_arr_n(ctx, id);
            std::vector<std::string> out;
            out.reserve(n);
            for (size_t i = 0; i < n; ++i) out.emplace_back(utf8_or_replaced(gguf_get_arr_str(ctx, id, i)));
            return out;
        }
        default:
            return std::vector<std::string>{};  // nested arrays: not used by llama.cpp models
    }
}

gguf_value read_value(const gguf_context * ctx, int64_t id) {
    switch (gguf_get_kv_type(ctx, id)) {
        case GGUF_TYPE_UINT8:   return (uint64_t) gguf_get_val_u8 (ctx, id);
        case GGUF_TYPE_UINT16:  return (uint64_t) gguf_get_val_u16(ctx, id);
        case GGUF_TYPE_UINT32:  return (uint64_t) gguf_get_val_u32(ctx, id);
        case GGUF_TYPE_UINT64:  return (uint64_t) gguf_get_val_u64(ctx, id);
        case GGUF_TYPE_INT8:    return (int64_t)  gguf_get_val_i8 (ctx, id);
        case GGUF_TYPE_INT16:   return (int64_t)  gguf_get_val_i16(ctx, id);
        case GGUF_TYPE_INT32:   return (int64_t)  gguf_get_val_i32(ctx, id);
        case GGUF_TYPE_INT64:   return (int64_t)  gguf_get_val_i64(ctx, id);
        case GGUF_TYPE_FLOAT32: return (double)   gguf_get_val_f32(ctx, id);
        case GGUF_TYPE_FLOAT64: return (double)   gguf_get_val_f64(ctx, id);
        case GGUF_TYPE_BOOL:    return (bool)     gguf_get_val_bool(ctx, id);
        case GGUF_TYPE_STRING:  return utf8_or_replaced(gguf_get_val_str(ctx, id));
        case GGUF_TYPE_ARRAY:   return read_array_value(ctx, id);
        default:                return std::string{};
    }
}

// gguf's first error line, without its function-name prefix and newline.
void keep_first_error(ggml_log_level level, const char * text, void * user_data) {
    auto & why = *static_cast<std::string *>(user_data);
    if (level != GGML_LOG_LEVEL_ERROR || !why.empty() || text == nullptr) {
        return;
    }
    std::string line = text;
    const size_t colon = line.find(": ");
    if (colon != std::string::npos && line.compare(0, 4, "gguf") == 0) {
        line.erase(0, colon + 2);
    }
    while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) {
        line.pop_back();
    }
    why = display_string(line, 200);
}

} // namespace

gguf_context * open_gguf(const std::string & path, ggml_context ** meta, std::string & why) {
    why.clear();
    ggml_log_callback prev_cb = nullptr;
    void * prev_ud = nullptr;
    ggml_log_get(&prev_cb, &prev_ud);
    ggml_log_set(keep_first_error, &why);
    gguf_init_params params = { /*no_alloc =*/ true, /*ctx =*/ meta };
    gguf_context * ctx = gguf_init_from_file(path.c_str(), params);
    ggml_log_set(prev_cb, prev_ud);
    return ctx;
}

void check_tensors_in_file(const gguf_context * ctx, const std::string & path) {
    std::error_code ec;
    const uint64_t file_size = std::filesystem::file_size(path, ec);
    if (ec) {
        fail(path, "cannot read file size: " + ec.message());
    }
    const uint64_t data_offset = gguf_get_data_offset(ctx);
    for (int64_t i = 0; i < gguf_get_n_tensors(ctx); ++i) {
        const uint64_t offset = data_offset + gguf_get_tensor_offset(ctx, i);  // gguf checked these add up
        const uint64_t nbytes = gguf_get_tensor_size(ctx, i);
        if (offset > file_size || nbytes > file_size - offset) {
            fail(path, "truncated: tensor '" + display_string(gguf_get_tensor_name(ctx, i)) + "' ends at byte " +
                       std::to_string(offset + nbytes) + " but the file has " + std::to_string(file_size));
        }
    }
}

gguf_file_info read_gguf_info(const std::string & path) {
    namespace fs = std::filesystem;
    std::error_code ec;
    if (!fs::exists(path, ec)) {
        fail(path, "no such file");
    }
    if (fs::is_directory(path, ec)) {
        fail(path, "is a directory, not a GGUF file");
    }
    const uint64_t file_size = fs::file_size(path, ec);
    if (ec) {
        fail(path, "cannot read file size: " + ec.message());
    }

    char magic[4] = {0, 0, 0, 0};
    {
        std::unique_ptr<FILE, int (*)(FILE *)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
        if (!f) {
            fail(path, std::string("cannot open: ") + std::strerror(errno));
        }
        if (std::fread(magic, 1, 4, f.get()) != 4 || std::memcmp(magic, "GGUF", 4) != 0) {
            fail(path, "not a GGUF file (bad magic; expected the 4 bytes 'GGUF')");
        }
    }

    std::string why;
    gguf_context * raw = open_gguf(path, nullptr, why);
    if (raw == nullptr) {
        fail(path, "corrupt or truncated GGUF header (gguf could not parse the key-values or tensor table)" +
                   (why.empty() ? "" : ": " + why));
    }
    std::unique_ptr<gguf_context, void (*)(gguf_context *)> ctx(raw, &gguf_free);

    gguf_file_info info;
    info.path        = path;
    info.version     = gguf_get_version(ctx.get());
    info.alignment   = gguf_get_alignment(ctx.get());
    info.data_offset = gguf_get_data_offset(ctx.get());

    const int64_t n_kv = gguf_get_n_kv(ctx.get());
    for (int64_t i = 0; i < n_kv; ++i) {
        const std::string key = gguf_get_key(ctx.get(), i);
        if (!is_valid_utf8(key)) {
            fail(path, "key '" + display_string(key) + "': the name is not valid UTF-8 (a corrupt header)");
        }
        info.metadata.push_back({ key, read_value(ctx.get(), i) });
    }
    const int64_t arch_id = gguf_find_key(ctx.get(), "general.architecture");
    if (arch_id >= 0 && gguf_get_kv_type(ctx.get(), arch_id) == GGUF_TYPE_STRING) {
        info.architecture = utf8_or_replaced(gguf_get_val_str(ctx.get(), arch_id));
    }

    uint64_t data_end = info.data_offset;
    const int64_t n_tensors = gguf_get_n_tensors(ctx.get());
    for (int64_t i = 0; i < n_tensors; ++i) {
        gguf_tensor_entry t;
        t.name   = gguf_get_tensor_name(ctx.get(), i);
        if (!is_valid_utf8(t.name)) {
            fail(path, "tensor '" + display_string(t.name) + "': the name is not valid UTF-8 (a corrupt header)");
        }
        t.type   = ggml_type_name(gguf_get_tensor_type(ctx.get(), i));
        t.offset = gguf_get_tensor_offset(ctx.get(), i);
        t.nbytes = gguf_get_tensor_size(ctx.get(), i);
        const int64_t * ne = gguf_get_tensor_ne(ctx.get(), i);
        int n_dims = GGML_MAX_DIMS;
        while (n_dims > 1 && ne[n_dims - 1] == 1) {
            --n_dims;
        }
        t.shape.assign(ne, ne + n_dims);
        data_end = std::max<uint64_t>(data_end, info.data_offset + t.offset + t.nbytes);
        info.tensors.push_back(std::move(t));
    }
    if (data_end > file_size) {
        fail(path, "truncated: tensor data needs " + std::to_string(data_end) +
                   " bytes but the file has " + std::to_string(file_size));
    }
    return info;
}

bool is_valid_utf8(const std::string & s) {
    for (size_t i = 0; i < s.size();) {
        const size_t n = utf8_seq_len(s, i);
        if (n == 0) {
            return false;
        }
        i += n;
    }
    return true;
}

std::string display_string(const std::string & s, size_t max_bytes) {
    std::string out;
    for (size_t i = 0; i < s.size();) {
        if (out.size() >= max_bytes) {
            return out + "...";
        }
        const size_t n = utf8_seq_len(s, i);
        out += n == 0 ? std::string("\xEF\xBF\xBD") : s.substr(i, n);
        i += n == 0 ? 1 : n;
    }
    return out;
}

// --- gguf_keys ---------------------------------------------------------------------------------

namespace {

bool is_integer_type(gguf_type t) {
    switch (t) {
        case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16:
        case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64:
            return true;
        default:
            return false;
    }
}

std::string range(int64_t lo, int64_t hi) {
    return "an integer in " + std::to_string(lo) + ".." + std::to_string(hi);
}

std::string number_text(double v) {
    std::ostringstream os;
    os.precision(9);
    os << v;
    return os.str();
}

// The value of integer key `id` widened: false when it does not fit an int64 (a uint64 above 2^63).
bool widened(const gguf_context * ctx, int64_t id, int64_t & out) {
    switch (gguf_get_kv_type(ctx, id)) {
        case GGUF_TYPE_UINT8:  out = gguf_get_val_u8 (ctx, id); return true;
        case GGUF_TYPE_INT8:   out = gguf_get_val_i8 (ctx, id); return true;
        case GGUF_TYPE_UINT16: out = gguf_get_val_u16(ctx, id); return true;
        case GGUF_TYPE_INT16:  out = gguf_get_val_i16(ctx, id); return true;
        case GGUF_TYPE_UINT32: out = gguf_get_val_u32(ctx, id); return true;
        case GGUF_TYPE_INT32:  out = gguf_get_val_i32(ctx, id); return true;
        case GGUF_TYPE_INT64:  out = gguf_get_val_i64(ctx, id); return true;
        case GGUF_TYPE_UINT64: {
            const uint64_t v = gguf_get_val_u64(ctx, id);
            out = (int64_t) v;
            return v <= (uint64_t) INT64_MAX;
        }
        default: return false;
    }
}

template <typename T>
int64_t element(const void * data, size_t i) { return (int64_t) static_cast<const T *>(data)[i]; }

} // namespace

int64_t gguf_keys::find(const std::string & key) const { return gguf_find_key(ctx_, key.c_str()); }

void gguf_keys::fail(const std::string & what, const std::string & value, const std::string & expected) const {
    throw std::invalid_argument(path_ + ": " + display_string(what) + ": " + value + ", expected " + expected);
}

void gguf_keys::missing(const std::string & key, const std::string & hint) const {
    throw std::invalid_argument(path_ + ": missing key '" + key + "'" + (hint.empty() ? "" : " (" + hint + ")"));
}

int64_t gguf_keys::require(const std::string & key) const {
    const int64_t id = find(key);
    if (id < 0) {
        missing(key, "");
    }
    return id;
}

void gguf_keys::wrong_type(const std::string & key, int64_t id, const std::string & expected) const {
    fail(key, describe(id), expected);
}

std::string gguf_keys::describe(int64_t id) const {
    const gguf_type t = gguf_get_kv_type(ctx_, id);
    const std::string tname = gguf_type_name(t);
    int64_t v = 0;
    if (t == GGUF_TYPE_UINT64 && !widened(ctx_, id, v)) {
        return tname + " " + std::to_string(gguf_get_val_u64(ctx_, id));
    }
    if (is_integer_type(t) && widened(ctx_, id, v)) {
        return tname + " " + std::to_string(v);
    }
    switch (t) {
        case GGUF_TYPE_FLOAT32: return tname + " " + number_text(gguf_get_val_f32(ctx_, id));
        case GGUF_TYPE_FLOAT64: return tname + " " + number_text(gguf_get_val_f64(ctx_, id));
        case GGUF_TYPE_BOOL:    return tname + (gguf_get_val_bool(ctx_, id) ? " true" : " false");
        case GGUF_TYPE_STRING:  return tname + " '" + display_string(gguf_get_val_str(ctx_, id)) + "'";
        case GGUF_TYPE_ARRAY:
            return "array of " + std::to_string(gguf_get_arr_n(ctx_, id)) + " " + gguf_type_name(gguf_get_arr_type(ctx_, id));
        default: return tname;
    }
}

int64_t gguf_keys::integer(const std::string & key, int64_t lo, int64_t hi) const {
    const int64_t id = require(key);
    int64_t v = 0;
    if (!is_integer_type(gguf_get_kv_type(ctx_, id))) {
        wrong_type(key, id, range(lo, hi));
    }
    if (!widened(ctx_, id, v) || v < lo || v > hi) {
        fail(key, describe(id), range(lo, hi));
    }
    return v;
}

int64_t gguf_keys::integer_or(const std::string & key, int64_t fallback, int64_t lo, int64_t hi) const {
    return has(key) ? integer(key, lo, hi) : fallback;
}

double gguf_keys::number(const std::string & key, double lo, double hi) const {
    const int64_t id = require(key);
    const gguf_type t = gguf_get_kv_type(ctx_, id);
    const std::string expected = "a finite number in " + number_text(lo) + ".." + number_text(hi);
    double v = 0.0;
    int64_t i = 0;
    if (t == GGUF_TYPE_FLOAT32) {
        v = gguf_get_val_f32(ctx_, id);
    } else if (t == GGUF_TYPE_FLOAT64) {
        v = gguf_get_val_f64(ctx_, id);
    } else if (is_integer_type(t) && widened(ctx_, id, i)) {
        v = (double) i;
    } else {
        wrong_type(key, id, expected);
    }
    if (!std::isfinite(v) || v < lo || v > hi) {
        fail(key, describe(id), expected);
    }
    return v;
}

double gguf_keys::number_or(const std::string & key, double fallback, double lo, double hi) const {
    return has(key) ? number(key, lo, hi) : fallback;
}

bool gguf_keys::boolean_or(const std::string & key, bool fallback) const {
    const int64_t id = find(key);
    if (id < 0) {
        return fallback;
    }
    if (gguf_get_kv_type(ctx_, id) != GGUF_TYPE_BOOL) {
        wrong_type(key, id, "a bool");
    }
    return gguf_get_val_bool(ctx_, id);
}

std::string gguf_keys::string_or(const std::string & key, const std::string & fallback) const {
    const int64_t id = find(key);
    if (id < 0) {
        return fallback;
    }
    if (gguf_get_kv_type(ctx_, id) != GGUF_TYPE_STRING) {
        wrong_type(key, id, "a string");
    }
    return gguf_get_val_str(ctx_, id);
}

std::vector<int64_t> gguf_keys::integers(const std::string & key, size_t max_n, int64_t lo, int64_t hi) const {
    const int64_t id = require(key);
    const std::string expected = "an array of at most " + std::to_string(max_n) + " integers in " +
                                 std::to_string(lo) + ".." + std::to_string(hi);
    if (gguf_get_kv_type(ctx_, id) != GGUF_TYPE_ARRAY) {
        wrong_type(key, id, expected);
    }
    const gguf_type t = gguf_get_arr_type(ctx_, id);
    const size_t n = gguf_get_arr_n(ctx_, id);
    if ((!is_integer_type(t) && t != GGUF_TYPE_BOOL) || n > max_n) {
        wrong_type(key, id, expected);
    }
    const void * data = gguf_get_arr_data(ctx_, id);  // only now: it asserts on an array of strings
    std::vector<int64_t> out(n);
    for (size_t i = 0; i < n; ++i) {
        switch (t) {
            case GGUF_TYPE_UINT8:  out[i] = element<uint8_t >(data, i); break;
            case GGUF_TYPE_INT8:   out[i] = element<int8_t  >(data, i); break;
            case GGUF_TYPE_BOOL:   out[i] = element<int8_t  >(data, i) != 0; break;
            case GGUF_TYPE_UINT16: out[i] = element<uint16_t>(data, i); break;
            case GGUF_TYPE_INT16:  out[i] = element<int16_t >(data, i); break;
            case GGUF_TYPE_UINT32: out[i] = element<uint32_t>(data, i); break;
            case GGUF_TYPE_INT32:  out[i] = element<int32_t >(data, i); break;
            case GGUF_TYPE_INT64:  out[i] = element<int64_t >(data, i); break;
            default: {  // UINT64
                const uint64_t u = static_cast<const uint64_t *>(data)[i];
                out[i] = u > (uint64_t) INT64_MAX ? INT64_MIN : (int64_t) u;
            }
        }
        if (out[i] < lo || out[i] > hi) {
            fail(key + "[" + std::to_string(i) + "]", t == GGUF_TYPE_UINT64 && out[i] == INT64_MIN
                     ? std::to_string(static_cast<const uint64_t *>(data)[i]) : std::to_string(out[i]), expected);
        }
    }
    return out;
}

size_t gguf_keys::n_strings(const std::string & key) const {
    const int64_t id = require(key);
    if (gguf_get_kv_type(ctx_, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(ctx_, id) != GGUF_TYPE_STRING) {
        wrong_type(key, id, "an array of strings");
    }
    return gguf_get_arr_n(ctx_, id);
}

void check_tensor_type(const std::string & path, const std::string & name, int type, tensor_role role) {
    const bool known = type >= 0 && type < GGML_TYPE_COUNT && ggml_type_size((ggml_type) type) > 0;
    const auto t = (ggml_type) type;
    bool ok = false;
    if (known && (role == tensor_role::norm || role == tensor_role::taps)) {
        ok = t == GGML_TYPE_F32;
    } else if (known && role == tensor_role::index) {
        ok = t == GGML_TYPE_I64;
    } else if (known) {  // Q8_1 and Q8_K are activation formats: no dot product of their own
        ok = ggml_get_type_traits_cpu(t)->vec_dot != nullptr &&
             (role != tensor_role::rows || t == GGML_TYPE_F32 || ggml_get_type_traits(t)->to_float != nullptr);
    }
    if (!ok) {
        const std::string tname = known ? ggml_type_name(t) : "#" + std::to_string(type);
        fail(path, "tensor '" + display_string(name) + "': type " + tname + ", expected " +
                   (role == tensor_role::norm    ? std::string("f32 (a norm or 1-D weight)")
                    : role == tensor_role::taps  ? std::string("f32 (convolution taps)")
                    : role == tensor_role::index ? std::string("i64 (token ids)")
                                                 : std::string("a float or quantised matrix type (f32, f16, bf16, q8_0, "
                                                            "q4_0, q4_1, q5_0, q5_1, q2_K..q6_K, iq*)")));
    }
}

} // namespace dflash
