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
#ifdef _OPENMP
#include <omp.h>
#endif

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

/* ---- A whole decoder step for a few rows (one sentence's beams, or greedy at one row) ---- */

#define BLOCK 32 /* outputs a product computes at a time, per row: two 512-bit vectors */

/* y[r, o0:o1) = b + x[r, :] @ W^T[:, o0:o1) (ReLU'd if relu) for R rows, o0 a multiple of BLOCK.
 * The weight comes as panels: W^T's columns in blocks of BLOCK (the last one padded with zeros),
 * each block stored whole, [in, BLOCK] row-major, so a block's weights are one sequential read.
 * The rows' sums for one block stay in registers while its panel streams past once. */
#define SMALL_PRODUCT(R)                                                                          \
    static void small_product_##R(const float* x, int in, int out, const float* panels,          \
                                  const float* b, int relu, float* y, int o0, int o1) {         \
        for (int o = o0; o < o1; o += BLOCK) {                                                    \
            const int width = o1 - o < BLOCK ? o1 - o : BLOCK;                                    \
            const float* w = panels + (long)o * in;                                               \
            float acc[R][BLOCK];                                                                  \
            for (int r = 0; r < R; r++)                                                           \
                for (int l = 0; l < BLOCK; l++) acc[r][l] = b && l < width ? b[o + l] : 0.0f;     \
            for (int i = 0; i < in; i++, w += BLOCK)                                              \
                for (int r = 0; r < R; r++) {                                                     \
                    const float xi = x[(long)r * in + i];                                         \
                    _Pragma("omp simd") for (int l = 0; l < BLOCK; l++) acc[r][l] += xi * w[l];   \
                }                                                                                 \
            for (int r = 0; r < R; r++)                                                           \
                for (int l = 0; l < width; l++)                                                   \
                    y[(long)r * out + o + l] = relu && acc[r][l] < 0.0f ? 0.0f : acc[r][l];       \
        }                                                                                         \
    }
SMALL_PRODUCT(1)
SMALL_PRODUCT(2)
SMALL_PRODUCT(3)
SMALL_PRODUCT(4)
SMALL_PRODUCT(5)
SMALL_PRODUCT(6)
SMALL_PRODUCT(7)
SMALL_PRODUCT(8)

typedef void (*small_product_fn)(const float*, int, int, const float*, const float*, int, float*, int, int);
static const small_product_fn SMALL_PRODUCTS[9] = {
    NULL, small_product_1, small_product_2, small_product_3, small_product_4,
    small_product_5, small_product_6, small_product_7, small_product_8,
};

/* y = x @ W^T + b (ReLU'd if relu) for n rows, W^T as panels (see SMALL_PRODUCT), the blocks
 * of outputs shared out over the threads */
static void small_product(const float* x, int n, int in, int out, const float* panels, const float* b,
                          int relu, float* y, int threads) {
    const int blocks = (out + BLOCK - 1) / BLOCK;
#pragma omp parallel num_threads(threads) if ((long)in * out > PARALLEL_WORK)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num();
        nt = omp_get_num_threads();
#endif
        const int o0 = (int)((long)blocks * t / nt) * BLOCK;
        int o1 = (int)((long)blocks * (t + 1) / nt) * BLOCK;
        o1 = o1 > out ? out : o1;
        for (int o = o0; o < o1; o += BLOCK) { /* each panel once, for all rows, 8 at a time */
            const int end = o + BLOCK < o1 ? o + BLOCK : o1;
            for (int r = 0; r < n; r += 8) {
                const int rows = n - r < 8 ? n - r : 8;
                SMALL_PRODUCTS[rows](x + (long)r * in, in, out, panels, b, relu, y + (long)r * out, o, end);
            }
        }
    }
}

/* x = LayerNorm(x + y) (post-norm) over n rows of d; or, with y NULL, out = LayerNorm(x) */
static void layer_norm(float* x, const float* y, int n, int d, const float* w, const float* b,
                       float eps, float* out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if ((long)n * d > PARALLEL_WORK)
    for (int r = 0; r < n; r++) {
        float* xr = x + (long)r * d;
        float* o = (out ? out : x) + (long)r * d;
        float mean = 0.0f, var = 0.0f;
        if (y)
            for (int i = 0; i < d; i++) xr[i] += y[(long)r * d + i];
#pragma omp simd reduction(+ : mean)
        for (int i = 0; i < d; i++) mean += xr[i];
        mean /= (float)d;
#pragma omp simd reduction(+ : var)
        for (int i = 0; i < d; i++) var += (xr[i] - mean) * (xr[i] - mean);
        const float inv = 1.0f / sqrtf(var / (float)d + eps);
#pragma omp simd
        for (int i = 0; i < d; i++) o[i] = (xr[i] - mean) * inv * w[i] + b[i];
    }
}

/* A sublayer's input (section 5.4): x itself (post-norm), or LayerNorm(x) into normed (pre-norm) */
static const float* sublayer_input(float* x, int n, int d, const float* w, const float* b, float eps,
                                   int pre_norm, float* normed, int threads) {
    if (!pre_norm) return x;
    layer_norm(x, NULL, n, d, w, b, eps, normed, threads);
    return normed;
}

/* The residual connection around a sublayer's output y: x = LayerNorm(x + y) (post-norm), or
 * x += y (pre-norm) */
static void residual(float* x, const float* y, int n, int d, const float* w, const float* b, float eps,
                     int pre_norm, int threads) {
    if (!pre_norm) {
        layer_norm(x, y, n, d, w, b, eps, NULL, threads);
        return;
    }
    for (long i = 0; i < (long)n * d; i++) x[i] += y[i];
}

/* The feed-forward sublayer (eq. 2) with its residual connection, in place on x [n, d]. w: the
 * layer's W1, b1, W2, b2 (products as panels), then the sublayer's LayerNorm weight and bias. */
/* An attention sublayer's end: y = a W + b, then x's residual step with LayerNorm (w_ln, b_ln). */
static void attention_output(float* x, const float* a, int n, int d, const float* w, const float* b,
                             const float* w_ln, const float* b_ln, float eps, int pre_norm, float* y,
                             int threads) {
    small_product(a, n, d, d, w, b, 0, y, threads);
    residual(x, y, n, d, w_ln, b_ln, eps, pre_norm, threads);
}

static void feed_forward(float* x, int n, int d, int dff, const float* const* w, int pre_norm, float eps,
                         float* normed, float* hidden, float* y, int threads) {
    const float* in = sublayer_input(x, n, d, w[4], w[5], eps, pre_norm, normed, threads);
    small_product(in, n, d, dff, w[0], w[1], 1, hidden, threads);
    small_product(hidden, n, dff, d, w[2], w[3], 0, y, threads);
    residual(x, y, n, d, w[4], w[5], eps, pre_norm, threads);
}

#define LAYER_WEIGHTS 18 /* pointers per layer in decoder_step's weights, in this order: */
enum { WQKV, BQKV, WO, BO, LN0W, LN0B, WQ, BQ, WC, BC, LN1W, LN1B, W1, B1, W2, B2, LN2W, LN2B };

/* One decoder step for n rows in fp32: x [n, d] (embeddings + positions) through every layer,
 * with the caches as self_attention_step and cross_attention_step take them, then the output
 * product into logits [n, vout]. weights: LAYER_WEIGHTS pointers per layer (products as panels,
 * see SMALL_PRODUCT), then the final LayerNorm's weight and bias (pre-norm; else NULL) and the
 * output product's panels. With vout 0, the step's hidden states [n, d] go into logits instead.
 * work: n * (6 * d + dff) floats of scratch. */
void decoder_step(const float* const* weights, int layers, int d, int h, int dff, int vout,
                  int pre_norm, float eps, float* x, int n, void* const* self_k, void* const* self_v,
                  long time_stride, int length, const void* const* cross_k,
                  const void* const* cross_v, long sentence_stride, int S, const float* mask,
                  int group, float* logits, float* work, int threads) {
    const int dk = d / h;
    const float scale = 1.0f / sqrtf((float)dk);
    float *qkv = work, *a = qkv + (long)n * 3 * d, *y = a + (long)n * d, *normed = y + (long)n * d;
    float* hidden = normed + (long)n * d;
    for (int l = 0; l < layers; l++) {
        const float* const* w = weights + (long)l * LAYER_WEIGHTS;
        const float* in = sublayer_input(x, n, d, w[LN0W], w[LN0B], eps, pre_norm, normed, threads);
        small_product(in, n, d, 3 * d, w[WQKV], w[BQKV], 0, qkv, threads);
        self_attention_step(qkv, self_k[l], self_v[l], time_stride, length, n, h, dk, 0, scale, a, threads);
        attention_output(x, a, n, d, w[WO], w[BO], w[LN0W], w[LN0B], eps, pre_norm, y, threads);

        in = sublayer_input(x, n, d, w[LN1W], w[LN1B], eps, pre_norm, normed, threads);
        small_product(in, n, d, d, w[WQ], w[BQ], 0, qkv, threads);
        cross_attention_step(qkv, cross_k[l], cross_v[l], sentence_stride, S, mask, n / group, group, h,
                             dk, 0, scale, a, threads);
        attention_output(x, a, n, d, w[WC], w[BC], w[LN1W], w[LN1B], eps, pre_norm, y, threads);

        feed_forward(x, n, d, dff, w + W1, pre_norm, eps, normed, hidden, y, threads);
    }
    const float* const* tail = weights + (long)layers * LAYER_WEIGHTS;
    const float* out_in = sublayer_input(x, n, d, tail[0], tail[1], eps, tail[0] != NULL, normed, threads);
    if (vout == 0) { /* the caller's own output product (a shortlist): the hidden states */
        memcpy(logits, out_in, sizeof(float) * n * d);
        return;
    }
    small_product(out_in, n, d, vout, tail[2], NULL, 0, logits, threads);
}

/* ---- The whole encoder in one call ---- */

#define ENCODER_WEIGHTS 12 /* pointers per layer in encoder_layers' weights, in this order: */
enum { E_WQKV, E_BQKV, E_WO, E_BO, E_LN0W, E_LN0B, E_W1, E_B1, E_W2, E_B2, E_LN1W, E_LN1B };

/* Self-attention over whole sentences (eq. 1, every position sees every unmasked one):
 * qkv [B * S, 3, h, dk] fp32, mask [B, S] additive or NULL; out [B * S, h * dk]. */
static void encoder_attention(const float* qkv, int B, int S, int h, int dk, const float* mask,
                              float scale, float* out, int threads) {
    const int d = h * dk;
    const long row = 3L * d;
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) \
    if ((long)B * S * S * d > PARALLEL_WORK)
    for (int b = 0; b < B; b++)
        for (int i = 0; i < S; i++) {
            const float* sentence = qkv + (long)b * S * row;
            for (int j = 0; j < h; j++)
                attend(sentence + i * row + j * dk, (const char*)(sentence + d + j * dk),
                       (const char*)(sentence + 2 * d + j * dk), row * 4, row * 4,
                       mask ? mask + (long)b * S : NULL, S, dk, 0, scale,
                       out + ((long)b * S + i) * d + j * dk);
        }
}

/* The encoder stack in fp32: x [B * S, d] (embeddings + positions) through every layer, in
 * place, then the final LayerNorm (pre-norm). weights: ENCODER_WEIGHTS pointers per layer
 * (products as panels, see SMALL_PRODUCT), then the final LayerNorm's weight and bias (NULL
 * for post-norm). mask [B, S] additive or NULL. work: B * S * (6 * d + dff) floats. */
void encoder_layers(const float* const* weights, int layers, int d, int h, int dff, int pre_norm,
                    float eps, float* x, int B, int S, const float* mask, float* work, int threads) {
    const int n = B * S, dk = d / h;
    const float scale = 1.0f / sqrtf((float)dk);
    float *qkv = work, *a = qkv + (long)n * 3 * d, *y = a + (long)n * d, *normed = y + (long)n * d;
    float* hidden = normed + (long)n * d;
    for (int l = 0; l < layers; l++) {
        const float* const* w = weights + (long)l * ENCODER_WEIGHTS;
        const float* in = sublayer_input(x, n, d, w[E_LN0W], w[E_LN0B], eps, pre_norm, normed, threads);
        small_product(in, n, d, 3 * d, w[E_WQKV], w[E_BQKV], 0, qkv, threads);
        encoder_attention(qkv, B, S, h, dk, mask, scale, a, threads);
        attention_output(x, a, n, d, w[E_WO], w[E_BO], w[E_LN0W], w[E_LN0B], eps, pre_norm, y, threads);

        feed_forward(x, n, d, dff, w + E_W1, pre_norm, eps, normed, hidden, y, threads);
    }
    const float* const* final = weights + (long)layers * ENCODER_WEIGHTS;
    if (final[0]) layer_norm(x, NULL, n, d, final[0], final[1], eps, NULL, threads);
}

/* ---- Cache rows moved for the search ---- */

/* In place, in each of `count` buffers, row targets[i] becomes old row sources[i] for `moved`
 * rows of row_bytes, at `times` times time_bytes apart (each time's sources are read into tmp,
 * threads * moved * row_bytes, before any row is written). */
void move_rows(void* const* buffers, int count, int times, long time_bytes, long row_bytes,
               const long* sources, const long* targets, int moved, char* tmp, int threads) {
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) \
    if ((long)count * times * moved * row_bytes > 64 * PARALLEL_WORK)
    for (int b = 0; b < count; b++)
        for (int t = 0; t < times; t++) {
            int thread = 0;
#ifdef _OPENMP
            thread = omp_get_thread_num();
#endif
            char* own = tmp + (long)thread * moved * row_bytes;
            char* base = (char*)buffers[b] + (long)t * time_bytes;
            for (int i = 0; i < moved; i++) memcpy(own + i * row_bytes, base + sources[i] * row_bytes, row_bytes);
            for (int i = 0; i < moved; i++) memcpy(base + targets[i] * row_bytes, own + i * row_bytes, row_bytes);
        }
}
