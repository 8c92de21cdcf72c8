#include "gguf_info.h"

#include "ggml.h"
#include "gguf.h"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <stdexcept>

namespace dflash {

namespace {

[[noreturn]] void fail(const std::string & path, const std::string & reason) {
    throw std::invalid_argument(path + ": " + reason);
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
            for (size_t i = 0; i < n; ++i) out.emplace_back(gguf_get_arr_str(ctx, id, i));
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
        case GGUF_TYPE_STRING:  return std::string(gguf_get_val_str(ctx, id));
        case GGUF_TYPE_ARRAY:   return read_array_value(ctx, id);
        default:                return std::string{};
    }
}

// Silences ggml's logger while gguf parses a file we already reported on by exception.
struct quiet_ggml_log {
    ggml_log_callback prev_cb = nullptr;
    void *            prev_ud = nullptr;
    quiet_ggml_log()  {
        ggml_log_get(&prev_cb, &prev_ud);
        ggml_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    }
    ~quiet_ggml_log() { ggml_log_set(prev_cb, prev_ud); }
};

} // namespace

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

    gguf_context * raw = nullptr;
    {
        quiet_ggml_log quiet;
        gguf_init_params params = { /*no_alloc =*/ true, /*ctx =*/ nullptr };
        raw = gguf_init_from_file(path.c_str(), params);
    }
    if (raw == nullptr) {
        fail(path, "corrupt or truncated GGUF header (gguf could not parse the key-values or tensor table)");
    }
    std::unique_ptr<gguf_context, void (*)(gguf_context *)> ctx(raw, &gguf_free);

    gguf_file_info info;
    info.path        = path;
    info.version     = gguf_get_version(ctx.get());
    info.alignment   = gguf_get_alignment(ctx.get());
    info.data_offset = gguf_get_data_offset(ctx.get());

    const int64_t n_kv = gguf_get_n_kv(ctx.get());
    for (int64_t i = 0; i < n_kv; ++i) {
        info.metadata.push_back({ gguf_get_key(ctx.get(), i), read_value(ctx.get(), i) });
    }
    const int64_t arch_id = gguf_find_key(ctx.get(), "general.architecture");
    if (arch_id >= 0 && gguf_get_kv_type(ctx.get(), arch_id) == GGUF_TYPE_STRING) {
        info.architecture = gguf_get_val_str(ctx.get(), arch_id);
    }

    uint64_t data_end = info.data_offset;
    const int64_t n_tensors = gguf_get_n_tensors(ctx.get());
    for (int64_t i = 0; i < n_tensors; ++i) {
        gguf_tensor_entry t;
        t.name   = gguf_get_tensor_name(ctx.get(), i);
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

} // namespace dflash
