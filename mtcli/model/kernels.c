/* The attention of one incremental decoding step, and the search's statistics of its logits,
 * fused (see kernels.py).
 *
 * A decoding step on a CPU runs a few hundred torch operations on tensors of a few kilobytes;
 * each costs microseconds of dispatch whatever its size, and at bf16 the attention's batched
 * matrix products are slower still. These functions do a step's self-attention, its
 * encoder-decoder attention, and each row's chunk maxima and log Z, in one call each, on the
 * tensors' memory, with fp32 arithmetic.
 *
 * Element types: fp32 (dtype 0) or bf16 (dtype 1, the upper half of an fp32; stored rounded
 * to nearest even). Scores, softmax and sums are fp32 in both cases.
 *
 * Rows (sentences) are shared out over `threads` OpenMP threads when there is enough work
 * (compiled with -fopenmp, the library uses the OpenMP runtime torch already loaded, so these
 * are torch's own threads); without OpenMP the pragmas are ignored and one thread does it all.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* multiply-adds below which a call stays on one thread (a fork/join costs a few microseconds) */
#define PARALLEL_WORK 32768L

typedef uint16_t bf16;

static inline float bf16_to_float(bf16 x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

static inline bf16 float_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (bf16)((v.u >> 16) | 0x40u); /* quiet NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (bf16)(v.u >> 16);
}

/* x[0..n) of element type dtype, as floats into out */
static inline void load(const void* x, int dtype, int n, float* out) {
    if (dtype == 0) {
        memcpy(out, x, sizeof(float) * (size_t)n);
    } else {
        const bf16* b = (const bf16*)x;
#pragma omp simd
        for (int i = 0; i < n; i++) out[i] = bf16_to_float(b[i]);
    }
}

static inline void store(const float* x, int dtype, int n, void* out) {
    if (dtype == 0) {
        memcpy(out, x, sizeof(float) * (size_t)n);
    } else {
        bf16* b = (bf16*)out;
        for (int i = 0; i < n; i++) b[i] = float_to_bf16(x[i]);
    }
}

/* q . k for k of element type dtype */
static inline float dot(const float* q, const void* k, int dtype, int n) {
    float s = 0.0f;
    if (dtype == 0) {
        const float* f = (const float*)k;
#pragma omp simd reduction(+ : s)
        for (int i = 0; i < n; i++) s += q[i] * f[i];
    } else {
        const bf16* b = (const bf16*)k;
#pragma omp simd reduction(+ : s)
        for (int i = 0; i < n; i++) s += q[i] * bf16_to_float(b[i]);
    }
    return s;
}

/* acc += p * v for v of element type dtype */
static inline void axpy(float p, const void* v, int dtype, float* acc, int n) {
    if (dtype == 0) {
        const float* f = (const float*)v;
#pragma omp simd
        for (int i = 0; i < n; i++) acc[i] += p * f[i];
    } else {
        const bf16* b = (const bf16*)v;
#pragma omp simd
        for (int i = 0; i < n; i++) acc[i] += p * bf16_to_float(b[i]);
    }
}

/* e^x for x <= 0 (a softmax's shifted scores), in a form the compiler vectorizes: x = n ln2 + r
 * with |r| <= ln2 / 2 (ln2 in two parts, Cody and Waite), e^r by Cephes' expf polynomial
 * (relative error about 1e-7), times 2^n built in the exponent bits; 0 below -87 (and at -inf,
 * a masked key), where e^x is under float's normal range anyway. */
static inline float exp_nonpositive(float x) {
    const float c = x < -87.0f ? -87.0f : x;
    const float n = floorf(c * 1.44269504088896341f + 0.5f);
    const float r = c - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof(scale));
    return x < -87.0f ? 0.0f : p * scale;
}

static inline void softmax(float* s, int n) {
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
#pragma omp simd
    for (int t = 0; t < n; t++) s[t] = exp_nonpositive(s[t] - m);
    float z = 0.0f;
#pragma omp simd reduction(+ : z)
    for (int t = 0; t < n; t++) z += s[t];
    const float inv = 1.0f / z;
#pragma omp simd
    for (int t = 0; t < n; t++) s[t] *= inv;
}

/* softmax(q K^T * scale + mask) V for one query q (fp32, dk) over n keys/values at byte
 * strides kstride/vstride from k/v; the result, dk values, into out (element type dtype). */
static void attend(const float* q, const char* k, const char* v, long kstride, long vstride,
                   const float* mask, int n, int dk, int dtype, float scale, void* out) {
    float scores[n], acc[dk];
    for (int t = 0; t < n; t++) scores[t] = scale * dot(q, k + t * kstride, dtype, dk);
    if (mask)
        for (int t = 0; t < n; t++) scores[t] += mask[t];
    softmax(scores, n);
    memset(acc, 0, sizeof(acc));
    for (int t = 0; t < n; t++) axpy(scores[t], v + t * vstride, dtype, acc, dk);
    store(acc, dtype, dk, out);
}

/* Causal self-attention for the newest position of n rows.
 * qkv [n, 3, h, dk]: each row's query, key and value. The key and value are written at time
 * `length` of the time-major caches [max_len, >= n, h, dk] (time stride `time_stride`
 * elements, rows contiguous within a time); the query attends to times 0..length.
 * out [n, h * dk]. Each time's keys (and values) of all heads are one contiguous row, read once
 * for every head. */
void self_attention_step(const void* qkv, void* cache_k, void* cache_v, long time_stride, int length,
                         int n, int h, int dk, int dtype, float scale, void* out, int threads) {
    const int d = h * dk, times = length + 1;
    const size_t size = dtype == 0 ? 4 : 2;
    const long tstride = time_stride * (long)size;
#pragma omp parallel for num_threads(threads) schedule(static) if ((long)n * times * d > PARALLEL_WORK)
    for (int r = 0; r < n; r++) {
        const char* row = (const char*)qkv + (size_t)r * 3 * d * size;
        char* k = (char*)cache_k + (size_t)r * d * size;
        char* v = (char*)cache_v + (size_t)r * d * size;
        memcpy(k + length * tstride, row + d * size, d * size);
        memcpy(v + length * tstride, row + 2 * d * size, d * size);
        float q[d], acc[d], scores[h][times];
        load(row, dtype, d, q);
        for (int t = 0; t < times; t++)
            for (int j = 0; j < h; j++)
                scores[j][t] = scale * dot(q + j * dk, k + t * tstride + j * dk * size, dtype, dk);
        for (int j = 0; j < h; j++) softmax(scores[j], times);
        memset(acc, 0, sizeof(acc));
        for (int t = 0; t < times; t++)
            for (int j = 0; j < h; j++)
                axpy(scores[j][t], v + t * tstride + j * dk * size, dtype, acc + j * dk, dk);
        store(acc, dtype, d, (char*)out + (size_t)r * d * size);
    }
}

/* Encoder-decoder attention for one step: `group` queries per sentence.
 * q [sentences * group, h * dk]; k, v [sentences, h, S, dk] (sentence stride `sentence_stride`
 * elements, contiguous within); mask [sentences, S] additive fp32 or NULL;
 * out [sentences * group, h * dk]. */
void cross_attention_step(const void* q, const void* k, const void* v, long sentence_stride, int S,
                          const float* mask, int sentences, int group, int h, int dk, int dtype,
                          float scale, void* out, int threads) {
    const int d = h * dk;
    const size_t size = dtype == 0 ? 4 : 2;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) \
    if ((long)sentences * group * S * d > PARALLEL_WORK)
    for (int s = 0; s < sentences; s++) {
        for (int j = 0; j < h; j++) {
            const char* ks = (const char*)k + ((size_t)s * sentence_stride + (size_t)j * S * dk) * size;
            const char* vs = (const char*)v + ((size_t)s * sentence_stride + (size_t)j * S * dk) * size;
            for (int b = 0; b < group; b++) {
                const size_t at = ((size_t)s * group + b) * d + (size_t)j * dk;
                float qf[dk];
                load((const char*)q + at * size, dtype, dk, qf);
                attend(qf, ks, vs, dk * size, dk * size, mask ? mask + (size_t)s * S : NULL, S, dk,
                       dtype, scale, (char*)out + at * size);
            }
        }
    }
}

/* sum_i e^(x[i] - m) over n values (x[i] <= m) */
static float sum_exp(const float* x, int n, float m) {
    float z = 0.0f;
#pragma omp simd reduction(+ : z)
    for (int i = 0; i < n; i++) z += exp_nonpositive(x[i] - m);
    return z;
}

static void row_statistics(const float* x, int chunks, int width, float* chunk_max, float* lse) {
    float m = -INFINITY;
    for (int c = 0; c < chunks; c++) {
        float cm = -INFINITY;
#pragma omp simd reduction(max : cm)
        for (int i = 0; i < width; i++) cm = x[c * width + i] > cm ? x[c * width + i] : cm;
        chunk_max[c] = cm;
        m = cm > m ? cm : m;
    }
    *lse = m + logf(sum_exp(x, chunks * width, m));
}

/* The statistics a search step needs of each row of logits [rows, chunks * width] (fp32):
 * the maximum of every run of `width` columns into chunk_max [rows, chunks], and
 * logZ = log sum_v e^(logits[v]) into lse [rows]. One read of the row for the maxima, one for
 * the sum. */
void score_statistics(const float* logits, int rows, int chunks, int width, float* chunk_max,
                      float* lse, int threads) {
    const long columns = (long)chunks * width;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * columns > 4 * PARALLEL_WORK)
    for (int r = 0; r < rows; r++)
        row_statistics(logits + r * columns, chunks, width, chunk_max + (long)r * chunks, lse + r);
}
