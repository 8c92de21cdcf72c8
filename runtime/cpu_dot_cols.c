// Multi-column dot products, bit for bit ggml's vec_dot per column (cpu_dot_cols.h).
//
// Every kernel mirrors the float arithmetic of ggml's AVX2 vec_dot for its type: per block of 32
// values (a super-block of 256 for the K-quants), an integer dot product of the block in eight lanes
// of four consecutive values (exact, so how it is computed does not matter), converted to float,
// times the block's scale product (d_x * d_y, one float multiply), accumulated by one fused
// multiply-add per block into eight float lanes, and at the end the lanes summed by the same tree as
// ggml's hsum_float_8; Q4_1 adds the sum of m_x * s_y over the blocks in block order, Q4_K its mins'
// four lanes. tests/test_dot_cols.py holds every kernel to vec_dot bit for bit on random rows.

#define GGML_COMMON_DECL_C
#include "ggml-common.h"
#include "ggml-cpu.h"
#include "simd-mappings.h"

#include "cpu_dot_cols.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DC_KERNELS 1
#else
#define DC_KERNELS 0
#endif

enum { DC_MAX_COLS = 4, DC_COL_BLOCK = 16 };

#if DC_KERNELS

// The eight lanes summed as ggml's hsum_float_8 sums them: (lo + hi), then its two halves, then
// the last pair.
static inline float dc_hsum(__m256 v) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

// Lane j: sum over the four bytes 4j..4j+3 of u[i] * s[i] (u unsigned, s signed), as float. Exact:
// a pair of products stays within int16 for the value ranges of these types.
static inline __m256 dc_dot_us8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s));
#elif defined(__AVXVNNI__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s));
#else
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16(u, s)));
#endif
}

// 32 unsigned nibbles: the low halves of the 16 bytes, then their high halves.
static inline __m256i dc_nibbles(const uint8_t * q) {
    const __m128i b = _mm_loadu_si128((const __m128i *) q);
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// 0x10 in byte i where bit i of the 32-bit mask is set.
static inline __m256i dc_bit_bytes(const uint8_t * bits) {
    uint32_t m;
    memcpy(&m, bits, sizeof(m));
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int) m),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0x0000000000000000));
    const __m256i bit = _mm256_set1_epi64x((int64_t) 0x8040201008040201);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// The columns of a chunk: their quantized blocks, and their block scales converted to float once for
// all the weight rows (d[c * nb + ib]: column c's block ib; m: Q8_1's sums, for Q4_1).
typedef struct {
    const char *  q;
    size_t        stride;
    const float * d;
    const float * m;
    int           nb;
} dc_cols;

#define DC_BLOCK(type, cols, c, ib) (((const type *) ((cols)->q + (size_t) (c) * (cols)->stride)) + (ib))

// A signed block x against NC signed column blocks: |x| once, each column signed by x.
static inline __attribute__((always_inline)) void dc_signed_block(__m256 * acc, __m256i qx, float dx, const dc_cols * y,
                                                                  int ib, const int NC) {
    const __m256i ax = _mm256_sign_epi8(qx, qx);
    for (int c = 0; c < NC; ++c) {
        const __m256i qy = _mm256_loadu_si256((const __m256i *) DC_BLOCK(block_q8_0, y, c, ib)->qs);
        const __m256  q  = dc_dot_us8(ax, _mm256_sign_epi8(qy, qx));
        acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(dx * y->d[c * y->nb + ib]), q, acc[c]);
    }
}

static inline __attribute__((always_inline)) void dc_q8_0(float * s, const void * vx, const dc_cols * y, const int NC) {
    const block_q8_0 * x = (const block_q8_0 *) vx;
    __m256 acc[DC_MAX_COLS];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
    for (int ib = 0; ib < y->nb; ++ib) {
        dc_signed_block(acc, _mm256_loadu_si256((const __m256i *) x[ib].qs), GGML_CPU_FP16_TO_FP32(x[ib].d), y, ib, NC);
    }
    for (int c = 0; c < NC; ++c) s[c] = dc_hsum(acc[c]);
}

static inline __attribute__((always_inline)) void dc_q4_0(float * s, const void * vx, const dc_cols * y, const int NC) {
    const block_q4_0 * x = (const block_q4_0 *) vx;
    __m256 acc[DC_MAX_COLS];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
    for (int ib = 0; ib < y->nb; ++ib) {  // the nibbles, less 8, as signed bytes
        const __m256i qx = _mm256_sub_epi8(dc_nibbles(x[ib].qs), _mm256_set1_epi8(8));
        dc_signed_block(acc, qx, GGML_CPU_FP16_TO_FP32(x[ib].d), y, ib, NC);
    }
    for (int c = 0; c < NC; ++c) s[c] = dc_hsum(acc[c]);
}

static inline __attribute__((always_inline)) void dc_q5_0(float * s, const void * vx, const dc_cols * y, const int NC) {
    const block_q5_0 * x = (const block_q5_0 *) vx;
    __m256 acc[DC_MAX_COLS];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
    for (int ib = 0; ib < y->nb; ++ib) {
        // the 5-bit values, less 16, as signed bytes
        const __m256i q5 = _mm256_or_si256(dc_nibbles(x[ib].qs), dc_bit_bytes(x[ib].qh));
        dc_signed_block(acc, _mm256_sub_epi8(q5, _mm256_set1_epi8(16)), GGML_CPU_FP16_TO_FP32(x[ib].d), y, ib, NC);
    }
    for (int c = 0; c < NC; ++c) s[c] = dc_hsum(acc[c]);
}

static inline __attribute__((always_inline)) void dc_q4_1(float * s, const void * vx, const dc_cols * y, const int NC) {
    const block_q4_1 * x = (const block_q4_1 *) vx;
    __m256 acc[DC_MAX_COLS];
    float  mins[DC_MAX_COLS];
    for (int c = 0; c < NC; ++c) {
        acc[c]  = _mm256_setzero_ps();
        mins[c] = 0.0f;
    }
    for (int ib = 0; ib < y->nb; ++ib) {
        const float dx = GGML_CPU_FP16_TO_FP32(x[ib].d);
        const float mx = GGML_CPU_FP16_TO_FP32(x[ib].m);
        const __m256i qx = dc_nibbles(x[ib].qs);
        for (int c = 0; c < NC; ++c) {
            mins[c] += mx * y->m[c * y->nb + ib];
            const __m256 q = dc_dot_us8(qx, _mm256_loadu_si256((const __m256i *) DC_BLOCK(block_q8_1, y, c, ib)->qs));
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(dx * y->d[c * y->nb + ib]), q, acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) s[c] = dc_hsum(acc[c]) + mins[c];
}

// K-quants: super-blocks of 256 values against Q8_K columns (float scale d, sums of 16 values in
// bsums). Per super-block, the integer sums land in eight int32 lanes exactly as in ggml's AVX2
// vec_dot (lane l: the products of values 4l..4l+3 of every 32-value group, each group's times its
// sub-block scales), then one fused multiply-add by d_x * d_y; Q4_K's mins and Q6_K's offset of 32
// go through the columns' bsums in ggml's lane order too.

// 32 bytes of sub-block scale s0 in the low 16 values of a 32-value group and s1 in the high 16, as int16
static inline __m256i dc_scale_pair(int s0, int s1) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16((short) s0)), _mm_set1_epi16((short) s1), 1);
}

static inline __attribute__((always_inline)) void dc_q4_K(float * s, const void * vx, const dc_cols * y, const int NC) {
    const block_q4_K * x = (const block_q4_K *) vx;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[DC_MAX_COLS];
    __m128 acc_m[DC_MAX_COLS];
    for (int c = 0; c < NC; ++c) {
        acc[c]   = _mm256_setzero_ps();
        acc_m[c] = _mm_setzero_ps();
    }
    for (int i = 0; i < y->nb; ++i) {
        // the 6-bit scales and mins of the eight 32-value sub-blocks
        const uint8_t * q = x[i].scales;
        uint8_t sc[8], mn[8];
        for (int j = 0; j < 4; ++j) {
            sc[j]     = q[j] & 63;
            mn[j]     = q[j + 4] & 63;
            sc[j + 4] = (q[j + 8] & 0x0F) | ((q[j] >> 6) << 4);
            mn[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
        }
        const __m128i mins = _mm_setr_epi16(mn[0], mn[1], mn[2], mn[3], mn[4], mn[5], mn[6], mn[7]);
        const float dx = GGML_CPU_FP16_TO_FP32(x[i].d), mx = GGML_CPU_FP16_TO_FP32(x[i].dmin);
        __m256i sumi[DC_MAX_COLS];
        for (int c = 0; c < NC; ++c) sumi[c] = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {  // 64 values: sub-block 2j in the low nibbles, 2j + 1 in the high
            const __m256i bits = _mm256_loadu_si256((const __m256i *) (x[i].qs + 32 * j));
            const __m256i lo = _mm256_and_si256(bits, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), low4);
            const __m256i s_lo = _mm256_set1_epi16(sc[2 * j]), s_hi = _mm256_set1_epi16(sc[2 * j + 1]);
            for (int c = 0; c < NC; ++c) {
                const int8_t * q8 = DC_BLOCK(block_q8_K, y, c, i)->qs + 64 * j;
                const __m256i y_lo = _mm256_loadu_si256((const __m256i *) q8);
                const __m256i y_hi = _mm256_loadu_si256((const __m256i *) (q8 + 32));
                const __m256i p_lo = _mm256_madd_epi16(s_lo, _mm256_maddubs_epi16(lo, y_lo));
                const __m256i p_hi = _mm256_madd_epi16(s_hi, _mm256_maddubs_epi16(hi, y_hi));
                sumi[c] = _mm256_add_epi32(sumi[c], _mm256_add_epi32(p_lo, p_hi));
            }
        }
        for (int c = 0; c < NC; ++c) {
            const block_q8_K * b = DC_BLOCK(block_q8_K, y, c, i);
            // lane m: mins 2m and 2m + 1 times their sub-blocks' sums
            const __m256i bsums = _mm256_loadu_si256((const __m256i *) b->bsums);
            const __m128i sums = _mm_hadd_epi16(_mm256_castsi256_si128(bsums), _mm256_extracti128_si256(bsums, 1));
            acc_m[c] = _mm_fmadd_ps(_mm_set1_ps(-b->d * mx), _mm_cvtepi32_ps(_mm_madd_epi16(mins, sums)), acc_m[c]);
            acc[c]   = _mm256_fmadd_ps(_mm256_set1_ps(b->d * dx), _mm256_cvtepi32_ps(sumi[c]), acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) {
        __m128 m = _mm_add_ps(acc_m[c], _mm_movehl_ps(acc_m[c], acc_m[c]));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        s[c] = dc_hsum(acc[c]) + _mm_cvtss_f32(m);
    }
}

static inline __attribute__((always_inline)) void dc_q6_K(float * s, const void * vx, const dc_cols * y, const int NC) {
    const block_q6_K * x = (const block_q6_K *) vx;
    const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(0x03);
    __m256 acc[DC_MAX_COLS];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
    for (int i = 0; i < y->nb; ++i) {
        const int8_t * sc = x[i].scales;  // one per 16 values
        __m256i sumi[DC_MAX_COLS];
        for (int c = 0; c < NC; ++c) sumi[c] = _mm256_setzero_si256();
        for (int h = 0; h < 2; ++h) {  // 128 values: four groups of 32 from 64 bytes of low nibbles, 32 of high bits
            const __m256i l0 = _mm256_loadu_si256((const __m256i *) (x[i].ql + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *) (x[i].ql + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *) (x[i].qh + 32 * h));
            for (int g = 0; g < 4; ++g) {
                const __m256i src = g % 2 == 0 ? l0 : l1;  // groups 0, 1: low nibbles; 2, 3: high
                const __m256i nib = _mm256_and_si256(g < 2 ? src : _mm256_srli_epi16(src, 4), low4);
                const __m256i top = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * g), low2), 4);
                const __m256i q6  = _mm256_or_si256(nib, top);  // 0..63; the offset of 32 comes off below
                const int     k   = 4 * h + g;                  // the group of 32 values, scales 2k and 2k + 1
                const __m256i scl = dc_scale_pair(sc[2 * k], sc[2 * k + 1]);
                for (int c = 0; c < NC; ++c) {
                    const int8_t * q8 = DC_BLOCK(block_q8_K, y, c, i)->qs + 32 * k;
                    sumi[c] = _mm256_add_epi32(sumi[c],
                        _mm256_madd_epi16(scl, _mm256_maddubs_epi16(q6, _mm256_loadu_si256((const __m256i *) q8))));
                }
            }
        }
        const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) sc));
        const float dx = GGML_CPU_FP16_TO_FP32(x[i].d);
        for (int c = 0; c < NC; ++c) {
            const block_q8_K * b = DC_BLOCK(block_q8_K, y, c, i);
            // lane m less 32 * (bsums 2m and 2m + 1 times their scales)
            const __m256i bsums = _mm256_loadu_si256((const __m256i *) b->bsums);
            const __m256i off   = _mm256_slli_epi32(_mm256_madd_epi16(bsums, scales16), 5);
            const __m256  q     = _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi[c], off));
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(b->d * dx), q, acc[c]);
        }
    }
    for (int c = 0; c < NC; ++c) s[c] = dc_hsum(acc[c]);
}

typedef void (*dc_kernel)(float * s, const void * x, const dc_cols * y, int n_cols);

#define DC_WIDTHS(kernel)                                                                       \
    static void kernel##_n(float * s, const void * x, const dc_cols * y, int n_cols) {           \
        switch (n_cols) {                                                                       \
            case 1:  kernel(s, x, y, 1); break;                                                 \
            case 2:  kernel(s, x, y, 2); break;                                                 \
            case 3:  kernel(s, x, y, 3); break;                                                 \
            default: kernel(s, x, y, 4); break;                                                 \
        }                                                                                       \
    }
DC_WIDTHS(dc_q8_0)
DC_WIDTHS(dc_q4_0)
DC_WIDTHS(dc_q5_0)
DC_WIDTHS(dc_q4_1)
DC_WIDTHS(dc_q4_K)
DC_WIDTHS(dc_q6_K)

static dc_kernel dc_kernel_of(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_Q8_0: return dc_q8_0_n;
        case GGML_TYPE_Q4_0: return dc_q4_0_n;
        case GGML_TYPE_Q5_0: return dc_q5_0_n;
        case GGML_TYPE_Q4_1: return dc_q4_1_n;
        case GGML_TYPE_Q4_K: return dc_q4_K_n;
        case GGML_TYPE_Q6_K: return dc_q6_K_n;
        default:             return NULL;
    }
}

// Columns c0..c1 of y (the type's vec_dot type) described for the kernels; d and m hold
// (c1 - c0) * nb floats.
static dc_cols dc_describe(enum ggml_type type, int n, const char * y, size_t y_stride, int n_cols, float * d,
                           float * m) {
    const bool k_quant = type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K;  // Q8_K: float scales, read in place
    const dc_cols cols = { y, y_stride, d, m, k_quant ? n / QK_K : n / 32 };
    for (int c = 0; c < n_cols && !k_quant; ++c) {
        for (int ib = 0; ib < cols.nb; ++ib) {
            if (type == GGML_TYPE_Q4_1) {
                const block_q8_1 * b = DC_BLOCK(block_q8_1, &cols, c, ib);
                d[c * cols.nb + ib] = GGML_CPU_FP16_TO_FP32(b->d);
                m[c * cols.nb + ib] = GGML_CPU_FP16_TO_FP32(b->s);
            } else {
                d[c * cols.nb + ib] = GGML_CPU_FP16_TO_FP32(DC_BLOCK(block_q8_0, &cols, c, ib)->d);
            }
        }
    }
    return cols;
}

#endif  // DC_KERNELS

// On unless DFLASH_LLAMA_DOT_COLS=0 (read once); dflash_dot_cols_enable switches them for the process.
static atomic_int dc_state = -1;  // -1: not read yet; matmul threads may ask at once, each storing the same

static bool dc_enabled(void) {
    int e = atomic_load(&dc_state);
    if (e < 0) {
        const char * v = getenv("DFLASH_LLAMA_DOT_COLS");
        e = !(v != NULL && strcmp(v, "0") == 0);
        int expected = -1;
        atomic_compare_exchange_strong(&dc_state, &expected, e);
        e = atomic_load(&dc_state);
    }
    return e == 1;
}

void dflash_dot_cols_enable(bool on) {
    atomic_store(&dc_state, on ? 1 : 0);
}

bool dflash_dot_cols_enabled(void) {
    return dc_enabled();
}

bool dflash_dot_cols_supported(enum ggml_type type) {
#if DC_KERNELS
    return dc_enabled() && (type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q5_0 ||
                            type == GGML_TYPE_Q8_0 || type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K);
#else
    (void) type;
    return false;
#endif
}

// The scales of DC_COL_BLOCK columns of rows up to DC_MAX_BLOCKS blocks (16,384 values) fit on the stack.
enum { DC_MAX_BLOCKS = 512 };

// s[c] = vec_dot(n, x, y + c * y_stride) for c < n_cols (1..4); false where `type` has no kernel here.
static bool dc_dot_cols(enum ggml_type type, int n, float * s, const void * x, const void * y, size_t y_stride,
                        int n_cols) {
    if (!dflash_dot_cols_supported(type) || n <= 0 || n % ggml_blck_size(type) != 0 || n / 32 > DC_MAX_BLOCKS ||
        n_cols < 1 || n_cols > DC_MAX_COLS) {
        return false;
    }
#if DC_KERNELS
    float d[DC_MAX_COLS * DC_MAX_BLOCKS], m[DC_MAX_COLS * DC_MAX_BLOCKS];
    const dc_cols cols = dc_describe(type, n, (const char *) y, y_stride, n_cols, d, m);
    dc_kernel_of(type)(s, x, &cols, n_cols);
    return true;
#else
    (void) s; (void) x; (void) y;
    return false;
#endif
}

// Blocks of 16 columns (their scales converted once); each weight row of the chunk then taken with up
// to four of them at a time, its bytes reused from L1 by the block's groups.
bool dflash_mul_mat_chunk(enum ggml_type type, int64_t n, const char * w, size_t w_stride, int64_t r0, int64_t r1,
                          const char * y, size_t y_stride, int64_t c0, int64_t c1, char * dst, size_t dst_stride) {
    if (c1 - c0 < 2 || r1 <= r0 || n <= 0 || n % ggml_blck_size(type) != 0 || n / 32 > DC_MAX_BLOCKS ||
        !dflash_dot_cols_supported(type)) {
        return false;
    }
#if DC_KERNELS
    const dc_kernel kernel = dc_kernel_of(type);
    float d[DC_COL_BLOCK * DC_MAX_BLOCKS], m[DC_COL_BLOCK * DC_MAX_BLOCKS];
    float s[DC_MAX_COLS];
    for (int64_t cb = c0; cb < c1; cb += DC_COL_BLOCK) {
        const int64_t cb_end = cb + DC_COL_BLOCK < c1 ? cb + DC_COL_BLOCK : c1;
        const dc_cols all = dc_describe(type, (int) n, y + cb * y_stride, y_stride, (int) (cb_end - cb), d, m);
        for (int64_t r = r0; r < r1; ++r) {
            for (int64_t c = cb; c < cb_end; c += DC_MAX_COLS) {
                const int nc = (int) (cb_end - c < DC_MAX_COLS ? cb_end - c : DC_MAX_COLS);
                const int64_t k0 = c - cb;  // the group's first column in `all`
                const dc_cols group = { all.q + k0 * y_stride, y_stride, all.d + k0 * all.nb, all.m + k0 * all.nb,
                                        all.nb };
                kernel(s, w + r * w_stride, &group, nc);
                for (int k = 0; k < nc; ++k) {
                    memcpy(dst + (c + k) * dst_stride + r * sizeof(float), &s[k], sizeof(float));
                }
            }
        }
    }
    return true;
#else
    (void) w; (void) w_stride; (void) y; (void) y_stride; (void) dst; (void) dst_stride;
    return false;
#endif
}

// Rows of random values (a 32-bit xorshift; every 7th value ten times larger, as outlier channels
// are), x quantized by `type`, the columns by its vec_dot type, as ggml's matmul converts them.
int dflash_dot_cols_mismatches(enum ggml_type type, int n, int n_cols, uint32_t seed) {
    if (!dflash_dot_cols_supported(type) || n <= 0 || n % ggml_blck_size(type) != 0 || n / 32 > DC_MAX_BLOCKS ||
        n_cols < 1 || n_cols > DC_MAX_COLS) {
        return -1;
    }
    ggml_cpu_init();  // the fp16 conversion table
    const struct ggml_type_traits_cpu * traits = ggml_get_type_traits_cpu(type);
    const enum ggml_type yt = traits->vec_dot_type;
    const size_t x_row = ggml_row_size(type, n), y_row = ggml_row_size(yt, n);
    float * v  = malloc(sizeof(float) * (size_t) n);
    char  * qx = malloc(x_row);
    char  * qy = malloc(y_row * (size_t) n_cols);
    uint32_t st = seed * 2654435761u + 1u;
    int bad = 0;
    for (int c = -1; c < n_cols; ++c) {
        for (int i = 0; i < n; ++i) {
            st ^= st << 13; st ^= st >> 17; st ^= st << 5;
            v[i] = ((float) (st >> 8) / 16777216.0f - 0.5f) * (i % 7 == 0 ? 20.0f : 2.0f);
        }
        if (c < 0) {
            ggml_quantize_chunk(type, v, qx, 0, 1, n, NULL);
        } else {
            ggml_get_type_traits_cpu(yt)->from_float(v, qy + (size_t) c * y_row, n);
        }
    }
    float got[DC_MAX_COLS];
    dc_dot_cols(type, n, got, qx, qy, y_row, n_cols);
    for (int c = 0; c < n_cols; ++c) {
        float want;
        traits->vec_dot(n, &want, 0, qx, 0, qy + (size_t) c * y_row, 0, 1);
        bad += memcmp(&want, &got[c], sizeof(float)) != 0;
    }
    free(v);
    free(qx);
    free(qy);
    return bad;
}
