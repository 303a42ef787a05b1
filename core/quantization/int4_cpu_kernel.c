// Grouped integer-weight GEMM for CPUs: y[m, n] = sum_k x[m, k] (q[n, k] s[g(k), n] + z[g(k), n])
// with x fp32 [M, K], codes q (4-bit in [0, 16) or int8) and a scale s and min z per `group` inputs in fp16.
//
// Why a kernel of our own (built by int4_cpu.py with the host's C compiler, loaded with ctypes):
// torch's _weight_int4pack_mm_for_cpu unpacks the weight again for every 4 rows (batch 16 and
// prefill ran 3-7x slower than the dequantized bf16 GEMM) and takes bf16 activations only, and
// oneDNN's fp32 GEMM picks another kernel for one row than for several, so a request's tokens
// changed with what else was in the batch. Here every output element is one fixed sequence of
// operations whatever M, the row block or the thread count: a row's result never depends on the
// other rows (batch-invariant greedy output), and a block of rows shares each unpacked weight
// tile, so larger batches cost little more than one row's weight traffic.
//
// Two inner loops, chosen by what -march=native offers:
// - AVX512-VNNI (integer dot products, `grouped_layout() == 1`): each row's group of inputs becomes
//   int16 codes c with one fp32 step a = max|x| / 32639 (RNE; closer to x than bf16's 8 bits), and
//   y = sum_g a_g (s_g D_g + z_g S_g) with D_g = sum_k c_k q_k (exact int32) and S_g = sum_k c_k.
//   The codes are split into two int8 halves, c = 256 h + l (32639 = 127 * 257 keeps both in
//   [-128, 127]), so that D = 256 sum h q + sum l q comes from byte dot products: vpdpbusd (16 outputs
//   by 4 inputs of one row an instruction) and, on CPUs with AMX and blocks of 12-16 rows, tdpbsud
//   (int4_cpu_amx.c: 16 rows by 16 outputs by 32 inputs an instruction). Both give the same exact
//   integers and combine groups by the same fp32 epilogue in the same order, so a row's bits do not
//   depend on which one ran it. int8 activations alone (llama.cpp's Q8 ones) would halve the byte
//   products but moved SmolLM2's logits by 0.19 on average (docs/performance.md, "C2 at 16 rows").
// - otherwise (AVX2 and others, `grouped_layout() == 0`): each group is dequantized once per row
//   block, w = q * s + z in fp32, and multiply-added in input order on fp32 activations.
//
// Layout: outputs in tiles of L = 16; the group's scale and min as 2 x L fp16 per (tile, group),
// scales first. Codes per tile, integer loops: 64 bytes per 8 inputs 8c..8c+7 (4 bits: byte 4n+t
// holds input 8c+t of output n in its low nibble, 8c+4+t in its high one) or per 4 inputs (int8 q as
// unsigned q + 128: byte 4n+t is input 4p+t of output n), so that each 32-bit lane n holds the four
// codes of output n that vpdpbusd multiplies by four activation bytes; those 64 bytes are also a row
// of AMX's B tile. fp32 loop: 4-bit codes as L bytes per pair of inputs (low nibble: input 2j, high
// nibble: input 2j+1), int8 codes as L bytes per input.
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define L 16

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

#define MB 8          // rows a block of the VNNI loop shares each unpacked weight chunk with
#define QMAX 32639.0f // 127 * 257: both int8 halves of every code lie in [-128, 127]
#define OFFSET 128    // int8 weights are stored as q + 128: the unsigned side of vpdpbusd and tdpbsud
#define AHEAD 16      // groups of codes prefetched ahead of the one being multiplied

int grouped_layout(void) { return 1; }

// One GEMM call's activations: per row, the int8 halves of its int16 codes, and per group its fp32
// step and the sum of its codes.
typedef struct {
    int8_t *h, *l;
    float *step;
    int32_t *sums;
} acts;

static acts new_acts(long M, long K, int groups) {
    int8_t *codes = malloc(2 * M * K);
    return (acts){codes, codes + M * K, malloc(sizeof(float) * M * groups), malloc(sizeof(int32_t) * M * groups)};
}

static void free_acts(acts *a) {
    free(a->h);
    free(a->step);
    free(a->sums);
}

static void quantize_row(long K, int group, const float *x, const acts *a, long m) {
    for (long g0 = 0; g0 < K; g0 += group) {
        __m512 amax = _mm512_setzero_ps();
        __mmask16 nan = 0;
        for (int k = 0; k < group; k += 16) {
            __m512 v = _mm512_loadu_ps(x + g0 + k);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
        }
        const float top = _mm512_reduce_max_ps(amax);
        // A NaN or infinite input makes its group's step NaN: every output of the row is NaN, as in fp32.
        const int finite = !nan && top <= FLT_MAX;
        const __m512 inv = _mm512_set1_ps(finite && top > 0 ? QMAX / top : 0.0f);
        __m512i sum = _mm512_setzero_si512();
        for (int k = 0; k < group; k += 16) {
            const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + g0 + k), inv));
            const __m512i l = _mm512_srai_epi32(_mm512_slli_epi32(c, 24), 24);  // the low byte, signed
            const __m512i h = _mm512_srai_epi32(_mm512_sub_epi32(c, l), 8);
            sum = _mm512_add_epi32(sum, c);
            _mm_storeu_si128((__m128i *)(a->h + m * K + g0 + k), _mm512_cvtepi32_epi8(h));
            _mm_storeu_si128((__m128i *)(a->l + m * K + g0 + k), _mm512_cvtepi32_epi8(l));
        }
        const long at = m * (K / group) + g0 / group;
        a->step[at] = finite ? top / QMAX : NAN;
        a->sums[at] = _mm512_reduce_add_epi32(sum);
    }
}

// A group's share of L outputs of one row, added to acc: step (s D + z S), D = 256 dh + dl the exact
// integer dot product of the codes (int8 weights: less the offset's share, OFFSET S, still in integers).
static inline __attribute__((always_inline)) __m512 group_out(int bits, __m512 s, __m512 z, __m512i dh,
                                                              __m512i dl, int32_t sum, float step, __m512 acc) {
    __m512i d = _mm512_add_epi32(_mm512_slli_epi32(dh, 8), dl);
    if (bits == 8) d = _mm512_sub_epi32(d, _mm512_set1_epi32(OFFSET * sum));
    __m512 v = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(d), _mm512_mul_ps(z, _mm512_set1_ps((float)sum)));
    return _mm512_fmadd_ps(_mm512_set1_ps(step), v, acc);
}

// Group g's scales and mins of one tile's L outputs.
static inline __attribute__((always_inline)) void scale_min(const _Float16 *tile, int g, __m512 *s, __m512 *z) {
    *s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + (long)g * 2 * L)));
    *z = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(tile + (long)g * 2 * L + L)));
}

static inline __attribute__((always_inline)) void prefetch_group(const uint8_t *codes, long bytes) {
    for (long i = 0; i < bytes; i += 64) _mm_prefetch((const char *)codes + i, _MM_HINT_T0);
}

static inline __attribute__((always_inline)) __m512i quad_of(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

static inline __attribute__((always_inline)) __m512i low_nibbles(__m512i b) {
    return _mm512_and_si512(b, _mm512_set1_epi8(15));
}

static inline __attribute__((always_inline)) __m512i high_nibbles(__m512i b) {
    return _mm512_and_si512(_mm512_srli_epi16(b, 4), _mm512_set1_epi8(15));
}

// Codes b (16 outputs x 4 inputs) times both halves of the four activation codes at p.
static inline __attribute__((always_inline)) void dot4(__m512i *dh, __m512i *dl, __m512i b, const acts *a, long p) {
    *dh = _mm512_dpbusd_epi32(*dh, b, quad_of(a->h + p));
    *dl = _mm512_dpbusd_epi32(*dl, b, quad_of(a->l + p));
}

// R rows (from row m0) by T tiles of L outputs (constants in each instantiation, so the accumulators
// stay in registers; the per-row, per-output operations are the same for every R and T).
static inline __attribute__((always_inline)) void block(
        int R, int T, int bits, int groups, int group, const acts *a, long m0, long K, const uint8_t *w,
        long tile_bytes, const _Float16 *sz, long tile_sz, float *y, long ldy) {
    const long per_group = (long)group * L * bits / 8;
    __m512 acc[MB];
    for (int i = 0; i < R * T; i++) acc[i] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512i dh[MB], dl[MB];
        for (int i = 0; i < R * T; i++) dh[i] = dl[i] = _mm512_setzero_si512();
        const uint8_t *wg = w + g * per_group;
        for (int t = 0; t < T; t++) prefetch_group(wg + t * tile_bytes + AHEAD * per_group, per_group);
        for (int c = 0; c < group * bits / 32; c++) {  // 64 bytes of codes: 8 (4-bit) or 4 inputs
            for (int t = 0; t < T; t++) {
                const __m512i b = _mm512_loadu_si512(wg + t * tile_bytes + c * 64);
                for (int r = 0; r < R; r++) {
                    const long x = (m0 + r) * K + (long)g * group;
                    __m512i *hr = &dh[r * T + t], *lr = &dl[r * T + t];
                    if (bits == 4) {
                        dot4(hr, lr, low_nibbles(b), a, x + 8 * c);
                        dot4(hr, lr, high_nibbles(b), a, x + 8 * c + 4);
                    } else {
                        dot4(hr, lr, b, a, x + 4 * c);
                    }
                }
            }
        }
        for (int t = 0; t < T; t++) {
            __m512 s, z;
            scale_min(sz + t * tile_sz, g, &s, &z);
            for (int r = 0; r < R; r++) {
                const long at = (m0 + r) * groups + g;
                acc[r * T + t] = group_out(bits, s, z, dh[r * T + t], dl[r * T + t], a->sums[at], a->step[at],
                                           acc[r * T + t]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < T; t++) _mm512_storeu_ps(y + r * ldy + t * L, acc[r * T + t]);
}

// Tiles a block of R rows takes at once: enough independent accumulators to hide vpdpbusd's latency.
static int tiles_for(int rows) { return rows <= 2 ? 4 : rows <= 4 ? 2 : 1; }

#define BLOCK(R, T) \
    case R * 8 + T: block(R, T, bits, groups, group, a, m0, K, w, tile_bytes, sz, tile_sz, y, ldy); break;

static void vnni_block(int rows, int tiles, int bits, int groups, int group, const acts *a, long m0, long K,
                       const uint8_t *w, long tile_bytes, const _Float16 *sz, long tile_sz, float *y, long ldy) {
    switch (rows * 8 + tiles) {
        BLOCK(1, 1) BLOCK(1, 2) BLOCK(1, 3) BLOCK(1, 4) BLOCK(2, 1) BLOCK(2, 2) BLOCK(2, 3) BLOCK(2, 4)
        BLOCK(3, 1) BLOCK(3, 2) BLOCK(4, 1) BLOCK(4, 2)
        BLOCK(5, 1) BLOCK(6, 1) BLOCK(7, 1) BLOCK(8, 1)
    }
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include "int4_cpu_amx.c"
#else
// No AMX: every block runs the VNNI loop.
#define RB MB
typedef int amx_state;
static int amx_usable(long rows) { return (void)rows, 0; }
static int amx_rows(amx_state *state, int R, int T, int bits, int groups, int group, const acts *a, long m0,
                    long K, const uint8_t *w, long tile_bytes, const _Float16 *sz, long tile_sz, float *y,
                    long ldy) {
    return 0;
}
static void amx_done(amx_state *state) { (void)state; }
#endif

// rows (from m0) by `span` tiles: by AMX where it serves, else in blocks the VNNI loop takes at once.
static void rows_by_tiles(int rows, int span, amx_state *amx, int bits, int groups, int group, const acts *a,
                          long m0, long K, const uint8_t *w, long tile_bytes, const _Float16 *sz, long tile_sz,
                          float *y, long ldy) {
    if (amx_rows(amx, rows, span, bits, groups, group, a, m0, K, w, tile_bytes, sz, tile_sz, y, ldy)) return;
    for (long r0 = 0; r0 < rows; r0 += MB) {
        const int r = rows - r0 < MB ? rows - r0 : MB, per = tiles_for(r);
        for (int t0 = 0; t0 < span; t0 += per)
            vnni_block(r, span - t0 < per ? span - t0 : per, bits, groups, group, a, m0 + r0, K,
                       w + t0 * tile_bytes, tile_bytes, sz + t0 * tile_sz, tile_sz, y + r0 * ldy + t0 * L, ldy);
    }
}

// x [M, K] fp32 (rows `ldx` apart), y [M, N] fp32; N a multiple of L, K of group, group of 16.
void grouped_gemm(int bits, long M, long N, long K, int group, const float *x, long ldx, const uint8_t *w,
                  const _Float16 *sz, float *y, int threads) {
    const int groups = (int)(K / group);
    const long tiles = N / L, tile_bytes = K * L * bits / 8, tile_sz = (long)groups * 2 * L;
    // Row blocks of RB rows (AMX's tile height where AMX serves, else the VNNI loop's MB), by spans of tiles.
    const int amx = amx_usable(M), rb = amx ? RB : MB;
    const long blocks = (M + rb - 1) / rb;
    const long per_task = amx ? 1 : tiles_for(M < MB ? (int)M : MB);
    const long spans = (tiles + per_task - 1) / per_task;
    // One block of rows (decode): each thread quantizes the rows itself (a few thousand inputs, by the
    // same function, so the same codes), which spares the barrier between quantizing and multiplying:
    // on 2 cores shared with other work every barrier waits for the other thread to be scheduled.
    const int own = M <= rb;
    acts shared = own ? (acts){0} : new_acts(M, K, groups);
#pragma omp parallel num_threads(threads)
    {
        acts a = own ? new_acts(M, K, groups) : shared;
        amx_state tiles_state = {0};
        if (own) {
            for (long m = 0; m < M; m++) quantize_row(K, group, x + m * ldx, &a, m);
        } else {
#pragma omp for schedule(static)
            for (long m = 0; m < M; m++) quantize_row(K, group, x + m * ldx, &a, m);
        }
#pragma omp for schedule(static) nowait
        for (long i = 0; i < spans * blocks; i++) {
            // A span's row blocks one after another: its codes are read from memory once.
            const long t0 = (i / blocks) * per_task, m0 = (i % blocks) * rb;
            const int rows = M - m0 < rb ? (int)(M - m0) : rb;
            const int span = tiles - t0 < per_task ? (int)(tiles - t0) : (int)per_task;
            rows_by_tiles(rows, span, &tiles_state, bits, groups, group, &a, m0, K, w + t0 * tile_bytes,
                          tile_bytes, sz + t0 * tile_sz, tile_sz, y + m0 * N + t0 * L, N);
        }
        amx_done(&tiles_state);
        if (own) free_acts(&a);
    }
    if (!own) free_acts(&shared);
}


#else
#define MB 16

int grouped_layout(void) { return 0; }

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint8_t vb __attribute__((vector_size(16)));
typedef int8_t vsb __attribute__((vector_size(16)));
typedef _Float16 vh __attribute__((vector_size(32)));

// Byte codes widened to floats: gcc scalarises __builtin_convertvector from 16 bytes to 16 ints
// (measured 2.7x slower than oneDNN's fp32 GEMV for an int8 head), so AVX-512 gets the instructions.
#if defined(__AVX512F__)
#include <immintrin.h>
static inline __attribute__((always_inline)) vf widen_u8(vb b) {
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32((__m128i)b));
}
static inline __attribute__((always_inline)) vf widen_s8(vsb b) {
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32((__m128i)b));
}
#else
static inline __attribute__((always_inline)) vf widen_u8(vb b) {
    return __builtin_convertvector(__builtin_convertvector(b, vi), vf);
}
static inline __attribute__((always_inline)) vf widen_s8(vsb b) {
    return __builtin_convertvector(__builtin_convertvector(b, vi), vf);
}
#endif

static inline __attribute__((always_inline)) vf load_half(const _Float16 *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, vf);
}

// One tile of L outputs for R rows (R a constant in each instantiation below, so the
// accumulators stay in registers; the per-row operations are the same for every R). Each group's
// codes are dequantized once per row block, w = q * scale + min, then multiply-added in input order.
static inline __attribute__((always_inline)) void tile(
        int R, int bits, int groups, int group, const float *x, long ldx, const uint8_t *w,
        const _Float16 *sz, float *y, long ldy) {
    vf acc[MB];
    for (int r = 0; r < R; r++) acc[r] = (vf){0};
    const long group_bytes = (long)group * L * bits / 8;
    for (int g = 0; g < groups; g++) {
        const uint8_t *wg = w + g * group_bytes;
        const float *xg = x + (long)g * group;
        vf s = load_half(sz + (long)g * 2 * L), z = load_half(sz + (long)g * 2 * L + L);
        if (bits == 4) {
            for (int j = 0; j < group / 2; j++) {
                vb b;
                memcpy(&b, wg + (long)j * L, sizeof b);
                vf lo = widen_u8(b & 15) * s + z;
                vf hi = widen_u8(b >> 4) * s + z;
                for (int r = 0; r < R; r++) {
                    acc[r] += xg[r * ldx + 2 * j] * lo;
                    acc[r] += xg[r * ldx + 2 * j + 1] * hi;
                }
            }
        } else {
            for (int j = 0; j < group; j++) {
                vsb b;
                memcpy(&b, wg + (long)j * L, sizeof b);
                vf q = widen_s8(b) * s + z;
                for (int r = 0; r < R; r++) acc[r] += xg[r * ldx + j] * q;
            }
        }
    }
    for (int r = 0; r < R; r++) memcpy(y + r * ldy, &acc[r], sizeof acc[r]);
}

#define TILE(R) case R: tile(R, bits, groups, group, x, ldx, w, sz, y, ldy); break;

static void tile_rows(int rows, int bits, int groups, int group, const float *x, long ldx,
                      const uint8_t *w, const _Float16 *sz, float *y, long ldy) {
    switch (rows) {
        TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8)
        TILE(9) TILE(10) TILE(11) TILE(12) TILE(13) TILE(14) TILE(15) TILE(16)
    }
}

// x [M, K] fp32 (rows `ldx` apart), y [M, N] fp32; N a multiple of L, K of group.
void grouped_gemm(int bits, long M, long N, long K, int group, const float *x, long ldx, const uint8_t *w,
                 const _Float16 *sz, float *y, int threads) {
    const int groups = (int)(K / group);
    const long tiles = N / L, blocks = (M + MB - 1) / MB;
    const long tile_bytes = K * L * bits / 8, tile_sz = (long)groups * 2 * L;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long i = 0; i < tiles * blocks; i++) {
        const long t = i % tiles, m0 = (i / tiles) * MB;
        const int rows = M - m0 < MB ? (int)(M - m0) : MB;
        tile_rows(rows, bits, groups, group, x + m0 * ldx, ldx, w + t * tile_bytes,
                  sz + t * tile_sz, y + m0 * N + t * L, N);
    }
}
#endif
