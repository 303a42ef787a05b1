// AMX blocks of int4_cpu_kernel.c's integer GEMM (included there, where the compiler targets AMX-INT8:
// one translation unit, its types, group_out and the codes' layout).
//
// Why: at 16 rows the VNNI loop issues a vpdpbusd per row for every 16 outputs by 4 inputs; tdpbsud
// multiplies 16 rows by 16 outputs by 32 inputs in one instruction. The group scales every 32 inputs
// mean each group's two int32 tiles (the codes' high and low bytes) are stored and combined in fp32
// by the VNNI loop's group_out, on the same exact integers, in the same group order: a row's bits do
// not depend on which path ran its block. Below ~8 rows the tiles' fixed cost per group (stores,
// unpacking the 4-bit codes) outweighs the products, so those blocks keep the VNNI loop.
#include <sys/syscall.h>
#include <unistd.h>

#define RB 16          // rows of an AMX block: a tile's height
#define AMX_MIN 12     // blocks of fewer rows run the VNNI loop
#define AMX_GROUP 256  // the largest group AMX takes (two groups' unpacked codes on the stack)
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

// The shape this thread's tiles are configured for (0 rows: not configured).
typedef struct {
    int rows, kstep;
} amx_state;

// Linux gives a process AMX's 8 KB of tile state only on request (-1: not asked yet).
static int amx_permitted = -1;

static int amx_usable(long rows) {
    if (rows < AMX_MIN) return 0;
    if (amx_permitted < 0) amx_permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_permitted;
}

// Tiles: A, the rows' high and low code bytes (kstep inputs), in tmm0 and tmm1; B (4 inputs of 16
// outputs a row) in tmm2 for even groups, tmm3 for odd ones; C (int32 [rows, 16 outputs], high and
// low) in tmm4 and tmm5 for even groups, tmm6 and tmm7 for odd ones.
static void amx_configure(amx_state *state, int rows, int kstep) {
    if (state->rows == rows && state->kstep == kstep) return;
    tile_config c = {.palette = 1};
    for (int t = 0; t < 2; t++) c.rows[t] = rows, c.colsb[t] = kstep;
    for (int t = 2; t < 4; t++) c.rows[t] = kstep / 4, c.colsb[t] = 64;
    for (int t = 4; t < 8; t++) c.rows[t] = rows, c.colsb[t] = 64;
    _tile_loadconfig(&c);
    state->rows = rows, state->kstep = kstep;
}

static void amx_done(amx_state *state) {
    if (state->rows) _tile_release();
}

// A group's 4-bit codes of one tile unpacked to a byte a code in B's rows (int8 codes are B's rows as
// they are): low nibbles of chunk c are inputs 8c..8c+3, high nibbles 8c+4..8c+7.
static inline __attribute__((always_inline)) void unpack_group(const uint8_t *wg, int group, uint8_t *buf) {
    for (int c = 0; c < group / 8; c++) {
        __m512i b = _mm512_loadu_si512(wg + c * 64);
        _mm512_store_si512(buf + 2 * c * 64, low_nibbles(b));
        _mm512_store_si512(buf + (2 * c + 1) * 64, high_nibbles(b));
    }
}

// Group g's exact sums (stored from its C tiles) added to the rows' outputs acc.
static inline __attribute__((always_inline)) void amx_epilogue(int R, int bits, int g, int groups,
                                                               const int32_t *dh, const int32_t *dl,
                                                               const acts *a, long m0, const _Float16 *sz,
                                                               __m512 *acc) {
    __m512 s, z;
    scale_min(sz, g, &s, &z);
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
        const long at = (m0 + r) * groups + g;
        acc[r] = group_out(bits, s, z, _mm512_load_si512(dh + r * L), _mm512_load_si512(dl + r * L), a->sums[at],
                           a->step[at], acc[r]);
    }
}

// Group g: its products issued into C tiles ch, cl; the previous group's C tiles (ph, pl) stored; the
// outputs of the group before that added. A tile load does not take data from pending stores, nor a
// vector load from a tile store, so each step reads stores one group old: the unpacked codes of g + 1
// are written now and read at the next group.
#define AMX_STEP(g, tb, ch, cl, ph, pl)                                                                  \
    do {                                                                                                 \
        const uint8_t *b = bits == 8 ? w + (long)(g) * per_group : buf[(g) % 2];                         \
        prefetch_group(w + (long)((g) + AHEAD) * per_group, per_group);                                  \
        _tile_zero(ch);                                                                                  \
        _tile_zero(cl);                                                                                  \
        for (int k0 = 0; k0 < group; k0 += kstep) {                                                      \
            _tile_loadd(0, a->h + m0 * K + (long)(g) * group + k0, K);                                   \
            _tile_loadd(1, a->l + m0 * K + (long)(g) * group + k0, K);                                   \
            _tile_loadd(tb, b + k0 * L, 64);                                                             \
            _tile_dpbsud(ch, 0, tb);                                                                     \
            _tile_dpbsud(cl, 1, tb);                                                                     \
        }                                                                                                \
        if (bits == 4 && (g) + 1 < groups)                                                               \
            unpack_group(w + (long)((g) + 1) * per_group, group, buf[((g) + 1) % 2]);                    \
        if ((g) >= 1) {                                                                                  \
            _tile_stored(ph, dots[((g) - 1) % 3][0], 64);                                                \
            _tile_stored(pl, dots[((g) - 1) % 3][1], 64);                                                \
        }                                                                                                \
        if ((g) >= 2) {                                                                                  \
            int32_t(*d)[RB * L] = dots[((g) - 2) % 3];                                                   \
            amx_epilogue(R, bits, (g) - 2, groups, d[0], d[1], a, m0, sz, acc);                          \
        }                                                                                                \
    } while (0)

// R rows (AMX_MIN..RB, from row m0) by one tile of L outputs.
static inline __attribute__((always_inline)) void amx_tile_rows(amx_state *state, int R, int bits, int groups,
                                                                int group, const acts *a, long m0, long K,
                                                                const uint8_t *w, const _Float16 *sz, float *y,
                                                                long ldy) {
    const int kstep = group % 64 == 0 ? 64 : group % 32 == 0 ? 32 : 16;
    const long per_group = (long)group * L * bits / 8;
    amx_configure(state, R, kstep);
    _Alignas(64) uint8_t buf[2][AMX_GROUP * L];
    _Alignas(64) int32_t dots[3][2][RB * L];
    __m512 acc[RB];
#pragma GCC unroll 16
    for (int r = 0; r < RB; r++) acc[r] = _mm512_setzero_ps();
    if (bits == 4) unpack_group(w, group, buf[0]);
    for (int g = 0; g < groups; g += 2) {
        AMX_STEP(g, 2, 4, 5, 6, 7);
        if (g + 1 < groups) AMX_STEP(g + 1, 3, 6, 7, 4, 5);
    }
    const int last = groups - 1;
    if (last % 2 == 0) {
        _tile_stored(4, dots[last % 3][0], 64);
        _tile_stored(5, dots[last % 3][1], 64);
    } else {
        _tile_stored(6, dots[last % 3][0], 64);
        _tile_stored(7, dots[last % 3][1], 64);
    }
    if (last >= 1) amx_epilogue(R, bits, last - 1, groups, dots[(last - 1) % 3][0], dots[(last - 1) % 3][1], a, m0,
                                sz, acc);
    amx_epilogue(R, bits, last, groups, dots[last % 3][0], dots[last % 3][1], a, m0, sz, acc);
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

// Instantiated for full tiles of 16 rows, whose sums stay in registers, and for the rest.
static void amx_tile(amx_state *state, int R, int bits, int groups, int group, const acts *a, long m0, long K,
                     const uint8_t *w, const _Float16 *sz, float *y, long ldy) {
    if (R == RB && bits == 4)
        amx_tile_rows(state, RB, 4, groups, group, a, m0, K, w, sz, y, ldy);
    else if (R == RB)
        amx_tile_rows(state, RB, 8, groups, group, a, m0, K, w, sz, y, ldy);
    else
        amx_tile_rows(state, R, bits, groups, group, a, m0, K, w, sz, y, ldy);
}

// R rows by T tiles on AMX, or 0 where AMX does not serve them.
static int amx_rows(amx_state *state, int R, int T, int bits, int groups, int group, const acts *a, long m0,
                    long K, const uint8_t *w, long tile_bytes, const _Float16 *sz, long tile_sz, float *y,
                    long ldy) {
    if (!amx_usable(R) || group > AMX_GROUP) return 0;
    for (int t = 0; t < T; t++)
        amx_tile(state, R, bits, groups, group, a, m0, K, w + t * tile_bytes, sz + t * tile_sz, y + t * L, ldy);
    return 1;
}
