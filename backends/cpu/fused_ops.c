// Fused fp32 operators of a decoder layer on CPUs, one ctypes call each (fused_ops.py loads them).
//
// Why: at batch 1 a SmolLM2 layer's GEMMs are ~40 us, and the torch code around them was ~45 small
// operators (RMSNorm as pow/mean/add/rsqrt/mul/mul, rotary as index/neg/cat/mul/add per q and k,
// SiLU and mul, attention's cache writes, gather and SDPA), each a few microseconds of dispatch,
// some an OpenMP parallel region. Here each family is one call.
//
// Every output row is computed by one fixed sequence of operations that reads only that row (and,
// for attention, that sequence's own context): a request's tokens do not depend on what else is in
// the batch, nor on the thread count. Rotary and SiLU * up round every product and sum as torch's
// expressions do (no contraction into FMAs), so rotary is bitwise torch's; RMSNorm sums the squares
// in another order than torch's mean, and SiLU's and softmax's exp is a polynomial (a few ulps).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NOFMA __attribute__((optimize("fp-contract=off")))
// Row counts below this run on the calling thread: a parallel region costs more than the rows.
#define PARALLEL_ROWS 64

// sum_i a[i] b[i] in 16 lanes (lane i % 16), then the lanes in order: one order whatever the
// pointers' alignment (a compiler's own vector reduction may peel to align, which would make a row's
// sum depend on where its data sits, i.e. on the batch).
static inline float dot(const float *a, const float *b, long n) {
    float lanes[16] = {0};
    long i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) lanes[l] += a[i + l] * b[i + l];
    for (; i < n; i++) lanes[i % 16] += a[i] * b[i];
    float total = 0.0f;
    for (int l = 0; l < 16; l++) total += lanes[l];
    return total;
}

// e^x within ~2 ulp (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, 2^n from the exponent
// bits), arithmetic only so that loops of it vectorize: libm's expf is a call per element, and at 16
// rows SiLU's and attention's calls were ~7% of a decode step. x is clamped to [-87, 88] (e^-87 instead
// of 0 below: a weight of 1e-38 in a softmax, a SiLU of -0). Its own products and sums are rounded
// one by one (NOFMA at every caller), so a vector lane and the scalar tail give the same bits.
static inline __attribute__((always_inline)) float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    const float shifted = x * 1.44269504089f + 12582912.0f;  // 1.5 * 2^23: n = round(x / ln2) in the low bits
    const float n = shifted - 12582912.0f;
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits;
    memcpy(&bits, &shifted, sizeof bits);
    const int32_t scale_bits = (bits - 0x4B400000 + 127) << 23;  // 2^n
    float scale;
    memcpy(&scale, &scale_bits, sizeof scale);
    return p * scale;
}

// out = w * (s * 1/sqrt(mean(s^2) + eps)) with s = x (+ r); with r, s is also written to sum.
void NOFMA rms_norm(long T, long N, const float *x, long ldx, const float *r, long ldr, const float *w,
                    float eps, float *out, float *sum, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T >= PARALLEL_ROWS)
    for (long t = 0; t < T; t++) {
        const float *xt = x + t * ldx;
        float *s = r ? sum + t * N : (float *)xt;
        if (r)
            for (long i = 0; i < N; i++) s[i] = xt[i] + r[t * ldr + i];
        const float inv = 1.0f / sqrtf(dot(s, s, N) / (float)N + eps);
        float *o = out + t * N;
        for (long i = 0; i < N; i++) o[i] = w[i] * (s[i] * inv);
    }
}

// out [T, I] = silu(gate) * up of x [T, 2I] (gate first), silu(g) = g / (1 + exp(-g)).
void NOFMA silu_and_mul(long T, long I, const float *x, long ldx, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T >= PARALLEL_ROWS)
    for (long t = 0; t < T; t++) {
        const float *g = x + t * ldx, *u = g + I;
        float *o = out + t * I;
        for (long i = 0; i < I; i++) o[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
    }
}

// One head in place: x cos + rotate_half(x) sin, rotate_half(x) = (-x[h:], x[:h]).
static inline void NOFMA rotate(float *x, const float *c, const float *s, int D) {
    const int h = D / 2;
    for (int i = 0; i < h; i++) {
        const float a = x[i], b = x[i + h];
        x[i] = a * c[i] + -b * s[i];
        x[i + h] = b * c[i + h] + a * s[i + h];
    }
}

// q [T, Hq, D] and k [T, Hk, D] (tokens ldq / ldk apart, heads hq / hk apart, features adjacent)
// rotated in place by the rows `positions` of the cos and sin tables [P, D].
void NOFMA rotary(long T, int Hq, int Hk, int D, const int64_t *positions, float *q, long ldq, long hq, float *k,
                  long ldk, long hk, const float *cos, const float *sin, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (T >= PARALLEL_ROWS)
    for (long t = 0; t < T; t++) {
        const float *c = cos + positions[t] * D, *s = sin + positions[t] * D;
        for (int h = 0; h < Hq; h++) rotate(q + t * ldq + h * hq, c, s, D);
        for (int h = 0; h < Hk; h++) rotate(k + t * ldk + h * hk, c, s, D);
    }
}

// One query head of one row over its sequence's keys [first, len): softmax(scale q.K) V,
// keys in position order. Rows of the cache: slot * Hk + kv head, keys then values (`values` apart).
// Keys ahead of the one being scored whose key and value rows are fetched now: at 16 sequences the
// cache is tens of MB, so each row would otherwise be a wait on memory, twice (scores, then values).
#define ROWS_AHEAD 4

static inline void prefetch_row(const float *row, int D) {
    for (int i = 0; i < D; i += 16) __builtin_prefetch(row + i);
}

static void NOFMA attend_row(const float *q, int D, int Hk, int kvh, const int32_t *table, int bs, long first,
                             long len, const float *cache, long values, float scale, float *scores, float *out) {
    float top = -INFINITY;
    for (long j = first; j < len; j++) {
        if (j + ROWS_AHEAD < len) {
            const long ahead = j + ROWS_AHEAD, row = ((long)table[ahead / bs] * bs + ahead % bs) * Hk + kvh;
            prefetch_row(cache + row * D, D);
            prefetch_row(cache + values + row * D, D);
        }
        const long row = ((long)table[j / bs] * bs + j % bs) * Hk + kvh;
        const float *key = cache + row * D;
        scores[j - first] = dot(q, key, D) * scale;
        top = scores[j - first] > top ? scores[j - first] : top;
    }
    for (long j = 0; j < len - first; j++) scores[j] = exp_poly(scores[j] - top);
    float total = 0.0f;
    for (int i = 0; i < D; i++) out[i] = 0.0f;
    for (long j = first; j < len; j++) {
        const float p = scores[j - first];
        total += p;
        const float *value = cache + values + (((long)table[j / bs] * bs + j % bs) * Hk + kvh) * D;
        for (int i = 0; i < D; i++) out[i] += p * value[i];
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;  // no keys (a padding row): zeros
    for (int i = 0; i < D; i++) out[i] *= inv;
}

// Paged causal attention for T packed query rows: writes the rows' new keys and values k, v
// [T, Hk * D] into the cache [2, slots, Hk, D] at `slot_mapping` (-1: a padding row, not written),
// then each query head of row t of q [T, Hq * D] attends over positions [first, ends[t]) of sequence
// seqs[t] (first = ends[t] - window where a window is set, else 0). Every row, decode or prefill, alone
// or batched, goes through the same `attend_row`: a prompt's last row computed in a decode step after
// a prefix-cache hit equals that row computed in the whole prompt's prefill.
void paged_attention(long T, int Hq, int Hk, int D, const float *q, long ldq, const float *k, long ldk,
                     const float *v, long ldv, float *cache, long slots, const int64_t *slot_mapping,
                     const int32_t *tables, long ldt, int bs, const int64_t *seqs, const int64_t *ends, long window,
                     float scale, float *out, int threads) {
    const long values = slots * Hk * D, kv = (long)Hk * D;
    long most = 0;
    for (long t = 0; t < T; t++) most = ends[t] > most ? ends[t] : most;
    for (long t = 0; t < T; t++)
        for (long i = 0; i < kv && slot_mapping[t] >= 0; i++) {
            cache[slot_mapping[t] * kv + i] = k[t * ldk + i];
            cache[values + slot_mapping[t] * kv + i] = v[t * ldv + i];
        }
#pragma omp parallel num_threads(threads) if (T * Hq * most >= 4096)
    {
        float *scores = malloc(sizeof *scores * (most > 0 ? most : 1));
#pragma omp for schedule(static)
        for (long i = 0; i < T * Hq; i++) {
            const long t = i / Hq, end = ends[t];
            const int h = (int)(i % Hq);
            const long first = window > 0 && end > window ? end - window : 0;
            attend_row(q + t * ldq + (long)h * D, D, Hk, h / (Hq / Hk), tables + seqs[t] * ldt, bs, first, end,
                       cache, values, scale, scores, out + t * (long)Hq * D + (long)h * D);
        }
        free(scores);
    }
}

// ---- A whole Llama-family decoder layer in one call (fused_layer.py builds the arguments once) ----

// The grouped int4 GEMM of corectl.quantization.int4_cpu (its own library, passed as a pointer).
typedef void (*gemm_fn)(int bits, long M, long N, long K, int group, const float *x, long ldx, const uint8_t *w,
                        const void *sz, float *y, int threads);

typedef struct {
    const uint8_t *w;
    const void *sz;
    long n, k;
    int group;
} projection;

typedef struct {
    projection qkv, o, gate_up, down;
    const float *norm1, *norm2, *cos, *sin;
    float eps1, eps2, scale;
    int hq, hk, d;
    long window;
} layer_plan;

typedef struct {
    long T;
    const int64_t *positions, *slot_mapping, *seqs, *ends;
    const int32_t *tables;
    long ldt;
    int bs, threads;
    gemm_fn gemm;
} step_plan;

static void project(const step_plan *s, const projection *p, const float *x, float *y) {
    s->gemm(4, s->T, p->n, p->k, p->group, x, p->k, p->w, p->sz, y, s->threads);
}

// DecoderLayer.forward (corectl.models.llama) by the kernels above: residual (in/out, [T, N]) becomes
// hidden + residual (hidden itself where `first`: the first layer has no residual yet), out [T, N] the
// MLP's output; the layer's cache holds `cache_size` floats. Each step is the function the module
// path's layer kernels call, so the two agree bitwise.
void decoder_layer(const layer_plan *L, const step_plan *s, float *cache, long cache_size, const float *hidden,
                   float *residual, int first, float *out) {
    const long T = s->T, N = L->o.n, q = (long)L->hq * L->d, kv = (long)L->hk * L->d, inter = L->down.k;
    const long slots = cache_size / (2 * kv);
    float *xn = malloc(sizeof(float) * T * N), *qkv = malloc(sizeof(float) * T * L->qkv.n);
    float *att = malloc(sizeof(float) * T * q), *gate_up = malloc(sizeof(float) * T * L->gate_up.n);
    float *act = malloc(sizeof(float) * T * inter);
    if (first) {
        for (long i = 0; i < T * N; i++) residual[i] = hidden[i];
        rms_norm(T, N, hidden, N, NULL, 0, L->norm1, L->eps1, xn, NULL, s->threads);
    } else {
        rms_norm(T, N, hidden, N, residual, N, L->norm1, L->eps1, xn, residual, s->threads);
    }
    project(s, &L->qkv, xn, qkv);
    const long ld = L->qkv.n;
    rotary(T, L->hq, L->hk, L->d, s->positions, qkv, ld, L->d, qkv + q, ld, L->d, L->cos, L->sin, s->threads);
    paged_attention(T, L->hq, L->hk, L->d, qkv, ld, qkv + q, ld, qkv + q + kv, ld, cache, slots, s->slot_mapping,
                    s->tables, s->ldt, s->bs, s->seqs, s->ends, L->window, L->scale, att, s->threads);
    project(s, &L->o, att, out);
    rms_norm(T, N, out, N, residual, N, L->norm2, L->eps2, xn, residual, s->threads);
    project(s, &L->gate_up, xn, gate_up);
    silu_and_mul(T, inter, gate_up, L->gate_up.n, act, s->threads);
    project(s, &L->down, act, out);
    free(xn);
    free(qkv);
    free(att);
    free(gate_up);
    free(act);
}
