#include "draft_graph.h"

#include "ggml-cpu.h"
#include "huge_pages.h"
#include "llama-model.h"  // the target's tok_embd / output tensors, used in place

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace dflash {

namespace {
constexpr int kMaxGraphNodes = 4096;
}

// One graph's metadata context, its inputs (set after allocation) and its named intermediates.
struct draft_runner::graph_ctx {
    ggml_context * ctx = nullptr;
    ggml_cgraph *  gf  = nullptr;
    struct input { ggml_tensor * t; const void * data; size_t nbytes; };
    std::vector<input>         inputs;
    std::vector<ggml_tensor *> named;   // read back when tracing
    std::vector<std::vector<float>> owned;  // host data of inputs built here (masks)
    bool tracing = false;

    ~graph_ctx() { if (ctx) ggml_free(ctx); }

    ggml_tensor * add_input(ggml_tensor * t, const void * data) {
        ggml_set_input(t);
        inputs.push_back({ t, data, ggml_nbytes(t) });
        return t;
    }

    // names an intermediate "name" or "name-il"; when tracing, keeps it alive to be read back
    ggml_tensor * name(ggml_tensor * t, const char * base, int il = -1) {
        if (il >= 0) {
            ggml_format_name(t, "%s-%d", base, il);
        } else {
            ggml_set_name(t, base);
        }
        if (tracing) {  // views are copied out so the allocator keeps what we read
            ggml_tensor * keep = t->view_src ? ggml_cont(ctx, t) : t;
            ggml_set_name(keep, ggml_get_name(t));
            ggml_set_output(keep);
            named.push_back(keep);
        }
        return t;
    }
};

// The device holding the target's output head (its embeddings where the head is tied): a GPU when
// the target is offloaded whole (-ngl past its last layer), else the CPU (nullptr).
ggml_backend_dev_t draft_device(const llama_model * target) {
    const ggml_tensor * head = target->output ? target->output : target->tok_embd;
    if (head == nullptr || head->buffer == nullptr || ggml_backend_buffer_is_host(head->buffer)) {
        return nullptr;
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(head->buffer));
    if (dev == nullptr) {
        return nullptr;
    }
    const enum ggml_backend_dev_type type = ggml_backend_dev_type(dev);
    return type == GGML_BACKEND_DEVICE_TYPE_GPU || type == GGML_BACKEND_DEVICE_TYPE_IGPU ? dev : nullptr;
}

draft_runner::draft_runner(const draft_model & draft, const llama_model * target, int32_t n_ctx, int32_t n_threads,
                           bool compact_head, ggml_backend_dev_t device)
    : draft_(draft), n_ctx_(n_ctx) {
    tok_embd_ = target->tok_embd;
    output_   = draft.reduced_vocab() ? draft.output : target->output ? target->output : target->tok_embd;
    if (tok_embd_ == nullptr || output_ == nullptr) {
        throw std::invalid_argument("the target model has no token embedding or output head tensor to lend the draft");
    }
    n_vocab_     = (int32_t) tok_embd_->ne[1];
    n_head_rows_ = (int32_t) output_->ne[1];
    head_        = output_;

    backend_cpu_ = ggml_backend_cpu_init();
    if (backend_cpu_ == nullptr) {
        throw std::runtime_error("cannot initialise the ggml CPU backend");
    }
    ggml_backend_cpu_set_n_threads(backend_cpu_, n_threads);
    backend_ = backend_cpu_;
    if (device != nullptr) {  // a GPU: ops on host tensors (the target's embeddings) stay on the CPU
        backend_ = ggml_backend_dev_init(device, nullptr);
        if (backend_ == nullptr) {
            throw std::runtime_error(std::string("cannot initialise the draft's device ") + ggml_backend_dev_name(device));
        }
    }
    std::vector<ggml_backend_t> backends;  // the CPU last, as ggml's scheduler requires
    if (backend_ != backend_cpu_) backends.push_back(backend_);
    backends.push_back(backend_cpu_);
    sched_ = ggml_backend_sched_new(backends.data(), nullptr, (int) backends.size(), kMaxGraphNodes, false, false);

    // the draft KV cache: projected context only, f32 so parity with the reference stays tight
    const draft_hparams & hp = draft_.hparams;
    ggml_init_params kv_params = { ggml_tensor_overhead() * (size_t) (2 * hp.n_layer + 1), nullptr, true };
    kv_ctx_ = ggml_init(kv_params);
    for (int32_t il = 0; il < hp.n_layer; ++il) {
        cache_k_.push_back(ggml_new_tensor_3d(kv_ctx_, GGML_TYPE_F32, hp.head_dim, hp.n_head_kv, n_ctx));
        cache_v_.push_back(ggml_new_tensor_3d(kv_ctx_, GGML_TYPE_F32, n_ctx, hp.head_dim, hp.n_head_kv));
        ggml_format_name(cache_k_.back(), "draft_cache_k-%d", il);
        ggml_format_name(cache_v_.back(), "draft_cache_v-%d", il);
    }
    kv_buf_ = ggml_backend_alloc_ctx_tensors(kv_ctx_, backend_);
    if (kv_buf_ == nullptr) {
        throw std::runtime_error("cannot allocate the draft KV cache");
    }
    ggml_backend_buffer_clear(kv_buf_, 0);

    graph_meta_.resize(ggml_tensor_overhead() * kMaxGraphNodes + ggml_graph_overhead_custom(kMaxGraphNodes, false));
    if (backend_ == backend_cpu_) {
        copy_to_host();
        if (compact_head) {
            make_compact_head();
        }
    }
}

// A draft graph on the CPU backend cannot read a target's tensors in device memory (a target
// offloaded in part keeps its output head there, some backends its embeddings too): such tensors
// are copied to a host buffer once, at load.
void draft_runner::copy_to_host() {
    auto on_device = [](const ggml_tensor * t) { return t->buffer != nullptr && !ggml_backend_buffer_is_host(t->buffer); };
    std::vector<ggml_tensor **> moved;
    for (ggml_tensor ** t : { &tok_embd_, &output_ }) {
        if (on_device(*t) && (moved.empty() || *moved.front() != *t)) {
            moved.push_back(t);
        }
    }
    if (moved.empty()) {
        return;
    }
    host_ctx_ = ggml_init({ ggml_tensor_overhead() * moved.size(), nullptr, true });
    std::vector<std::pair<ggml_tensor *, ggml_tensor *>> copies;
    for (ggml_tensor ** t : moved) {
        copies.emplace_back(*t, ggml_dup_tensor(host_ctx_, *t));
        ggml_set_name(copies.back().second, ggml_get_name(*t));
    }
    host_buf_ = ggml_backend_alloc_ctx_tensors(host_ctx_, backend_cpu_);
    if (host_buf_ == nullptr) {
        throw std::runtime_error("cannot allocate host copies of the target's embeddings / output head for the draft");
    }
    for (auto & [src, dst] : copies) {
        ggml_backend_tensor_get(src, dst->data, 0, ggml_nbytes(src));
    }
    const bool tied = output_ == tok_embd_;
    for (size_t i = 0; i < moved.size(); ++i) {
        *moved[i] = copies[i].second;
    }
    if (tied) {
        output_ = tok_embd_;
    }
    head_ = output_;
}

// head_ = output_ requantized to Q4_0, row chunk by row chunk, when that reads less and is possible.
void draft_runner::make_compact_head() {
    const ggml_type to = GGML_TYPE_Q4_0;
    const int64_t n_embd = output_->ne[0], n_rows = output_->ne[1];
    const auto * traits = ggml_get_type_traits(output_->type);
    const bool smaller = (double) ggml_type_size(to) / ggml_blck_size(to) <
                         (double) ggml_type_size(output_->type) / ggml_blck_size(output_->type);
    const bool readable = output_->type == GGML_TYPE_F32 || traits->to_float != nullptr;
    if (!smaller || n_embd % ggml_blck_size(to) != 0 || !readable || output_->buffer == nullptr ||
        !ggml_backend_buffer_is_host(output_->buffer) || !ggml_is_contiguous(output_)) {
        return;  // already small, or not readable here: generation uses the target's head
    }
    head_ctx_ = ggml_init({ ggml_tensor_overhead(), nullptr, true });
    ggml_tensor * head = ggml_new_tensor_2d(head_ctx_, to, n_embd, n_rows);
    ggml_set_name(head, "draft_head_q4_0");
    head_buf_ = ggml_backend_alloc_ctx_tensors(head_ctx_, backend_cpu_);
    if (head_buf_ == nullptr) {
        throw std::runtime_error("cannot allocate the draft's compact head");
    }
    constexpr int64_t kChunk = 256;
    std::vector<float> rows((size_t) kChunk * n_embd);
    for (int64_t r0 = 0; r0 < n_rows; r0 += kChunk) {
        const int64_t nr = std::min(kChunk, n_rows - r0);
        for (int64_t r = 0; r < nr; ++r) {
            const char * src = (const char *) output_->data + (r0 + r) * output_->nb[1];
            if (output_->type == GGML_TYPE_F32) {
                std::memcpy(rows.data() + r * n_embd, src, (size_t) n_embd * sizeof(float));
            } else {
                traits->to_float(src, rows.data() + r * n_embd, n_embd);
            }
        }
        ggml_quantize_chunk(to, rows.data(), (char *) head->data + r0 * head->nb[1], 0, nr, n_embd, nullptr);
    }
    collapse_to_huge_pages(head_buf_);  // read every draft step, as the target's weights are
    head_ = head;
}

void draft_runner::set_threads(int32_t n_threads) {
    ggml_backend_cpu_set_n_threads(backend_cpu_, n_threads);
}

draft_runner::~draft_runner() {
    if (sched_)       ggml_backend_sched_free(sched_);
    if (kv_buf_)      ggml_backend_buffer_free(kv_buf_);
    if (kv_ctx_)      ggml_free(kv_ctx_);
    if (head_buf_)    ggml_backend_buffer_free(head_buf_);
    if (head_ctx_)    ggml_free(head_ctx_);
    if (host_buf_)    ggml_backend_buffer_free(host_buf_);
    if (host_ctx_)    ggml_free(host_ctx_);
    if (backend_ && backend_ != backend_cpu_) ggml_backend_free(backend_);
    if (backend_cpu_) ggml_backend_free(backend_cpu_);
}

ggml_tensor * draft_runner::rms_norm(ggml_context * ctx, ggml_tensor * x, ggml_tensor * gain) const {
    return ggml_mul(ctx, ggml_rms_norm(ctx, x, draft_.hparams.rms_eps), gain);
}

ggml_tensor * draft_runner::rope(ggml_context * ctx, ggml_tensor * x, ggml_tensor * pos) const {
    const draft_hparams & hp = draft_.hparams;
    return ggml_rope_ext(ctx, x, pos, nullptr, hp.head_dim, GGML_ROPE_TYPE_NEOX, 0,
                         hp.rope_freq_base, hp.rope_freq_scale, 0.0f, 1.0f, 0.0f, 0.0f);
}

// Visibility as in the published model: block query i sits at position n_kv - n_block + i; key j
// at position j. Causal: j <= i. Window w: i - j < w, and j - i < w when not causal.
ggml_tensor * draft_runner::attention_mask(graph_ctx & g, int32_t n_kv, int32_t n_block, bool causal, int32_t window) {
    std::vector<float> mask((size_t) n_kv * n_block, 0.0f);
    for (int32_t i = 0; i < n_block; ++i) {
        const int32_t qpos = n_kv - n_block + i;
        for (int32_t j = 0; j < n_kv; ++j) {
            bool visible = true;
            if (causal) {
                visible = visible && j <= qpos;
            }
            if (window > 0) {
                visible = visible && qpos - j < window;
                if (!causal) {
                    visible = visible && j - qpos < window;
                }
            }
            mask[(size_t) i * n_kv + j] = visible ? 0.0f : -INFINITY;
        }
    }
    g.owned.push_back(std::move(mask));
    ggml_tensor * t = ggml_new_tensor_2d(g.ctx, GGML_TYPE_F32, n_kv, n_block);
    return g.add_input(t, g.owned.back().data());
}

// One side of a grouped dynamic causal convolution over the block (y: [n_embd, B], position 0 the
// anchor), as the published model and llama.cpp's graph compute it:
//   out[i, c] = sum_t (base[side, t, c] + dynamic[i, side, t, c / group]) * y[i - t, c]
// with y = 0 before the block start: the coefficient comes from the output position i, the static
// and dynamic taps are summed first, the taps added in order; taps at or past B read only padding.
// dynamic: [2 * K * groups, B] (side, tap, group; the group fastest); base: [n_embd, K, 2].
ggml_tensor * draft_runner::conv(ggml_context * ctx, ggml_tensor * y, ggml_tensor * dynamic, ggml_tensor * base,
                                 int side) const {
    const draft_hparams & hp = draft_.hparams;
    const int64_t n_embd = hp.n_embd, group = hp.conv_group_size, groups = hp.conv_groups();
    const int64_t k = hp.conv_kernel_size, n = y->ne[1];
    // the side's dynamic taps [groups, K, B], one per channel of its group: [group, groups, K, B]
    ggml_tensor * dyn = ggml_view_3d(ctx, dynamic, groups, k, n, groups * sizeof(float), dynamic->nb[1],
                                     side * k * groups * sizeof(float));
    dyn = ggml_repeat_4d(ctx, ggml_reshape_4d(ctx, ggml_cont(ctx, dyn), 1, groups, k, n), group, groups, k, n);
    // plus the side's static taps [group, groups, K, 1]
    ggml_tensor * taps = ggml_reshape_4d(ctx, ggml_view_2d(ctx, base, n_embd, k, base->nb[1], side * base->nb[2]),
                                         group, groups, k, 1);
    ggml_tensor * weights = ggml_add(ctx, dyn, taps);  // [group, groups, K, B]

    ggml_tensor * out = nullptr;
    for (int64_t t = 0; t < std::min(k, n); ++t) {
        ggml_tensor * w = ggml_cont_2d(ctx, ggml_view_2d(ctx, weights, n_embd, n, weights->nb[3], t * weights->nb[2]),
                                       n_embd, n);
        ggml_tensor * shifted = t == 0 ? y : ggml_pad_ext(ctx, ggml_view_2d(ctx, y, n_embd, n - t, y->nb[1], 0),
                                                          0, 0, (int) t, 0, 0, 0, 0, 0);
        ggml_tensor * term = ggml_mul(ctx, w, shifted);
        out = out ? ggml_add(ctx, out, term) : term;
    }
    return out;
}

void draft_runner::compute(graph_ctx & g, draft_trace * trace) {
    ggml_backend_sched_reset(sched_);
    if (!ggml_backend_sched_alloc_graph(sched_, g.gf)) {
        throw std::runtime_error("draft graph: allocation failed");
    }
    for (const auto & in : g.inputs) {
        ggml_backend_tensor_set(in.t, in.data, 0, in.nbytes);
    }
    if (ggml_backend_sched_graph_compute(sched_, g.gf) != GGML_STATUS_SUCCESS) {
        throw std::runtime_error("draft graph: compute failed");
    }
    if (trace != nullptr) {
        for (ggml_tensor * t : g.named) {
            traced_tensor & out = (*trace)[ggml_get_name(t)];
            out.shape.assign(t->ne, t->ne + ggml_n_dims(t));
            out.data.resize(ggml_nelements(t));
            if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t)) {
                throw std::runtime_error(std::string("draft graph: cannot trace non-contiguous or non-f32 tensor ") + ggml_get_name(t));
            }
            ggml_backend_tensor_get(t, out.data.data(), 0, ggml_nbytes(t));
        }
    }
}

// Writes n positions of K and V ([head_dim, n_head_kv, n] each) into the cache from position pos0,
// before whatever the graph adds next reads them (nodes run in the order they are added). V is
// cached transposed ([n_ctx, head_dim, n_head_kv]) so that attention reads it as a view.
void draft_runner::store_kv(graph_ctx & g, int32_t il, ggml_tensor * k, ggml_tensor * v, int32_t pos0, int32_t n) {
    const draft_hparams & hp = draft_.hparams;
    ggml_tensor * ck = cache_k_[il];
    ggml_tensor * cv = cache_v_[il];
    ggml_tensor * k_dst = ggml_view_3d(g.ctx, ck, hp.head_dim, hp.n_head_kv, n, ck->nb[1], ck->nb[2], (size_t) pos0 * ck->nb[2]);
    ggml_tensor * v_dst = ggml_view_3d(g.ctx, cv, n, hp.head_dim, hp.n_head_kv, cv->nb[1], cv->nb[2], (size_t) pos0 * cv->nb[0]);
    ggml_build_forward_expand(g.gf, ggml_cpy(g.ctx, k, k_dst));
    ggml_build_forward_expand(g.gf, ggml_cpy(g.ctx, ggml_permute(g.ctx, v, 1, 2, 0, 3), v_dst));
}

void draft_runner::inject(const float * features, int32_t n, int32_t pos0, draft_trace * trace) {
    const draft_hparams & hp = draft_.hparams;
    if (pos0 != n_cached_) {
        throw std::invalid_argument("draft inject at position " + std::to_string(pos0) + " but the cache holds " +
                                    std::to_string(n_cached_) + " positions");
    }
    if (n <= 0) {
        return;
    }
    if (pos0 + n > n_ctx_) {
        throw std::invalid_argument("draft cache full: " + std::to_string(pos0 + n) + " positions > n_ctx " + std::to_string(n_ctx_));
    }

    graph_ctx g;
    g.tracing = trace != nullptr;
    g.ctx = ggml_init({ graph_meta_.size(), graph_meta_.data(), true });
    g.gf  = ggml_new_graph_custom(g.ctx, kMaxGraphNodes, false);

    std::vector<int32_t> positions(n);
    for (int32_t i = 0; i < n; ++i) positions[i] = pos0 + i;

    ggml_tensor * feats = g.add_input(ggml_new_tensor_2d(g.ctx, GGML_TYPE_F32, (int64_t) hp.n_taps() * hp.n_embd, n), features);
    ggml_tensor * pos   = g.add_input(ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, n), positions.data());

    ggml_tensor * c = g.name(ggml_mul_mat(g.ctx, draft_.fc, feats), "fc_out");
    c = g.name(rms_norm(g.ctx, c, draft_.hidden_norm), "inp_g_embeddings");

    for (int32_t il = 0; il < hp.n_layer; ++il) {
        const draft_layer & l = draft_.layers[il];
        ggml_tensor * k = ggml_reshape_3d(g.ctx, ggml_mul_mat(g.ctx, l.wk, c), hp.head_dim, hp.n_head_kv, n);
        ggml_tensor * v = ggml_reshape_3d(g.ctx, ggml_mul_mat(g.ctx, l.wv, c), hp.head_dim, hp.n_head_kv, n);
        k = g.name(rope(g.ctx, rms_norm(g.ctx, k, l.attn_k_norm), pos), "Kcur_injected", il);
        v = g.name(v, "Vcur_injected", il);

        store_kv(g, il, k, v, pos0, n);
    }
    for (ggml_tensor * t : g.named) {
        ggml_build_forward_expand(g.gf, t);
    }
    compute(g, trace);
    n_cached_ = pos0 + n;
}

void draft_runner::forward_block(const int32_t * tokens, int32_t n_block, int32_t start, block_output & result,
                                 draft_trace * trace, int32_t n_logits) {
    const draft_hparams & hp = draft_.hparams;
    if (start != n_cached_) {
        throw std::invalid_argument("draft block at position " + std::to_string(start) + " but the cache holds " +
                                    std::to_string(n_cached_) + " positions");
    }
    const int32_t first = hp.first_draft_slot();  // block position of the first drafted slot
    if (n_block < first + 1) {
        throw std::invalid_argument("draft block must hold at least " + std::to_string(first + 1) + " tokens, got " +
                                    std::to_string(n_block));
    }
    if (n_logits < 0) {
        n_logits = n_block - first;
    }
    if (n_logits < 1 || n_logits > n_block - first) {
        throw std::invalid_argument("draft logits for " + std::to_string(n_logits) + " positions of a block of " +
                                    std::to_string(n_block) + " (1 to " + std::to_string(n_block - first) + ")");
    }
    if (start + n_block > n_ctx_) {
        throw std::invalid_argument("draft block ends at position " + std::to_string(start + n_block) +
                                    ", past n_ctx " + std::to_string(n_ctx_));
    }
    const int32_t n_kv = start + n_block;

    graph_ctx g;
    g.tracing = trace != nullptr;
    g.ctx = ggml_init({ graph_meta_.size(), graph_meta_.data(), true });
    g.gf  = ggml_new_graph_custom(g.ctx, kMaxGraphNodes, false);

    std::vector<int32_t> positions(n_block);
    for (int32_t i = 0; i < n_block; ++i) positions[i] = start + i;
    ggml_tensor * tok = g.add_input(ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, n_block), tokens);
    ggml_tensor * pos = g.add_input(ggml_new_tensor_1d(g.ctx, GGML_TYPE_I32, n_block), positions.data());

    // one mask per kind of layer: full layers see everything unless the draft is causal
    ggml_tensor * mask_full = nullptr;
    ggml_tensor * mask_swa  = nullptr;
    auto layer_mask = [&](int32_t il) -> ggml_tensor * {
        const bool swa    = hp.swa_layers[il];
        const bool causal = hp.causal >= 0 ? hp.causal == 1 : swa;
        if (swa) {
            return mask_swa ? mask_swa : (mask_swa = attention_mask(g, n_kv, n_block, causal, hp.sliding_window));
        }
        if (!causal) {
            return nullptr;
        }
        return mask_full ? mask_full : (mask_full = attention_mask(g, n_kv, n_block, true, 0));
    };

    ggml_tensor * x = ggml_get_rows(g.ctx, tok_embd_, tok);
    if (hp.embedding_scale != 1.0f) {
        x = ggml_scale(g.ctx, x, hp.embedding_scale);
    }
    x = g.name(x, "inp_noise_embd");

    const float kq_scale = 1.0f / std::sqrt((float) hp.head_dim);
    for (int32_t il = 0; il < hp.n_layer; ++il) {
        const draft_layer & l = draft_.layers[il];
        ggml_tensor * h = g.name(rms_norm(g.ctx, x, l.attn_norm), "noise_norm", il);
        ggml_tensor * attn_dyn = nullptr;  // DFlash 2: the convolution around attention (q, k, v read its input side)
        if (l.attn_conv_proj != nullptr) {
            attn_dyn = g.name(ggml_mul_mat(g.ctx, l.attn_conv_proj, h), "attn_conv_dyn", il);
            h = g.name(conv(g.ctx, h, attn_dyn, l.attn_conv_base, 0), "attn_conv_in", il);
        }

        ggml_tensor * q = ggml_reshape_3d(g.ctx, ggml_mul_mat(g.ctx, l.wq, h), hp.head_dim, hp.n_head,    n_block);
        ggml_tensor * k = ggml_reshape_3d(g.ctx, ggml_mul_mat(g.ctx, l.wk, h), hp.head_dim, hp.n_head_kv, n_block);
        ggml_tensor * v = ggml_reshape_3d(g.ctx, ggml_mul_mat(g.ctx, l.wv, h), hp.head_dim, hp.n_head_kv, n_block);
        q = g.name(rope(g.ctx, rms_norm(g.ctx, q, l.attn_q_norm), pos), "Qcur", il);
        k = g.name(rope(g.ctx, rms_norm(g.ctx, k, l.attn_k_norm), pos), "Kcur", il);
        v = g.name(v, "Vcur", il);

        // keys/values: the cached context [0, start), then the block, written after it into cache
        // positions the next injection overwrites (a view instead of a concatenated copy)
        store_kv(g, il, k, v, start, n_block);
        ggml_tensor * ck = cache_k_[il];
        ggml_tensor * cv = cache_v_[il];
        ggml_tensor * k_all = ggml_view_3d(g.ctx, ck, hp.head_dim, hp.n_head_kv, n_kv, ck->nb[1], ck->nb[2], 0);

        ggml_tensor * qp = ggml_permute(g.ctx, q, 0, 2, 1, 3);                       // [hd, B, n_head]
        ggml_tensor * kp = ggml_permute(g.ctx, k_all, 0, 2, 1, 3);                   // [hd, n_kv, n_head_kv]
        ggml_tensor * kq = ggml_mul_mat(g.ctx, kp, qp);                              // [n_kv, B, n_head]
        kq = ggml_soft_max_ext(g.ctx, kq, layer_mask(il), kq_scale, 0.0f);
        ggml_tensor * vp = ggml_view_3d(g.ctx, cv, n_kv, hp.head_dim, hp.n_head_kv, cv->nb[1], cv->nb[2], 0); // [n_kv, hd, n_head_kv]
        ggml_tensor * kqv = ggml_mul_mat(g.ctx, vp, kq);                             // [hd, B, n_head]
        ggml_tensor * attn = ggml_cont_2d(g.ctx, ggml_permute(g.ctx, kqv, 0, 2, 1, 3), (int64_t) hp.head_dim * hp.n_head, n_block);
        attn = ggml_mul_mat(g.ctx, l.wo, attn);
        if (attn_dyn != nullptr) {
            attn = g.name(conv(g.ctx, attn, attn_dyn, l.attn_conv_base, 1), "attn_conv_out", il);
        }

        ggml_tensor * ffn_inp = g.name(ggml_add(g.ctx, attn, x), "ffn_inp", il);
        ggml_tensor * f = g.name(rms_norm(g.ctx, ffn_inp, l.ffn_norm), "ffn_norm", il);
        ggml_tensor * ffn_dyn = nullptr;  // DFlash 2: the convolution around the MLP
        if (l.ffn_conv_proj != nullptr) {
            ffn_dyn = g.name(ggml_mul_mat(g.ctx, l.ffn_conv_proj, f), "ffn_conv_dyn", il);
            f = g.name(conv(g.ctx, f, ffn_dyn, l.ffn_conv_base, 0), "ffn_conv_in", il);
        }
        ggml_tensor * gate = ggml_silu(g.ctx, ggml_mul_mat(g.ctx, l.ffn_gate, f));
        ggml_tensor * up   = ggml_mul_mat(g.ctx, l.ffn_up, f);
        ggml_tensor * ffn_out = g.name(ggml_mul_mat(g.ctx, l.ffn_down, ggml_mul(g.ctx, gate, up)), "ffn_out", il);
        if (ffn_dyn != nullptr) {
            ffn_out = g.name(conv(g.ctx, ffn_out, ffn_dyn, l.ffn_conv_base, 1), "ffn_conv_out", il);
        }
        x = g.name(ggml_add(g.ctx, ffn_out, ffn_inp), "l_out", il);
    }

    ggml_tensor * y = g.name(rms_norm(g.ctx, x, draft_.output_norm), "result_norm");
    if (g.tracing) {  // llama.cpp's result_output: raw head output of every block position, traced apart
        g.name(ggml_mul_mat(g.ctx, output_, y), "result_output");
    }
    // only the drafted slots the loop verifies need logits (the head is the largest matmul of a small
    // draft: skip the other rows); in DFlash's layout block position 0 is the known last token only
    ggml_tensor * y_pred = ggml_view_2d(g.ctx, y, hp.n_embd, n_logits, y->nb[1], (size_t) first * y->nb[1]);
    ggml_tensor * out = ggml_mul_mat(g.ctx, g.tracing ? output_ : head_, y_pred);
    if (hp.logit_scale != 1.0f) {
        out = ggml_scale(g.ctx, out, hp.logit_scale);
    }
    if (hp.logit_softcap > 0.0f) {
        out = ggml_scale(g.ctx, ggml_tanh(g.ctx, ggml_scale(g.ctx, out, 1.0f / hp.logit_softcap)), hp.logit_softcap);
    }
    ggml_set_output(out);
    ggml_build_forward_expand(g.gf, out);
    ggml_tensor * gate = nullptr;  // DFlash 2: the selector's gate of the drafted slots
    if (draft_.selector_hidden != nullptr) {
        gate = g.name(ggml_mul_mat(g.ctx, draft_.selector_hidden, y_pred), "selector_gate");
        ggml_set_output(gate);
        ggml_build_forward_expand(g.gf, gate);
    }
    if (draft_.conf_proj != nullptr) {  // DSpark's confidence head reads the slots' result_norm (on the host)
        ggml_set_output(y);
        ggml_build_forward_expand(g.gf, y);
    }
    for (ggml_tensor * t : g.named) {
        ggml_build_forward_expand(g.gf, t);
    }

    compute(g, trace);
    result.hidden.resize(draft_.conf_proj != nullptr ? (size_t) n_logits * hp.n_embd : 0);
    if (!result.hidden.empty()) {
        ggml_backend_tensor_get(y, result.hidden.data(), (size_t) first * y->nb[1], result.hidden.size() * sizeof(float));
    }
    result.logits.resize((size_t) n_logits * n_head_rows_);
    ggml_backend_tensor_get(out, result.logits.data(), 0, result.logits.size() * sizeof(float));
    result.gate.resize(gate != nullptr ? (size_t) ggml_nelements(gate) : 0);
    if (gate != nullptr) {
        ggml_backend_tensor_get(gate, result.gate.data(), 0, ggml_nbytes(gate));
    }
    if (trace != nullptr && draft_.reduced_vocab()) {
        scatter_to_vocab((*trace)["result_output"]);
    }
}

// [n_head_rows, B] head output -> [n_vocab, B]: row r at token d2t[r], -inf elsewhere.
void draft_runner::scatter_to_vocab(traced_tensor & t) const {
    const size_t n_pos = t.data.size() / n_head_rows_;
    std::vector<float> full((size_t) n_vocab_ * n_pos, -INFINITY);
    for (size_t i = 0; i < n_pos; ++i) {
        for (int32_t r = 0; r < n_head_rows_; ++r) {
            full[i * n_vocab_ + draft_.d2t_ids[r]] = t.data[i * n_head_rows_ + r];
        }
    }
    t.data = std::move(full);
    t.shape[0] = n_vocab_;
}

void draft_runner::crop(int32_t n) {
    if (n < 0 || n > n_cached_) {
        throw std::invalid_argument("draft crop to " + std::to_string(n) + " but the cache holds " + std::to_string(n_cached_));
    }
    n_cached_ = n;
}

} // namespace dflash
