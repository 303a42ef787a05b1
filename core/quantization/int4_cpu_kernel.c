// Grouped integer-weight GEMM for CPUs: y[m, n] = sum_k x[m, k] (q[n, k] s[g(k), n] + z[g(k), n])
// with x fp32 [M, K], codes q (4-bit in [0, 16) or int8) and a scale s and min z per `group` inputs in fp16.
//
// Why a kernel of our own (built by int4_cpu.py with the host's C compiler, loaded with ctypes):
// torch's _weight_int4pack_mm_for_cpu unpacks the weight again for every 4 rows (batch 16 and
// prefill ran 3-7x slower than the dequantized bf16 GEMM) and takes bf16 activations only, and
// oneDNN's fp32 GEMM picks another kernel for one row than for several, so a request's tokens
// changed with what else was in the batch. Here every output element is one fixed sequence of
// operations whatever M, the row block or the thread count: a row's result never depends on the
// other rows (batch-invariant greedy output), and a block of up to MB rows shares each unpacked
// weight tile, so larger batches cost little more than one row's weight traffic.
//
// Layout: outputs in tiles of L = 16. Per tile, 4-bit codes as L bytes per pair of inputs (low
// nibble: input 2j, high nibble: input 2j+1), int8 codes as L bytes per input; the group's scale
// and min as 2 x L fp16 per (tile, group), scales first.
#include <stdint.h>
#include <string.h>

#define L 16
#define MB 16

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
