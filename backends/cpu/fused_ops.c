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
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NOFMA __attribute__((optimize("fp-contract=off")))
// Row counts below this run on the calling thread: a parallel region costs more than the rows.
#define PARALLEL_ROWS 64

// sum_i a[i] b[i] in 16 lanes (lane i % 16), then the lanes pairwise (l + 8, l + 4, l + 2, l + 1): one
// order whatever the pointers' alignment (a compiler's own vector reduction may peel to align, which
// would make a row's sum depend on where its data sits, i.e. on the batch), and four steps of adds
// rather than 15 dependent ones (at 16 rows, attention computes ~400,000 dot products a step). The
// AVX-512 form is the same sums (a masked tail adds +0 to the lanes the C form leaves alone).
static inline float NOFMA dot(const float *a, const float *b, long n) {
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    long i = 0;
    for (; i + 16 <= n; i += 16)
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
    if (i < n) {
        const __mmask16 tail = (__mmask16)((1u << (n - i)) - 1);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, a + i), _mm512_maskz_loadu_ps(tail, b + i)));
    }
    const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(acc),
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
    __m128 quarters = _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
    quarters = _mm_add_ps(quarters, _mm_movehl_ps(quarters, quarters));
    return _mm_cvtss_f32(_mm_add_ss(quarters, _mm_movehdup_ps(quarters)));
#else
    float lanes[16] = {0};
    long i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) lanes[l] += a[i + l] * b[i + l];
    for (; i < n; i++) lanes[i % 16] += a[i] * b[i];
    for (int width = 8; width > 0; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    return lanes[0];
#endif
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

// ---- Paged attention over an fp32 or fp16 cache ----

// fp16 <-> fp32 by their bits (the F16C instructions below where the CPU has them): fp16 -> fp32 is
// exact, fp32 -> fp16 rounds to nearest even, as vcvtps2ph does, so every path gives the same bits.
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0) {  // zero or subnormal: man * 2^-24, exact
        const float f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (exp == 31 ? 0x7f800000 | man << 13 : (exp + 112) << 23 | man << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (x >> 16) & 0x8000;
    x &= 0x7fffffff;
    if (x > 0x7f800000) return sign | 0x7e00;                 // NaN
    if (x >= 0x47800000) return sign | 0x7c00;                // >= 65536 (and inf): inf
    if (x < 0x38800000) {                                     // below 2^-14: a subnormal's count of 2^-24
        float a;
        memcpy(&a, &x, sizeof a);
        return sign | (uint16_t)nearbyintf(a * 16777216.0f);
    }
    return sign | (uint16_t)((x + 0xfff + ((x >> 13) & 1) - 0x38000000) >> 13);  // 65520 and up carry to inf
}

static inline void widen(const uint16_t *restrict h, float *restrict f, long n) {
    long i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(f + i, _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(h + i))));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const void *)(h + i))));
#endif
    for (; i < n; i++) f[i] = half_to_float(h[i]);
}

static void narrow(const float *restrict f, uint16_t *restrict h, long n) {
    long i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((void *)(h + i), _mm512_cvtps_ph(_mm512_loadu_ps(f + i), _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((void *)(h + i), _mm256_cvtps_ph(_mm256_loadu_ps(f + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++) h[i] = float_to_half(f[i]);
}

// Where a sequence's keys [first, len) of KV head kvh sit in the cache [2, slots, Hk, D]: key j is slot
// table[j / bs] * bs + j % bs. Taken block by block (a division per key was a third of attention's time).
static void key_offsets(const int32_t *table, int bs, int Hk, int kvh, int D, long first, long len, long *at) {
    long block = first / bs, in_block = first % bs;
    for (long j = 0; j < len - first; j++) {
        at[j] = (((long)table[block] * bs + in_block) * Hk + kvh) * D;
        if (++in_block == bs) in_block = 0, block++;
    }
}

// One work item's view of a layer's cache of fp32 or fp16 (`half`) numbers: its keys' rows at[j], each
// key's value row `values` numbers further.
typedef struct {
    const void *cache;
    const long *at;
    long values;
    int D, half;
    int width;  // numbers read at at[j]: the D of each KV head the item's query heads use, adjacent
} kv_rows;

// `width` numbers from `offset` as fp32: in the cache itself, or widened into buf from fp16.
static inline const float *kv_row(const kv_rows *c, long offset, float *buf) {
    if (!c->half) return (const float *)c->cache + offset;
    widen((const uint16_t *)c->cache + offset, buf, c->width);
    return buf;
}

// Keys ahead of the one being scored whose key and value rows are fetched now: at 16 sequences the
// cache is tens of MB, so each row would otherwise be a wait on memory, twice (scores, then values).
#define ROWS_AHEAD 8

// always_inline: gcc finds a function of prefetches alone "pure" and drops the calls it does not inline.
static inline __attribute__((always_inline)) void prefetch_rows(const kv_rows *c, long offset) {
    const int size = c->half ? 2 : 4;
    const char *key = (const char *)c->cache + offset * size, *value = key + c->values * size;
    for (int i = 0; i < c->width * size; i += 64) {
        __builtin_prefetch(key + i);
        __builtin_prefetch(value + i);
    }
}

#if defined(__AVX512F__)
// 16 numbers of the cache from `offset` as fp32.
static inline __m512 load16(const kv_rows *c, long offset) {
    if (c->half) return _mm512_cvtph_ps(_mm256_loadu_si256((const void *)((const uint16_t *)c->cache + offset)));
    return _mm512_loadu_ps((const float *)c->cache + offset);
}
#endif

// out (n heads, D apart) = sum_j scores[h * L + j] V_j (head h reading KV head h / G of the item's),
// each number's sum over the keys in order. With AVX-512, 16 numbers of up to 4 heads of a KV head at
// a time in registers over all the keys: summed in memory, each key's sums waited on the previous
// key's stores (the same sums either way).
static void NOFMA weigh_values(const kv_rows *c, int n, int G, long L, const float *scores, float *buf, float *out) {
    const int D = c->D;
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        for (int h0 = 0, heads; h0 < n; h0 += heads) {
            heads = n - h0 < 4 ? n - h0 : 4;
            heads = heads < G - h0 % G ? heads : G - h0 % G;  // within one KV head
            const long part = c->values + (long)(h0 / G) * D;
            for (int i = 0; i < D; i += 16) {
                __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
                for (long j = 0; j < L; j++) {
                    const __m512 v = load16(c, c->at[j] + part + i);
                    for (int h = 0; h < heads; h++)
                        acc[h] = _mm512_add_ps(acc[h], _mm512_mul_ps(_mm512_set1_ps(scores[(h0 + h) * L + j]), v));
                }
                for (int h = 0; h < heads; h++) _mm512_storeu_ps(out + (h0 + h) * D + i, acc[h]);
            }
        }
        return;
    }
#endif
    for (long i = 0; i < n * D; i++) out[i] = 0.0f;
    for (long j = 0; j < L; j++) {
        const float *restrict value = kv_row(c, c->at[j] + c->values, buf);
        for (int h = 0; h < n; h++) {
            const float p = scores[h * L + j];
            float *restrict o = out + h * D;
            const float *restrict vh = value + (h / G) * D;
            for (int i = 0; i < D; i++) o[i] += p * vh[i];
        }
    }
}

// n query heads of one row (q and out: heads D apart), head h reading KV head h / G of c's rows, over
// the row's L keys: each head's softmax(scale q.K) V, keys in position order. Each K and V row is read
// (and widened) once for the n heads; a head's numbers come from the same operations whatever n is.
// scores: n * L floats; buf: c->width.
static void NOFMA attend_heads(const float *q, int n, int G, const kv_rows *c, long L, float scale, float *scores,
                               float *buf, float *out) {
    const int D = c->D;
    for (long j = 0; j < L; j++) {
        if (j + ROWS_AHEAD < L) prefetch_rows(c, c->at[j + ROWS_AHEAD]);
        const float *key = kv_row(c, c->at[j], buf);
        for (int h = 0; h < n; h++) scores[h * L + j] = dot(q + h * D, key + (h / G) * D, D) * scale;
    }
    for (int h = 0; h < n; h++) {
        float *s = scores + h * L, top = -INFINITY;
        for (long j = 0; j < L; j++) top = s[j] > top ? s[j] : top;
        for (long j = 0; j < L; j++) s[j] = exp_poly(s[j] - top);
    }
    weigh_values(c, n, G, L, scores, buf, out);
    for (int h = 0; h < n; h++) {
        float total = 0.0f;
        for (long j = 0; j < L; j++) total += scores[h * L + j];
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;  // no keys (a padding row): zeros
        for (int i = 0; i < D; i++) out[h * D + i] *= inv;
    }
}

// Paged causal attention for T packed query rows: writes the rows' new keys and values k, v
// [T, Hk * D] into the cache [2, slots, Hk, D] (fp16 where `half`, else fp32) at `slot_mapping` (-1: a
// padding row, not written), then each query head of row t of q [T, Hq * D] attends over positions
// [first, ends[t]) of sequence seqs[t] (first = ends[t] - window where a window is set, else 0). Every
// row, decode or prefill, alone or batched, goes through the same `attend_heads`: a prompt's last row
// computed in a decode step after a prefix-cache hit equals that row computed in the whole prompt's
// prefill.
void paged_attention(long T, int Hq, int Hk, int D, const float *q, long ldq, const float *k, long ldk,
                     const float *v, long ldv, void *cache, int half, long slots, const int64_t *slot_mapping,
                     const int32_t *tables, long ldt, int bs, const int64_t *seqs, const int64_t *ends, long window,
                     float scale, float *out, int threads) {
    const long values = slots * Hk * D, kv = (long)Hk * D;
    long most = 0;
    for (long t = 0; t < T; t++) most = ends[t] > most ? ends[t] : most;
    for (long t = 0; t < T; t++) {
        if (slot_mapping[t] < 0) continue;
        const long at = slot_mapping[t] * kv;
        if (half) {
            narrow(k + t * ldk, (uint16_t *)cache + at, kv);
            narrow(v + t * ldv, (uint16_t *)cache + values + at, kv);
        } else {
            memcpy((float *)cache + at, k + t * ldk, sizeof(float) * kv);
            memcpy((float *)cache + values + at, v + t * ldv, sizeof(float) * kv);
        }
    }
    // A work item: all of a row's query heads (one pass over its keys' whole cache rows), or, where
    // rows are too few to share out among the threads so, one query head (a long batch-1 decode).
    const int parallel = threads > 1 && T * Hq * most >= 4096, group = Hq / Hk;
    const int n = !parallel || T >= 2 * threads ? Hq : 1;
#pragma omp parallel num_threads(threads) if (parallel)
    {
        float *scores = malloc(sizeof *scores * (n * most + kv + 1));
        long *at = malloc(sizeof *at * (most + 1));
#pragma omp for schedule(static)
        for (long i = 0; i < T * Hq / n; i++) {
            const long t = i / (Hq / n), end = ends[t];
            const int h = (int)(i % (Hq / n)) * n;
            const long first = window > 0 && end > window ? end - window : 0;
            key_offsets(tables + seqs[t] * ldt, bs, Hk, h / group, D, first, end, at);
            const kv_rows c = {cache, at, values, D, half, n == 1 ? D : (int)kv};
            attend_heads(q + t * ldq + (long)h * D, n, group, &c, end - first, scale, scores, scores + n * most,
                         out + t * (long)Hq * D + (long)h * D);
        }
        free(scores);
        free(at);
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
// MLP's output; the layer's cache holds `cache_size` numbers, fp16 where `half`. Each step is the function the module
// path's layer kernels call, so the two agree bitwise.
void decoder_layer(const layer_plan *L, const step_plan *s, void *cache, long cache_size, int half,
                   const float *hidden, float *residual, int first, float *out) {
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
    paged_attention(T, L->hq, L->hk, L->d, qkv, ld, qkv + q, ld, qkv + q + kv, ld, cache, half, slots, s->slot_mapping,
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
