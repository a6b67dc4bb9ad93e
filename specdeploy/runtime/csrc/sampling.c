/* The sampler's kernel (sampling.h): processing a float32 logits row into its distribution, draws from
 * it, and the rejection scan of speculative sampling, in portable C99 with no Python.
 *
 * Why: at temperature > 0 every draft token needs its processed distribution and a draw, and every
 * verify row the rejection scan reaches needs its distribution. In NumPy that is about 15 calls per
 * row (more with top-k / top-p); right after an ONNX Runtime pass has streamed the model's weights
 * through the cache, each call runs cold, and on the benchmark pair (8k vocabulary, 0.2 ms draft
 * steps) they cost a quarter of the step. Here it is one call and a few passes over the row.
 *
 * Layout: the softmax and two-level inverse-CDF draws over a dense row; processed rows (repetition
 * penalty, top-k by partial selection, top-p without sorting the row, min-p), formed on their support
 * alone when truncated; then the entry points of sampling.h, which check their arguments.
 *
 * Portable C99, plus GCC's vector extensions where a GNU compiler builds it (FS_PORTABLE selects the
 * plain C loops instead; the tests build both and compare their outputs): no intrinsics, no fast-math.
 * Loops are written in 16 independent lanes so that compilers vectorize them without reassociating
 * anything (GCC needs -fno-trapping-math to turn the selects into blends). On aarch64 the same loops
 * become NEON (a 16-lane vector is four 128-bit registers); hand-written NEON would have to be timed
 * on an aarch64 CPU, and qemu, where the tests run the aarch64 build, times its own translation.
 *
 * Pointers: arrays a row pass reads and writes are restrict; the entry points check that what a caller
 * passes does not overlap (FS_ERROR_OVERLAP), and the passes' other arrays are the processor's scratch.
 */
#include "sampling.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(FS_PORTABLE)
#define FS_VECTORS 1
#endif

#if defined(_MSC_VER)
#define restrict __restrict
#endif

#define LANES 16
#define BLOCK 64 /* positions per block of the two-level draw (a multiple of LANES) */

#define EXP_LOW -87.0f /* below: 0 (e^x < 1.4 FLT_MIN; no pass meets a denormal, and every sum holds e^0 = 1) */
#define EXP_HIGH 88.0f /* above: +inf (2^n would not fit the exponent field past 2^127; e^88 = FLT_MAX / 2.06) */

/* e^x within ~2 ulp on [EXP_LOW, EXP_HIGH] (the Cephes expf polynomial), 0 below, +inf above, NaN for
 * NaN. The row passes call it on x <= 0 (a scaled logit minus the row's scaled maximum); the range is
 * guarded all the same, so that no input reaches the exponent's integer arithmetic out of range. */
static inline float exp_nonpositive(float x) {
    const int in_range = x >= EXP_LOW && x <= EXP_HIGH; /* NaN is not */
    const float clamped = in_range ? x : 0.0f; /* no NaN or huge value reaches the integer conversion */
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    const float n = (clamped * 1.44269504088896341f + shifter) - shifter;
    const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f; /* Cody-Waite: ln 2 in two parts */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n, n in [-126, 127] */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return in_range ? p * scale : x > EXP_HIGH ? INFINITY : x != x ? x : 0.0f;
}

float fs_exp(float x) { return exp_nonpositive(x); }

/* Row passes are compiled for AVX-512, AVX2 and the baseline, and glibc's ifuncs pick one at load
 * time (GCC on x86-64); other compilers and CPUs get one portable build (NEON on aarch64 vectorizes
 * the same loops). No fp contraction (setup.py passes -ffp-contract=off) and a fixed lane layout:
 * every build computes the same bits. */
#if defined(FS_VECTORS) && !defined(__clang__) && __GNUC__ >= 11 && defined(__x86_64__) && defined(__GLIBC__)
#define ROW_PASS __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ROW_PASS
#endif

#if defined(FS_VECTORS)
/* GCC does not vectorize the lane loop below (it keeps 16 scalar maxima); written with vector
 * extensions it is one vector max per 16 floats: 0.65 us instead of 1.4 us on an 8k row. The result
 * is the same either way (a maximum does not depend on the order it was taken in). */
typedef float FloatLanes __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t MaskLanes __attribute__((vector_size(LANES * sizeof(int32_t))));

ROW_PASS static float row_max(const float *restrict row, fs_index n) {
    FloatLanes lanes;
    for (int l = 0; l < LANES; l++) lanes[l] = row[0];
    fs_index i = 0;
    for (; i + LANES <= n; i += LANES) {
        FloatLanes x;
        memcpy(&x, row + i, sizeof x);
        const MaskLanes greater = x > lanes; /* NaN compares false: like the scalar loop, NaN is skipped */
        lanes = (FloatLanes)((greater & (MaskLanes)x) | (~greater & (MaskLanes)lanes));
    }
    float best = lanes[0];
    for (int l = 1; l < LANES; l++) best = lanes[l] > best ? lanes[l] : best;
    for (; i < n; i++) best = row[i] > best ? row[i] : best;
    return best;
}
#else
static float row_max(const float *restrict row, fs_index n) {
    float lanes[LANES];
    for (int l = 0; l < LANES; l++) lanes[l] = row[0];
    fs_index i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) lanes[l] = row[i + l] > lanes[l] ? row[i + l] : lanes[l];
    float best = lanes[0];
    for (int l = 1; l < LANES; l++) best = lanes[l] > best ? lanes[l] : best;
    for (; i < n; i++) best = row[i] > best ? row[i] : best;
    return best;
}
#endif

/* out = exp(logits * inverse_temperature - shift) */
ROW_PASS static void exp_row(const float *restrict logits, float *restrict out, fs_index n, float inverse_temperature,
                             float shift) {
    for (fs_index i = 0; i < n; i++) out[i] = exp_nonpositive(logits[i] * inverse_temperature - shift);
}

ROW_PASS static void scale_row(float *restrict row, fs_index n, float scale) {
    for (fs_index i = 0; i < n; i++) row[i] *= scale;
}

/* block_sums[b] = the sum of the weights of block b (positions [b * BLOCK, (b + 1) * BLOCK)), where
 * the weight at i is WEIGHT(i); returns the total. In double, as the scan inside a block adds: with
 * float block sums, rounding gave the mass between a block's float and exact sums (up to ~4e-8) to
 * the block's last token. The lanes of a block are added pairwise (lane l + lane l + 8, then + 4, ...),
 * not one after another: 1.05 us instead of 1.4 us on an 8k row. */
#define BLOCK_SUMS(WEIGHT)                                                  \
    double total = 0.0;                                                     \
    fs_index b = 0, start = 0;                                            \
    for (; start + BLOCK <= n; b++, start += BLOCK) {                       \
        double lanes[LANES] = {0};                                          \
        for (fs_index i = start; i < start + BLOCK; i += LANES)           \
            for (int l = 0; l < LANES; l++) lanes[l] += WEIGHT(i + l);      \
        for (int width = LANES / 2; width > 0; width /= 2)                  \
            for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];   \
        block_sums[b] = lanes[0];                                           \
        total += lanes[0];                                                  \
    }                                                                       \
    if (start < n) {                                                        \
        double sum = 0.0;                                                   \
        for (fs_index i = start; i < n; i++) sum += WEIGHT(i);            \
        block_sums[b] = sum;                                                \
        total += sum;                                                       \
    }                                                                       \
    return total

#define PLAIN(i) weights[i]
#define RESIDUAL(i) (target[i] > draft[i] ? target[i] - draft[i] : 0.0f)

ROW_PASS static double block_sums_of(const float *restrict weights, fs_index n, double *restrict block_sums) {
    BLOCK_SUMS(PLAIN);
}

/* The same for the residual max(0, target - draft) of speculative sampling, which is never stored. */
ROW_PASS static double residual_block_sums(const float *restrict target, const float *restrict draft, fs_index n,
                                           double *restrict block_sums) {
    BLOCK_SUMS(RESIDUAL);
}

static fs_index draw_blocks(const float *weights, fs_index n, const double *block_sums, double total, double uniform);

/* out = softmax(logits * inverse_temperature), in NumPy's order of operations (sampling.softmax_row:
 * scale, subtract the scaled maximum, exp, multiply by the reciprocal of the sum); block_sums is scratch.
 * With a uniform, also returns the token it draws from the row: from the exponentials before they are
 * divided by their sum (the same distribution), whose block sums the normalization computed anyway,
 * rather than a second pass over the normalized row. Else returns 0. */
static fs_index softmax_row(const float *logits, float *out, fs_index n, float inverse_temperature,
                              double *block_sums, const double *uniform) {
    exp_row(logits, out, n, inverse_temperature, row_max(logits, n) * inverse_temperature);
    const double total = block_sums_of(out, n, block_sums); /* >= 1: the maximum contributes e^0 */
    fs_index token = 0;
    if (uniform != NULL) /* NaN or infinite logits leave no distribution to draw from: -1, an error */
        token = total >= 1.0 && isfinite(total) ? draw_blocks(out, n, block_sums, total, *uniform) : -1;
    const float scale = (float)(1.0 / total);
    scale_row(out, n, scale);
    return token;
}

/* Index of the first weight whose running sum exceeds point, scanning [start, end); the last
 * positive weight there if rounding ran off the end; -1 if all are zero. Weights come from
 * weight_at, so that the residual is never stored. */
#define SCAN(weight_at)                                           \
    do {                                                          \
        double running = 0.0;                                     \
        fs_index last_positive = -1;                            \
        for (fs_index i = start; i < end; i++) {                \
            const float w = (weight_at);                          \
            if (w > 0.0f) {                                       \
                running += w;                                     \
                last_positive = i;                                \
                if (running > point) return i;                    \
            }                                                     \
        }                                                         \
        return last_positive;                                     \
    } while (0)

/* The block that holds point (blocks with zero mass are never chosen); point becomes relative to it. */
static fs_index pick_block(const double *block_sums, fs_index num_blocks, double *point) {
    double before = 0.0;
    fs_index last_positive = -1;
    for (fs_index b = 0; b < num_blocks; b++) {
        if (block_sums[b] <= 0.0) continue;
        last_positive = b;
        if (before + block_sums[b] > *point) break;
        before += block_sums[b];
    }
    if (last_positive >= 0 && before + block_sums[last_positive] <= *point) /* ran off the end: last block */
        before -= block_sums[last_positive];
    *point -= before;
    if (*point < 0.0) *point = 0.0;
    return last_positive;
}

static fs_index scan_weights(const float *weights, fs_index start, fs_index end, double point) {
    SCAN(weights[i]);
}

static fs_index scan_residual(const float *target, const float *draft, fs_index start, fs_index end,
                                double point) {
    SCAN(RESIDUAL(i));
}

static fs_index num_blocks_of(fs_index n) { return (n + BLOCK - 1) / BLOCK; }

static fs_index num_chunks_of(fs_index n) { return (n + LANES - 1) / LANES; }

/* Two-level inverse-CDF draw from non-negative weights with known block sums. */
static fs_index draw_blocks(const float *weights, fs_index n, const double *block_sums, double total, double uniform) {
    double point = uniform * total;
    const fs_index block = pick_block(block_sums, num_blocks_of(n), &point);
    if (block < 0) return -1;
    const fs_index start = block * BLOCK, end = start + BLOCK < n ? start + BLOCK : n;
    return scan_weights(weights, start, end, point);
}

/* The inverse-CDF draw from non-negative weights (not necessarily normalized); -1 if all are zero, or if
 * their sum is not finite (a NaN or an infinite weight: no distribution). */
static fs_index draw_row(const float *weights, fs_index n, double *blocks, double uniform) {
    const double total = block_sums_of(weights, n, blocks);
    if (!(total > 0.0 && isfinite(total))) return -1;
    return draw_blocks(weights, n, blocks, total, uniform);
}

/* A draw from normalize(max(0, target - draft)); from target if that has no mass. */
static fs_index residual_draw_row(const float *target, const float *draft, fs_index n, double *blocks,
                                    double uniform) {
    const double total = residual_block_sums(target, draft, n, blocks);
    if (!(total > 0.0)) return draw_row(target, n, blocks, uniform); /* the rows are equal up to rounding */
    double point = uniform * total;
    const fs_index block = pick_block(blocks, num_blocks_of(n), &point);
    const fs_index start = block * BLOCK, end = start + BLOCK < n ? start + BLOCK : n;
    return scan_residual(target, draft, start, end, point);
}

/* ---- Processed rows: repetition penalty, then top-k, top-p, min-p (sampling.process_row) ----
 *
 * A truncated row is formed on its support alone: the support's token ids in ascending order and
 * their weights, compact (a Sparse). Its sums and draws visit the support's tokens in the order, and
 * into the lanes, that the dense passes above visit them, and the dense passes add only zeros
 * besides (x + 0.0 == x): a sparse row gives the bits the dense softmax gives the row with every
 * other logit at -inf, which is how the NumPy definition forms it. */

typedef struct {
    fs_index count;         /* tokens in the support */
    fs_index *indices;      /* [count] ascending token ids */
    float *weights;         /* [count] their weights (exponentials, then probabilities) */
    fs_index num_blocks;    /* blocks of BLOCK positions the support touches */
    fs_index *block_starts; /* [num_blocks + 1]: where each touched block's tokens start in indices */
    double *block_sums;     /* [num_blocks] */
} Sparse;

typedef struct {
    float inverse_temperature; /* 0: greedy (argmax only) */
    fs_index top_k;            /* 0: off */
    double top_p;              /* 1: off */
    float log_min_p;           /* -inf: off */
    float penalty;             /* 1: off */
} Settings;

#define KEY_SHIFT 20 /* a weight's bucket: its float's exponent and 3 leading mantissa bits (2^(1/8) apart) */
#define MAX_BUCKETS 1024
#define HISTOGRAMS 4 /* interleaved, so that neighbouring tokens in one bucket do not wait on each other */

/* One processor's settings and the scratch of its calls, grown to the largest row it has seen. Only what
 * its settings use is allocated: a penalty's copy of the row, a truncation's selection arrays, top-p's
 * histogram. NULL fields are never read. */
struct fs_processor {
    Settings settings;
    fs_index capacity;       /* rows up to this length fit */
    float *penalized;        /* [n] the penalized logits */
    float *work;             /* [n] selection scratch */
    fs_index *work_indices;  /* [n] */
    uint32_t *keys;          /* [n] order keys (top-k's selection) */
    double *dense_blocks;    /* [blocks] block sums of dense rows */
    float *maxima;           /* [chunks] chunk maxima */
    fs_index *chunks;        /* [chunks] chunk numbers (top-k's candidates) */
    double *histogram;       /* [HISTOGRAMS * MAX_BUCKETS] a dense top-p row's mass by bucket */
    Sparse sparse;
};

static int ensure_scratch(fs_processor *p, fs_index n) {
    if (n <= p->capacity) return 0;
    const Settings *s = &p->settings;
    const size_t count = (size_t)n, blocks = (size_t)num_blocks_of(n), chunks = (size_t)num_chunks_of(n);
    const int penalty = s->penalty != 1.0f, top_k = s->top_k > 0, truncated = top_k || s->top_p < 1.0;
    /* Each field's address and the size it grows to (0: not used); the pointers are read and written with
     * memcpy, which any pointer type allows (a cast to void ** would read a float * through another type). */
    struct {
        void *field;
        size_t bytes;
    } parts[] = {
        {&p->penalized, penalty ? count * sizeof(float) : 0},
        {&p->work, truncated ? count * sizeof(float) : 0},
        {&p->work_indices, truncated ? count * sizeof(fs_index) : 0},
        {&p->keys, top_k ? count * sizeof(uint32_t) : 0},
        {&p->dense_blocks, blocks * sizeof(double)},
        {&p->maxima, top_k ? chunks * sizeof(float) : 0},
        {&p->chunks, top_k ? chunks * sizeof(fs_index) : 0},
        {&p->sparse.indices, top_k ? count * sizeof(fs_index) : 0},
        {&p->sparse.weights, top_k ? count * sizeof(float) : 0},
        {&p->sparse.block_starts, top_k ? (count + 1) * sizeof(fs_index) : 0},
        {&p->sparse.block_sums, top_k ? count * sizeof(double) : 0},
        {&p->histogram, s->top_p < 1.0 ? HISTOGRAMS * MAX_BUCKETS * sizeof(double) : 0},
    };
    /* A failed realloc leaves its block as it was: keep whatever succeeded, report the failure. */
    int failed = 0;
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        if (parts[i].bytes == 0) continue;
        void *old;
        memcpy(&old, parts[i].field, sizeof old);
        void *grown = realloc(old, parts[i].bytes);
        if (grown == NULL) failed = 1;
        else memcpy(parts[i].field, &grown, sizeof grown);
    }
    if (failed) return FS_ERROR_NO_MEMORY;
    p->capacity = n;
    return 0;
}

static inline float penalized(float logit, float penalty) { return logit < 0.0f ? logit * penalty : logit / penalty; }

/* out = logits with HF's repetition penalty on every token of the context (each once). */
static void penalize_into(const float *logits, float *out, fs_index n, const fs_context *context, float penalty) {
    memcpy(out, logits, (size_t)n * sizeof *out);
    for (fs_index j = 0; j < context->count; j++) out[context->ids[j]] = penalized(out[context->ids[j]], penalty);
    for (fs_index j = 0; j < context->num_extras; j++) {
        const fs_index token = context->extras[j];
        int seen = context->mask[token];
        for (fs_index i = 0; i < j && !seen; i++) seen = context->extras[i] == token;
        if (!seen) out[token] = penalized(out[token], penalty);
    }
}

/* The maximum of row [n], or NaN when the row holds a NaN: a truncated row's check, in one pass. */
#if defined(FS_VECTORS)
ROW_PASS static float checked_max(const float *restrict row, fs_index n) {
    FloatLanes lanes;
    for (int l = 0; l < LANES; l++) lanes[l] = -INFINITY;
    MaskLanes nan = {0};
    fs_index i = 0;
    for (; i + LANES <= n; i += LANES) {
        FloatLanes x;
        memcpy(&x, row + i, sizeof x);
        const MaskLanes greater = x > lanes;
        lanes = (FloatLanes)((greater & (MaskLanes)x) | (~greater & (MaskLanes)lanes));
        nan |= x != x;
    }
    float best = lanes[0];
    int found = nan[0] != 0;
    for (int l = 1; l < LANES; l++) {
        best = lanes[l] > best ? lanes[l] : best;
        found |= nan[l] != 0;
    }
    for (; i < n; i++) {
        best = row[i] > best ? row[i] : best;
        found |= row[i] != row[i];
    }
    return found ? NAN : best;
}
#else
static float checked_max(const float *restrict row, fs_index n) {
    float best = -INFINITY;
    int found = 0;
    for (fs_index i = 0; i < n; i++) {
        best = row[i] > best ? row[i] : best;
        found |= row[i] != row[i];
    }
    return found ? NAN : best;
}
#endif

ROW_PASS static int any_nan(const float *restrict row, fs_index n) {
    int found = 0;
    for (fs_index i = 0; i < n; i++) found |= row[i] != row[i];
    return found;
}

/* The largest of the LANES values at x (no NaN): in vector registers with GCC (a max with the lanes
 * swapped in halves, quarters, ...), so that a row's chunk maxima cost about one pass over it. */
#if defined(FS_VECTORS)
/* LANE_SWAP(v, step) swaps v's halves (step 0), quarters, eighths and neighbours (step 3): four
 * steps reduce 16 lanes. GCC takes the permutation as a vector, clang (which defines __GNUC__ too)
 * only as constants. */
#if defined(__clang__)
#define LANE_SWAP(v, step)                                                                                \
    ((step) == 0   ? __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7) \
     : (step) == 1 ? __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11) \
     : (step) == 2 ? __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13) \
                   : __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14))
#else
static const MaskLanes swaps[4] = {
    {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
    {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
    {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
    {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14},
};
#define LANE_SWAP(v, step) __builtin_shuffle(v, swaps[step])
#endif

static inline float chunk_max(const float *restrict x) {
    FloatLanes lanes;
    memcpy(&lanes, x, sizeof lanes);
    for (int step = 0; step < 4; step++) {
        const FloatLanes other = LANE_SWAP(lanes, step);
        const MaskLanes greater = other > lanes;
        lanes = (FloatLanes)((greater & (MaskLanes)other) | (~greater & (MaskLanes)lanes));
    }
    return lanes[0];
}
#else
static inline float chunk_max(const float *restrict x) {
    float best = x[0];
    for (int l = 1; l < LANES; l++) best = x[l] > best ? x[l] : best;
    return best;
}
#endif

/* A float's bits as an unsigned integer in the floats' order (no NaN; -0.0 just below +0.0): the sign
 * bit set on a positive float, every bit flipped on a negative one. Branch-free, so loops of it vectorize. */
static inline uint32_t order_key(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint32_t negative = (uint32_t)0 - (bits >> 31); /* all ones for a negative float */
    return bits ^ (negative | 0x80000000u);
}

static inline float from_order_key(uint32_t key) {
    const uint32_t bits = key & 0x80000000u ? key & 0x7fffffffu : ~key;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

ROW_PASS static fs_index count_at_least(const uint32_t *restrict keys, fs_index count, uint32_t threshold) {
    uint32_t reached = 0; /* count < 2^32: a row's length */
    for (fs_index i = 0; i < count; i++) reached += keys[i] >= threshold;
    return (fs_index)reached;
}

/* keys [return] = the keys [count] in [low, high], in order; *above += the number of keys above high
 * (branch-free). */
static fs_index keep_window(uint32_t *keys, fs_index count, uint32_t low, uint32_t high, fs_index *above) {
    fs_index kept = 0, over = 0;
    for (fs_index i = 0; i < count; i++) {
        const uint32_t key = keys[i];
        keys[kept] = key;
        kept += key >= low && key <= high;
        over += key > high;
    }
    *above += over;
    return kept;
}

#define WINDOW_BITS 4   /* keys outside the bits still open are dropped every this many bits ... */
#define WINDOW_KEYS 64  /* ... while more than this many keys remain */

/* The k-th largest of keys [count] (1 <= k <= count), whose least and largest are given: the largest t
 * that at least k keys reach, set bit by bit from the highest bit in which least and largest differ,
 * one counting pass per bit. Every WINDOW_BITS bits, the keys outside the range the bits set so far
 * leave open are dropped (those above it counted off k), so that many keys cost few full passes. The
 * passes are branch-free: right after an ONNX Runtime pass the branch predictors know nothing of this
 * loop, and a partition's data-dependent branches (a quickselect's) were what made a top-k row cost
 * more than a temperature-only one during generation. keys is reordered. */
static uint32_t kth_key(uint32_t *keys, fs_index count, fs_index k, uint32_t least, uint32_t largest) {
    const uint32_t differ = least ^ largest;
    if (differ == 0) return least;
    int bit = 31;
    while (!((differ >> bit) & 1u)) bit--;
    /* least's bits above `bit`, zeros below: every key reaches it (count >= k), as the loop keeps */
    uint32_t result = bit == 31 ? 0u : least & ~((2u << bit) - 1u);
    for (int done = 0; bit >= 0; bit--) {
        const uint32_t candidate = result | (1u << bit);
        result = count_at_least(keys, count, candidate) >= k ? candidate : result;
        if (++done % WINDOW_BITS == 0 && bit > 0 && count > WINDOW_KEYS) {
            fs_index above = 0; /* keys beyond the open bits: they rank before the k-th */
            count = keep_window(keys, count, result, result | ((1u << bit) - 1u), &above);
            k -= above;
        }
    }
    return result;
}

/* maxima [num_chunks_of(n)] = the largest value of each chunk of LANES values of row [n] (no NaN). */
ROW_PASS static void chunk_maxima(const float *restrict row, fs_index n, float *restrict maxima) {
    fs_index c = 0, start = 0;
    for (; start + LANES <= n; c++, start += LANES) maxima[c] = chunk_max(row + start);
    if (start < n) {
        float best = row[start];
        for (fs_index i = start + 1; i < n; i++) best = row[i] > best ? row[i] : best;
        maxima[c] = best;
    }
}

/* chunks [return] = the numbers of the chunks whose maximum (maxima [num_chunks]) reaches threshold,
 * ascending; branch-free, so that the loops over them branch only on their count. */
static fs_index chunks_at_least(const float *maxima, fs_index num_chunks, float threshold, fs_index *chunks) {
    fs_index count = 0;
    for (fs_index c = 0; c < num_chunks; c++) {
        chunks[count] = c;
        count += maxima[c] >= threshold;
    }
    return count;
}

/* The k-th largest of row [n] (1 <= k < n; no NaN), by partial selection. The k-th largest of the chunks'
 * maxima is a lower bound (k values reach it), so only the chunks whose maximum reaches it can hold the
 * k largest values; their values at or above it are few, and one selection over them finds the k-th.
 * chunks [*num_listed] = those chunks (chunks_at_least's); keys [n] is scratch. */
static float kth_largest(const float *row, fs_index n, fs_index k, const float *maxima, fs_index *chunks,
                         fs_index *num_listed, uint32_t *keys) {
    const fs_index num_chunks = num_chunks_of(n);
    float bound = -INFINITY, max = -INFINITY;
    for (fs_index c = 0; c < num_chunks; c++) max = maxima[c] > max ? maxima[c] : max;
    if (k <= num_chunks) {
        for (fs_index c = 0; c < num_chunks; c++) keys[c] = order_key(maxima[c]);
        bound = from_order_key(kth_key(keys, num_chunks, k, order_key(-INFINITY), order_key(max == 0.0f ? 0.0f : max)));
    }
    *num_listed = chunks_at_least(maxima, num_chunks, bound, chunks);
    fs_index count = 0;
    for (fs_index j = 0; j < *num_listed; j++) {
        const fs_index c = chunks[j], end = (c + 1) * LANES < n ? (c + 1) * LANES : n;
        for (fs_index i = c * LANES; i < end; i++) { /* branch-free: any of a chunk's values may pass */
            keys[count] = order_key(row[i]);
            count += row[i] >= bound;
        }
    }
    /* every candidate lies between the bound (-0.0 when it is a zero) and the maximum (+0.0 when a zero) */
    const uint32_t least = order_key(bound == 0.0f ? -0.0f : bound), largest = order_key(max == 0.0f ? 0.0f : max);
    return count < k ? -INFINITY : from_order_key(kth_key(keys, count, k, least, largest));
}

/* indices [return] = the ids of row [n] whose value is >= threshold, ascending, read from the listed chunks
 * (chunks [num_listed], ascending: every chunk that can hold such a value). */
static fs_index collect_at_least(const float *row, fs_index n, float threshold, const fs_index *chunks,
                                   fs_index num_listed, fs_index *indices) {
    fs_index count = 0;
    for (fs_index j = 0; j < num_listed; j++) {
        const fs_index c = chunks[j], end = (c + 1) * LANES < n ? (c + 1) * LANES : n;
        for (fs_index i = c * LANES; i < end; i++) {
            indices[count] = i;
            count += row[i] >= threshold;
        }
    }
    return count;
}

/* Whether token (weight, id) ranks before (other_weight, other_id): more probable; as probable (an exponential
 * can round two logits to one weight), a higher logit of row; then a lower id. With exponentials that never
 * decrease as the logit grows, this is the logit's order, whatever exp's last bits. */
static inline int ranks_before(const float *row, float weight, fs_index id, float other_weight, fs_index other_id) {
    return weight > other_weight ||
           (weight == other_weight && (row[id] > row[other_id] || (row[id] == row[other_id] && id < other_id)));
}

/* The nucleus's last token: ranking (values, ids) [count], the last one whose preceding mass is below
 * target (the first always is: target > 0). A selection by mass: partition around a pivot, and
 * continue in the part that holds the cut, O(count) on average. values and ids are reordered. */
static void nucleus_cut(const float *row, float *values, fs_index *ids, fs_index count, double target,
                        float *cut_value, fs_index *cut_id) {
    fs_index low = 0, high = count; /* the cut lies in [low, high) */
    double before = 0.0;              /* mass of the tokens ranked before low: below target */
#define SWAP(a, b)                                                                      \
    do {                                                                                \
        const float v = values[a]; values[a] = values[b]; values[b] = v;                \
        const fs_index t = ids[a]; ids[a] = ids[b]; ids[b] = t;                       \
    } while (0)
    while (high - low > 16) {
        const fs_index middle = low + (high - low) / 2, last = high - 1;
        /* median of three to the end, as the pivot */
        if (ranks_before(row, values[middle], ids[middle], values[low], ids[low])) SWAP(middle, low);
        if (ranks_before(row, values[last], ids[last], values[low], ids[low])) SWAP(last, low);
        if (ranks_before(row, values[middle], ids[middle], values[last], ids[last])) SWAP(middle, last);
        const float pivot = values[last];
        const fs_index pivot_id = ids[last];
        fs_index store = low;
        double mass = 0.0;
        for (fs_index i = low; i < last; i++)
            if (ranks_before(row, values[i], ids[i], pivot, pivot_id)) {
                mass += values[i];
                SWAP(i, store);
                store++;
            }
        SWAP(store, last);
        if (before + mass >= target) {
            high = store;
            continue;
        }
        before += mass;
        if (before + pivot >= target || store + 1 == high) {
            *cut_value = pivot;
            *cut_id = pivot_id;
            return;
        }
        before += pivot;
        low = store + 1;
    }
    for (fs_index i = low + 1; i < high; i++) /* insertion sort of the few left */
        for (fs_index j = i; j > low && ranks_before(row, values[j], ids[j], values[j - 1], ids[j - 1]); j--)
            SWAP(j, j - 1);
#undef SWAP
    *cut_value = values[low];
    *cut_id = ids[low];
    for (fs_index i = low; i < high && before < target; i++) {
        *cut_value = values[i];
        *cut_id = ids[i];
        before += values[i];
    }
}

/* Keeps the support's tokens that rank no later than the nucleus's last token (in token order). */
static void keep_nucleus(fs_processor *p, Sparse *s, const float *row, double target) {
    float *values = p->work;
    fs_index *ids = p->work_indices;
    memcpy(values, s->weights, (size_t)s->count * sizeof *values);
    memcpy(ids, s->indices, (size_t)s->count * sizeof *ids);
    float cut_value;
    fs_index cut_id;
    nucleus_cut(row, values, ids, s->count, target, &cut_value, &cut_id);
    fs_index kept = 0;
    for (fs_index j = 0; j < s->count; j++)
        if (!ranks_before(row, cut_value, cut_id, s->weights[j], s->indices[j])) {
            s->indices[kept] = s->indices[j];
            s->weights[kept++] = s->weights[j];
        }
    s->count = kept;
}

/* Keeps the support's tokens whose scaled logit row * inverse - shift is >= log_min_p (min-p). */
static void keep_min_p(Sparse *s, const float *row, float inverse, float shift, float log_min_p) {
    fs_index kept = 0;
    for (fs_index j = 0; j < s->count; j++)
        if (row[s->indices[j]] * inverse - shift >= log_min_p) {
            s->indices[kept] = s->indices[j];
            s->weights[kept++] = s->weights[j];
        }
    s->count = kept;
}

/* The block sums of a support's weights WEIGHT(j), as BLOCK_SUMS adds them over the dense row. */
#define SPARSE_SUMS(WEIGHT)                                                                    \
    double total = 0.0;                                                                        \
    fs_index j = 0, b = 0;                                                                   \
    while (j < s->count) {                                                                     \
        const fs_index limit = (s->indices[j] / BLOCK + 1) * BLOCK;                          \
        double sum = 0.0;                                                                      \
        s->block_starts[b] = j;                                                                \
        if (limit <= n) {                                                                      \
            double lanes[LANES] = {0};                                                         \
            for (; j < s->count && s->indices[j] < limit; j++) lanes[s->indices[j] % LANES] += WEIGHT(j); \
            for (int width = LANES / 2; width > 0; width /= 2)                                 \
                for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];                  \
            sum = lanes[0];                                                                    \
        } else {                                                                               \
            for (; j < s->count; j++) sum += WEIGHT(j);                                        \
        }                                                                                      \
        s->block_sums[b++] = sum;                                                              \
        total += sum;                                                                          \
    }                                                                                          \
    s->block_starts[b] = j;                                                                    \
    s->num_blocks = b;                                                                         \
    return total

/* The draw of draw_blocks, over the support's blocks. */
#define SPARSE_DRAW(WEIGHT)                                                                    \
    double point = uniform * total;                                                            \
    const fs_index block = pick_block(s->block_sums, s->num_blocks, &point);                 \
    if (block < 0) return -1;                                                                  \
    double running = 0.0;                                                                      \
    fs_index last_positive = -1;                                                             \
    for (fs_index j = s->block_starts[block]; j < s->block_starts[block + 1]; j++) {         \
        const float w = WEIGHT(j);                                                             \
        if (w > 0.0f) {                                                                        \
            running += w;                                                                      \
            last_positive = s->indices[j];                                                     \
            if (running > point) return s->indices[j];                                         \
        }                                                                                      \
    }                                                                                          \
    return last_positive

#define SPARSE_PLAIN(j) s->weights[j]
#define SPARSE_RESIDUAL(j) (s->weights[j] > draft[s->indices[j]] ? s->weights[j] - draft[s->indices[j]] : 0.0f)

static double sparse_sums(Sparse *s, fs_index n) { SPARSE_SUMS(SPARSE_PLAIN); }

static double sparse_residual_sums(Sparse *s, const float *draft, fs_index n) { SPARSE_SUMS(SPARSE_RESIDUAL); }

static fs_index sparse_draw(const Sparse *s, double total, double uniform) { SPARSE_DRAW(SPARSE_PLAIN); }

static fs_index sparse_residual_scan(const Sparse *s, const float *draft, double total, double uniform) {
    SPARSE_DRAW(SPARSE_RESIDUAL);
}

/* residual_draw_row with the target row's support: the residual is zero off it. */
static fs_index sparse_residual_draw(Sparse *s, const float *draft, fs_index n, double uniform) {
    const double total = sparse_residual_sums(s, draft, n);
    if (!(total > 0.0)) return sparse_draw(s, sparse_sums(s, n), uniform); /* the rows are equal up to rounding */
    return sparse_residual_scan(s, draft, total, uniform);
}

/* out = exp(logits * inverse_temperature - shift) where that exponent is >= floor, else 0 (min-p). */
ROW_PASS static void exp_row_above(const float *restrict logits, float *restrict out, fs_index n,
                                   float inverse_temperature, float shift, float floor) {
    for (fs_index i = 0; i < n; i++) {
        const float scaled = logits[i] * inverse_temperature - shift;
        out[i] = scaled >= floor ? exp_nonpositive(scaled) : 0.0f;
    }
}

static fs_index no_distribution(float *out, fs_index n) {
    for (fs_index i = 0; i < n; i++) out[i] = NAN;
    return -1;
}


/* A top-k row: its support by partial selection, then the nucleus and min-p within it; the support's
 * exponentials, from row [n] (no NaN, finite max). */
static Sparse *top_k_row(fs_processor *processor, const float *row, fs_index n, float shift) {
    const Settings *p = &processor->settings;
    Sparse *s = &processor->sparse;
    const float inverse = p->inverse_temperature;
    chunk_maxima(row, n, processor->maxima);
    fs_index num_listed;
    const float kth = kth_largest(row, n, p->top_k, processor->maxima, processor->chunks, &num_listed, processor->keys);
    s->count = collect_at_least(row, n, kth, processor->chunks, num_listed, s->indices);
    for (fs_index j = 0; j < s->count; j++) s->weights[j] = exp_nonpositive(row[s->indices[j]] * inverse - shift);
    if (p->top_p < 1.0) keep_nucleus(processor, s, row, p->top_p * sparse_sums(s, n));
    if (p->log_min_p > -INFINITY) keep_min_p(s, row, inverse, shift, p->log_min_p);
    return s;
}


static inline int32_t weight_key(float weight) {
    int32_t bits;
    memcpy(&bits, &weight, sizeof bits);
    return bits >> KEY_SHIFT;
}

static inline int32_t bucket_of(float weight, int32_t low) {
    const int32_t key = weight_key(weight) - low;
    return key > 0 ? key : 0;
}

/* Whether any of the LANES weights at x is in bucket (in vector registers with GCC). */
static inline int any_in_bucket(const float *restrict x, int32_t low, int32_t bucket) {
#if defined(FS_VECTORS)
    MaskLanes keys;
    memcpy(&keys, x, sizeof keys);
    keys = (keys >> KEY_SHIFT) - low;
    keys = keys & (keys > 0); /* negative keys (comparisons give -1 where true) go to the lowest bucket, 0 */
    MaskLanes hit = keys == bucket;
    for (int step = 0; step < 4; step++) hit |= LANE_SWAP(hit, step);
    return hit[0] != 0;
#else
    int found = 0;
    for (int l = 0; l < LANES; l++) found |= bucket_of(x[l], low) == bucket;
    return found;
#endif
}

/* (values, ids) [return] = the weights [n] in bucket (the lowest bucket: every weight below it too), in
 * token order; a bucket holds few of a row's tokens. */
ROW_PASS static fs_index bucket_members(const float *restrict weights, fs_index n, int32_t low, int32_t bucket,
                                          float *restrict values, fs_index *restrict ids) {
    fs_index count = 0, i = 0;
    for (; i + LANES <= n; i += LANES) {
        if (!any_in_bucket(weights + i, low, bucket)) continue;
        for (int l = 0; l < LANES; l++)
            if (bucket_of(weights[i + l], low) == bucket) {
                values[count] = weights[i + l];
                ids[count++] = i + l;
            }
    }
    for (; i < n; i++)
        if (bucket_of(weights[i], low) == bucket) {
            values[count] = weights[i];
            ids[count++] = i;
        }
    return count;
}

/* The nucleus's last token over a whole row of weights [n] (exponentials, the largest 1), without sorting it:
 * a histogram of the mass by bucket finds the bucket the cut falls in (weights below (1 - top_p) / n
 * hold less than 1 - top_p of a mass of at least 1 together, and share the lowest bucket), and the
 * mass selection runs over that bucket's tokens alone. */
static fs_index dense_nucleus_cut(fs_processor *p, const float *row, const float *weights, fs_index n, float *cut_value,
                                  fs_index *cut_id) {
    double *histogram = p->histogram;
    const double top_p = p->settings.top_p;
    const int32_t low = weight_key((float)((1.0 - top_p) / (double)n * (1.0 - 1e-6)));
    const fs_index buckets = weight_key(1.0f) - low + 1; /* <= 1017: weights are in [0, 1] */
    memset(histogram, 0, sizeof(double) * HISTOGRAMS * (size_t)buckets);
    fs_index i = 0;
    for (; i + HISTOGRAMS <= n; i += HISTOGRAMS)
        for (int h = 0; h < HISTOGRAMS; h++) histogram[h * buckets + bucket_of(weights[i + h], low)] += weights[i + h];
    for (; i < n; i++) histogram[bucket_of(weights[i], low)] += weights[i];
    double total = 0.0;
    for (fs_index b = 0; b < buckets; b++) {
        for (int h = 1; h < HISTOGRAMS; h++) histogram[b] += histogram[h * buckets + b];
        total += histogram[b];
    }
    const double target = top_p * total;
    double before = 0.0; /* mass of the buckets above the cut's */
    fs_index bucket = buckets - 1;
    for (; bucket > 0 && before + histogram[bucket] < target; bucket--) before += histogram[bucket];
    fs_index count = bucket_members(weights, n, low, (int32_t)bucket, p->work, p->work_indices);
    /* Rounding can carry the scan (top_p within a few ulps of 1) down to an empty lowest bucket: the cut is
     * then the last token of the lowest bucket that has any, every token being kept. */
    while (count == 0 && bucket < buckets - 1) {
        bucket++;
        before -= histogram[bucket];
        count = bucket_members(weights, n, low, (int32_t)bucket, p->work, p->work_indices);
    }
    nucleus_cut(row, p->work, p->work_indices, count, target - before, cut_value, cut_id);
    return count;
}

/* Zeroes the weights tied with the nucleus's last token that rank after it (a lower logit, or a higher id):
 * they share its bucket, whose members (values, ids) [count] dense_nucleus_cut left in scratch. The masking
 * pass then keeps every weight at or above the cut's value, with no logit or id to compare per token. */
static void drop_later_ties(float *out, const float *row, const float *values, const fs_index *ids, fs_index count,
                            float cut_value, fs_index cut_id) {
    for (fs_index j = 0; j < count; j++)
        if (values[j] == cut_value && ranks_before(row, cut_value, cut_id, values[j], ids[j])) out[ids[j]] = 0.0f;
}

/* out [n] = the weights at or above the cut's value (the nucleus, once drop_later_ties has run) that min-p
 * keeps too (log_min_p -inf: every one), else 0. Their block sums are block_sums_of's pass: with the sums in
 * the same loop, the stores kept GCC 12 from vectorizing it under -fwrapv, which Python's build flags pass
 * (8x slower on an 8k row). */
ROW_PASS static void mask_row(float *restrict out, const float *restrict row, fs_index n, float cut_value,
                              float inverse, float shift, float log_min_p) {
    for (fs_index i = 0; i < n; i++)
        out[i] = out[i] >= cut_value && row[i] * inverse - shift >= log_min_p ? out[i] : 0.0f;
}

/* Normalizes a dense row of weights out [n] (the most probable one 1) whose block sums and total are known;
 * with a uniform, returns the token it draws from them first (as softmax_row does), else 0. */
static fs_index finish_dense(fs_processor *p, float *out, fs_index n, double total, const double *uniform) {
    const fs_index token = uniform != NULL ? draw_blocks(out, n, p->dense_blocks, total, *uniform) : 0;
    scale_row(out, n, (float)(1.0 / total));
    return token;
}

/* out [n] = the processed distribution of logits [n] (sampling.process_row), with the context's penalty
 * when context is not NULL. With a uniform, returns the token it draws from the row's weights before
 * they are normalized (as softmax_row does), else 0; -1 when the row has no distribution (a NaN or an
 * infinite logit; out is then NaN). *support is the truncated row's support (its weights normalized,
 * as out holds them), or NULL when the row is dense. */
static fs_index process_row(fs_processor *processor, const float *logits, float *out, fs_index n,
                            const fs_context *context, const double *uniform, Sparse **support) {
    const Settings *p = &processor->settings;
    double *dense_blocks = processor->dense_blocks;
    const float *row = logits;
    if (context != NULL) {
        penalize_into(logits, processor->penalized, n, context, p->penalty);
        row = processor->penalized;
    }
    *support = NULL;
    const int truncated = (0 < p->top_k && p->top_k < n) || p->top_p < 1.0;
    if (!truncated && p->log_min_p == -INFINITY) return softmax_row(row, out, n, p->inverse_temperature, dense_blocks, uniform);
    const float max = checked_max(row, n);
    if (!isfinite(max)) return no_distribution(out, n); /* a NaN or an infinite logit, or every logit -inf */
    const float shift = max * p->inverse_temperature;
    if (!isfinite(shift)) return no_distribution(out, n); /* logits / temperature overflow float32 */
    if (!truncated) { /* min-p alone: one pass */
        exp_row_above(row, out, n, p->inverse_temperature, shift, p->log_min_p);
        return finish_dense(processor, out, n, block_sums_of(out, n, dense_blocks), uniform);
    }
    if (!(0 < p->top_k && p->top_k < n)) { /* top-p over the whole row: dense, as the min-p row */
        float cut_value;
        fs_index cut_id;
        exp_row(row, out, n, p->inverse_temperature, shift);
        const fs_index members = dense_nucleus_cut(processor, row, out, n, &cut_value, &cut_id);
        drop_later_ties(out, row, processor->work, processor->work_indices, members, cut_value, cut_id);
        mask_row(out, row, n, cut_value, p->inverse_temperature, shift, p->log_min_p);
        const double total = block_sums_of(out, n, dense_blocks);
        return finish_dense(processor, out, n, total, uniform);
    }
    Sparse *s = top_k_row(processor, row, n, shift);
    const double total = sparse_sums(s, n); /* >= 1: the most probable token stays, with e^0 */
    const fs_index token = uniform != NULL ? sparse_draw(s, total, *uniform) : 0;
    const float scale = (float)(1.0 / total);
    memset(out, 0, (size_t)n * sizeof *out);
    for (fs_index j = 0; j < s->count; j++) {
        s->weights[j] *= scale;
        out[s->indices[j]] = s->weights[j];
    }
    *support = s;
    return token;
}

/* np.argmax of row [n]: the first maximum, or the first NaN if there is one. */
static fs_index argmax_row(const float *row, fs_index n) {
    if (any_nan(row, n))
        for (fs_index i = 0; i < n; i++)
            if (row[i] != row[i]) return i;
    const float max = row_max(row, n);
    for (fs_index i = 0; i < n; i++)
        if (row[i] == max) return i;
    return 0;
}


/* The accept rule of rejection.rejection_sample over rows formed as the scan reaches them (fs_verify). */
static fs_index scan(fs_processor *processor, const fs_index *ids, fs_index k, const float *draft, const float *logits,
                     const double *uniforms, float *target, fs_index n, fs_context *context, fs_index *accepted) {
    Sparse *support;
    fs_index position = 0;
    for (; position < k; position++) {
        float *row = target + position * n;
        if (context != NULL) context->num_extras = position; /* row i penalizes x_1..x_i too */
        if (process_row(processor, logits + position * n, row, n, context, NULL, &support) < 0) return -1;
        if (uniforms[position] * (double)draft[position * n + ids[position]] < (double)row[ids[position]]) continue;
        *accepted = position;
        const float *draft_row = draft + position * n;
        return support != NULL ? sparse_residual_draw(support, draft_row, n, uniforms[k])
                               : residual_draw_row(row, draft_row, n, processor->dense_blocks, uniforms[k]);
    }
    *accepted = k;
    float *row = target + k * n;
    if (context != NULL) context->num_extras = k;
    if (process_row(processor, logits + k * n, row, n, context, NULL, &support) < 0) return -1;
    return support != NULL ? sparse_draw(support, sparse_sums(support, n), uniforms[k])
                           : draw_row(row, n, processor->dense_blocks, uniforms[k]);
}

/* ---- Entry points (sampling.h): arguments checked here, once per call ---- */

/* Whether [a, a + a_bytes) and [b, b + b_bytes) share a byte (compared as integers: pointers into different
 * objects may not be compared with < in C). */
static int overlaps(const void *a, size_t a_bytes, const void *b, size_t b_bytes) {
    if (a == NULL || b == NULL || a_bytes == 0 || b_bytes == 0) return 0;
    const uintptr_t a_start = (uintptr_t)a, b_start = (uintptr_t)b;
    return a_start < b_start + b_bytes && b_start < a_start + a_bytes;
}

static int valid_uniform(double uniform) { return uniform >= 0.0 && uniform < 1.0; }

/* The context a call's penalty reads (NULL: none, also when the penalty is 1, which changes no logit), its
 * ids checked against n and the written range [written, written + written_bytes). */
static fs_index check_context(const fs_processor *p, const fs_context *context, fs_index n, const void *written,
                              size_t written_bytes, const fs_context **used) {
    *used = NULL;
    if (context == NULL || p->settings.penalty == 1.0f) return 0;
    if (context->mask == NULL || context->count < 0 || context->num_extras < 0
        || (context->count > 0 && context->ids == NULL) || (context->num_extras > 0 && context->extras == NULL))
        return FS_ERROR_TOKEN;
    for (fs_index j = 0; j < context->count; j++)
        if (!(0 <= context->ids[j] && context->ids[j] < n)) return FS_ERROR_TOKEN;
    for (fs_index j = 0; j < context->num_extras; j++)
        if (!(0 <= context->extras[j] && context->extras[j] < n)) return FS_ERROR_TOKEN;
    if (overlaps(written, written_bytes, context->ids, (size_t)context->count * sizeof *context->ids)
        || overlaps(written, written_bytes, context->mask, (size_t)n)
        || overlaps(written, written_bytes, context->extras, (size_t)context->num_extras * sizeof *context->extras))
        return FS_ERROR_OVERLAP;
    *used = context;
    return 0;
}

fs_processor *fs_processor_new(const fs_settings *settings, int *error) {
    const fs_settings *s = settings;
    if (!(s->inverse_temperature >= 0.0 && isfinite(s->inverse_temperature)) || s->top_k < 0
        || !(s->top_p > 0.0 && s->top_p <= 1.0) || !(s->min_p >= 0.0 && s->min_p <= 1.0)
        || !(s->repetition_penalty > 0.0 && isfinite(s->repetition_penalty))) {
        *error = FS_ERROR_SETTINGS;
        return NULL;
    }
    fs_processor *p = calloc(1, sizeof *p);
    if (p == NULL) {
        *error = FS_ERROR_NO_MEMORY;
        return NULL;
    }
    p->settings = (Settings){(float)s->inverse_temperature, s->top_k, s->top_p,
                             s->min_p > 0.0 ? (float)log(s->min_p) : -INFINITY, (float)s->repetition_penalty};
    *error = 0;
    return p;
}

void fs_processor_free(fs_processor *p) {
    if (p == NULL) return;
    free(p->penalized);
    free(p->work);
    free(p->work_indices);
    free(p->keys);
    free(p->dense_blocks);
    free(p->maxima);
    free(p->chunks);
    free(p->histogram);
    free(p->sparse.indices);
    free(p->sparse.weights);
    free(p->sparse.block_starts);
    free(p->sparse.block_sums);
    free(p);
}

fs_index fs_sample(fs_processor *p, const float *logits, float *out, fs_index n, const fs_context *context,
                   const double *uniform) {
    if (n < 1) return FS_ERROR_EMPTY;
    if (p->settings.inverse_temperature == 0.0f) return FS_ERROR_GREEDY;
    if (uniform != NULL && !valid_uniform(*uniform)) return FS_ERROR_UNIFORM;
    const size_t bytes = (size_t)n * sizeof *out;
    if (overlaps(out, bytes, logits, bytes) || overlaps(out, bytes, uniform, sizeof *uniform)) return FS_ERROR_OVERLAP;
    const fs_context *used;
    fs_index error = check_context(p, context, n, out, bytes, &used);
    if (error < 0 || (error = ensure_scratch(p, n)) < 0) return error;
    Sparse *support;
    return process_row(p, logits, out, n, used, uniform, &support);
}

fs_index fs_argmax(fs_processor *p, const float *logits, fs_index n, const fs_context *context) {
    if (n < 1) return FS_ERROR_EMPTY;
    const fs_context *used;
    fs_index error = check_context(p, context, n, NULL, 0, &used);
    if (error < 0) return error;
    if (used == NULL) return argmax_row(logits, n);
    if ((error = ensure_scratch(p, n)) < 0) return error;
    penalize_into(logits, p->penalized, n, used, p->settings.penalty);
    return argmax_row(p->penalized, n);
}

fs_index fs_verify(fs_processor *p, const fs_index *draft_ids, fs_index k, const float *draft_probs,
                   const float *target_logits, const double *uniforms, float *target_probs, fs_index n,
                   const fs_context *context, fs_index *accepted) {
    if (k < 1 || n < 1) return FS_ERROR_EMPTY;
    if (p->settings.inverse_temperature == 0.0f) return FS_ERROR_GREEDY;
    for (fs_index i = 0; i < k; i++)
        if (!(0 <= draft_ids[i] && draft_ids[i] < n)) return FS_ERROR_TOKEN;
    for (fs_index i = 0; i <= k; i++)
        if (!valid_uniform(uniforms[i])) return FS_ERROR_UNIFORM;
    const size_t written = (size_t)(k + 1) * (size_t)n * sizeof *target_probs;
    if (overlaps(target_probs, written, draft_probs, (size_t)k * (size_t)n * sizeof *draft_probs)
        || overlaps(target_probs, written, target_logits, written)
        || overlaps(target_probs, written, uniforms, (size_t)(k + 1) * sizeof *uniforms)
        || overlaps(target_probs, written, draft_ids, (size_t)k * sizeof *draft_ids)
        || overlaps(target_probs, written, accepted, sizeof *accepted))
        return FS_ERROR_OVERLAP;
    fs_context with_drafts = {NULL, 0, NULL, NULL, 0};
    const fs_context *used = NULL;
    if (context != NULL) { /* the extras are the drafts, as far as each row reaches */
        with_drafts = *context;
        with_drafts.extras = draft_ids;
        with_drafts.num_extras = k;
    }
    fs_index error = check_context(p, context != NULL ? &with_drafts : NULL, n, target_probs, written, &used);
    if (error < 0 || (error = ensure_scratch(p, n)) < 0) return error;
    *accepted = 0;
    return scan(p, draft_ids, k, draft_probs, target_logits, uniforms, target_probs, n,
                used != NULL ? &with_drafts : NULL, accepted);
}

fs_index fs_draw(fs_processor *p, const float *weights, fs_index n, double uniform) {
    if (n < 1) return FS_ERROR_EMPTY;
    if (!valid_uniform(uniform)) return FS_ERROR_UNIFORM;
    const fs_index error = ensure_scratch(p, n);
    if (error < 0) return error;
    return draw_row(weights, n, p->dense_blocks, uniform);
}

fs_index fs_residual_draw(fs_processor *p, const float *target, const float *draft, fs_index n, double uniform) {
    if (n < 1) return FS_ERROR_EMPTY;
    if (!valid_uniform(uniform)) return FS_ERROR_UNIFORM;
    const fs_index error = ensure_scratch(p, n);
    if (error < 0) return error;
    return residual_draw_row(target, draft, n, p->dense_blocks, uniform);
}

const char *fs_error_message(fs_index error) {
    switch (error) {
    case FS_ERROR_NO_DISTRIBUTION: return "the row has no distribution (no positive entry: a NaN or an infinite logit)";
    case FS_ERROR_NO_MEMORY: return "out of memory";
    case FS_ERROR_OVERLAP: return "an output array overlaps an input array";
    case FS_ERROR_TOKEN: return "a token id is outside the vocabulary";
    case FS_ERROR_UNIFORM: return "uniforms must be in [0, 1)";
    case FS_ERROR_GREEDY: return "a greedy processor has no distribution (use argmax)";
    case FS_ERROR_SETTINGS: return "settings out of range: inverse_temperature >= 0, top_k >= 0, top_p in (0, 1], "
                                   "min_p in [0, 1], repetition_penalty > 0";
    case FS_ERROR_EMPTY: return "an empty row or no draft tokens";
    default: return error < 0 ? "unknown error" : "no error";
    }
}
