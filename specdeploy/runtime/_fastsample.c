/* The sampler's hot loop in C: processing a float32 logits row into its distribution, draws from it,
 * and the rejection scan of speculative sampling.
 *
 * Why: at temperature > 0 every draft token needs its processed distribution and a draw, and every
 * verify row the rejection scan reaches needs its distribution. In NumPy that is about 15 calls per
 * row (more with top-k / top-p); right after an ONNX Runtime pass has streamed the model's weights
 * through the cache, each call runs cold, and on the benchmark pair (8k vocabulary, 0.2 ms draft
 * steps) they cost a quarter of the step. Here it is one call and a few passes over the row.
 *
 * Layout: the softmax and two-level inverse-CDF draws over a dense row; processed rows (repetition
 * penalty, top-k by partial selection, top-p without sorting the row, min-p), formed on their
 * support alone when truncated; the Python glue (module functions, then the Processor type whose
 * sample / argmax / verify the runtime calls).
 *
 * The NumPy functions in sampling.py and rejection.py remain the definition; this module computes
 * the same quantities (tests compare the two) and the runtime uses it when it was built (it is
 * optional). Portable C99 plus GCC vector extensions where GCC compiles it: no intrinsics, no
 * fast-math; loops are written in 16 independent lanes so that compilers vectorize them without
 * reassociating anything (GCC needs -fno-trapping-math to turn the selects into blends; setup.py
 * passes it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(_MSC_VER)
#define restrict __restrict
#endif

#define LANES 16
#define BLOCK 64 /* positions per block of the two-level draw (a multiple of LANES) */
#define STACK_BLOCKS 4096 /* vocabularies up to 262,144 keep their block sums on the stack */

/* e^x for x <= 0, within ~2 ulp (the Cephes expf polynomial); 0 below -87 (the result is below
 * FLT_MIN there, and every caller divides by a sum that holds at least e^0 = 1); NaN for NaN. */
static inline float exp_nonpositive(float x) {
    const float clamped = x >= -87.0f ? x : -87.0f; /* NaN too: no NaN reaches the integer conversion */
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
    const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n, n in [-126, 0] */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x >= -87.0f ? p * scale : (x != x ? x : 0.0f);
}

/* Row passes are compiled for AVX-512, AVX2 and the baseline, and glibc's ifuncs pick one at load
 * time (GCC on x86-64); other compilers and CPUs get one portable build (NEON on aarch64 vectorizes
 * the same loops). No fp contraction (setup.py passes -ffp-contract=off) and a fixed lane layout:
 * every build computes the same bits. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__x86_64__) && defined(__GLIBC__)
#define ROW_PASS __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ROW_PASS
#endif

#if defined(__GNUC__)
/* GCC does not vectorize the lane loop below (it keeps 16 scalar maxima); written with vector
 * extensions it is one vector max per 16 floats: 0.65 us instead of 1.4 us on an 8k row. The result
 * is the same either way (a maximum does not depend on the order it was taken in). */
typedef float FloatLanes __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t MaskLanes __attribute__((vector_size(LANES * sizeof(int32_t))));

ROW_PASS static float row_max(const float *restrict row, Py_ssize_t n) {
    FloatLanes lanes;
    for (int l = 0; l < LANES; l++) lanes[l] = row[0];
    Py_ssize_t i = 0;
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
static float row_max(const float *restrict row, Py_ssize_t n) {
    float lanes[LANES];
    for (int l = 0; l < LANES; l++) lanes[l] = row[0];
    Py_ssize_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) lanes[l] = row[i + l] > lanes[l] ? row[i + l] : lanes[l];
    float best = lanes[0];
    for (int l = 1; l < LANES; l++) best = lanes[l] > best ? lanes[l] : best;
    for (; i < n; i++) best = row[i] > best ? row[i] : best;
    return best;
}
#endif

/* out = exp(logits * inverse_temperature - shift) */
ROW_PASS static void exp_row(const float *restrict logits, float *restrict out, Py_ssize_t n, float inverse_temperature,
                             float shift) {
    for (Py_ssize_t i = 0; i < n; i++) out[i] = exp_nonpositive(logits[i] * inverse_temperature - shift);
}

ROW_PASS static void scale_row(float *restrict row, Py_ssize_t n, float scale) {
    for (Py_ssize_t i = 0; i < n; i++) row[i] *= scale;
}

/* block_sums[b] = the sum of the weights of block b (positions [b * BLOCK, (b + 1) * BLOCK)), where
 * the weight at i is WEIGHT(i); returns the total. In double, as the scan inside a block adds: with
 * float block sums, rounding gave the mass between a block's float and exact sums (up to ~4e-8) to
 * the block's last token. The lanes of a block are added pairwise (lane l + lane l + 8, then + 4, ...),
 * not one after another: 1.05 us instead of 1.4 us on an 8k row. */
#define BLOCK_SUMS(WEIGHT)                                                  \
    double total = 0.0;                                                     \
    Py_ssize_t b = 0, start = 0;                                            \
    for (; start + BLOCK <= n; b++, start += BLOCK) {                       \
        double lanes[LANES] = {0};                                          \
        for (Py_ssize_t i = start; i < start + BLOCK; i += LANES)           \
            for (int l = 0; l < LANES; l++) lanes[l] += WEIGHT(i + l);      \
        for (int width = LANES / 2; width > 0; width /= 2)                  \
            for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];   \
        block_sums[b] = lanes[0];                                           \
        total += lanes[0];                                                  \
    }                                                                       \
    if (start < n) {                                                        \
        double sum = 0.0;                                                   \
        for (Py_ssize_t i = start; i < n; i++) sum += WEIGHT(i);            \
        block_sums[b] = sum;                                                \
        total += sum;                                                       \
    }                                                                       \
    return total

#define PLAIN(i) weights[i]
#define RESIDUAL(i) (target[i] > draft[i] ? target[i] - draft[i] : 0.0f)

ROW_PASS static double block_sums_of(const float *restrict weights, Py_ssize_t n, double *restrict block_sums) {
    BLOCK_SUMS(PLAIN);
}

/* The same for the residual max(0, target - draft) of speculative sampling, which is never stored. */
ROW_PASS static double residual_block_sums(const float *restrict target, const float *restrict draft, Py_ssize_t n,
                                           double *restrict block_sums) {
    BLOCK_SUMS(RESIDUAL);
}

static Py_ssize_t draw_blocks(const float *weights, Py_ssize_t n, const double *block_sums, double total, double uniform);

/* out = softmax(logits * inverse_temperature), in NumPy's order of operations (sampling.softmax_row:
 * scale, subtract the scaled maximum, exp, multiply by the reciprocal of the sum); block_sums is scratch.
 * With a uniform, also returns the token it draws from the row: from the exponentials before they are
 * divided by their sum (the same distribution), whose block sums the normalization computed anyway,
 * rather than a second pass over the normalized row. Else returns 0. */
static Py_ssize_t softmax_row(const float *logits, float *out, Py_ssize_t n, float inverse_temperature,
                              double *block_sums, const double *uniform) {
    exp_row(logits, out, n, inverse_temperature, row_max(logits, n) * inverse_temperature);
    const double total = block_sums_of(out, n, block_sums); /* >= 1: the maximum contributes e^0 */
    Py_ssize_t token = 0;
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
        Py_ssize_t last_positive = -1;                            \
        for (Py_ssize_t i = start; i < end; i++) {                \
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
static Py_ssize_t pick_block(const double *block_sums, Py_ssize_t num_blocks, double *point) {
    double before = 0.0;
    Py_ssize_t last_positive = -1;
    for (Py_ssize_t b = 0; b < num_blocks; b++) {
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

static Py_ssize_t scan_weights(const float *weights, Py_ssize_t start, Py_ssize_t end, double point) {
    SCAN(weights[i]);
}

static Py_ssize_t scan_residual(const float *target, const float *draft, Py_ssize_t start, Py_ssize_t end,
                                double point) {
    SCAN(RESIDUAL(i));
}

static Py_ssize_t num_blocks_of(Py_ssize_t n) { return (n + BLOCK - 1) / BLOCK; }

static Py_ssize_t num_chunks_of(Py_ssize_t n) { return (n + LANES - 1) / LANES; }

/* Two-level inverse-CDF draw from non-negative weights with known block sums. */
static Py_ssize_t draw_blocks(const float *weights, Py_ssize_t n, const double *block_sums, double total, double uniform) {
    double point = uniform * total;
    const Py_ssize_t block = pick_block(block_sums, num_blocks_of(n), &point);
    if (block < 0) return -1;
    const Py_ssize_t start = block * BLOCK, end = start + BLOCK < n ? start + BLOCK : n;
    return scan_weights(weights, start, end, point);
}

/* The inverse-CDF draw from non-negative weights (not necessarily normalized); -1 if all are zero. */
static Py_ssize_t draw_row(const float *weights, Py_ssize_t n, double *blocks, double uniform) {
    const double total = block_sums_of(weights, n, blocks);
    return draw_blocks(weights, n, blocks, total, uniform);
}

/* A draw from normalize(max(0, target - draft)); from target if that has no mass. */
static Py_ssize_t residual_draw_row(const float *target, const float *draft, Py_ssize_t n, double *blocks,
                                    double uniform) {
    const double total = residual_block_sums(target, draft, n, blocks);
    if (!(total > 0.0)) return draw_row(target, n, blocks, uniform); /* the rows are equal up to rounding */
    double point = uniform * total;
    const Py_ssize_t block = pick_block(blocks, num_blocks_of(n), &point);
    const Py_ssize_t start = block * BLOCK, end = start + BLOCK < n ? start + BLOCK : n;
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
    Py_ssize_t count;         /* tokens in the support */
    Py_ssize_t *indices;      /* [count] ascending token ids */
    float *weights;           /* [count] their weights (exponentials, then probabilities) */
    Py_ssize_t num_blocks;    /* blocks of BLOCK positions the support touches */
    Py_ssize_t *block_starts; /* [num_blocks + 1]: where each touched block's tokens start in indices */
    double *block_sums;       /* [num_blocks] */
} Sparse;

/* Scratch of the processing calls, grown to the largest vocabulary seen; the GIL is held throughout a
 * call, so one set serves every call. */
static struct {
    Py_ssize_t capacity;
    float *penalized;          /* [n] the penalized logits */
    float *work;               /* [n] selection scratch */
    Py_ssize_t *work_indices;  /* [n] */
    uint32_t *keys;            /* [n] order keys (top-k's selection) */
    double *dense_blocks;      /* [blocks] block sums of dense rows */
    float *maxima;             /* [chunks] chunk maxima */
    Py_ssize_t *chunks;        /* [chunks] chunk numbers (top-k's candidates) */
    Sparse sparse;
} scratch;

static int ensure_scratch(Py_ssize_t n) {
    if (n <= scratch.capacity) return 0;
    const size_t count = (size_t)n, blocks = (size_t)num_blocks_of(n), chunks = (size_t)num_chunks_of(n);
    /* Each field's address and the size it grows to; the pointers are read and written with memcpy, which any
     * pointer type allows (a cast to void ** would read a float * through another type). */
    struct {
        void *field;
        size_t bytes;
    } parts[] = {
        {&scratch.penalized, count * sizeof(float)},
        {&scratch.work, count * sizeof(float)},
        {&scratch.work_indices, count * sizeof(Py_ssize_t)},
        {&scratch.keys, count * sizeof(uint32_t)},
        {&scratch.dense_blocks, blocks * sizeof(double)},
        {&scratch.maxima, chunks * sizeof(float)},
        {&scratch.chunks, chunks * sizeof(Py_ssize_t)},
        {&scratch.sparse.indices, count * sizeof(Py_ssize_t)},
        {&scratch.sparse.weights, count * sizeof(float)},
        {&scratch.sparse.block_starts, (count + 1) * sizeof(Py_ssize_t)},
        {&scratch.sparse.block_sums, count * sizeof(double)},
    };
    /* A failed realloc leaves its block as it was: keep whatever succeeded, report the failure. */
    int failed = 0;
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        void *old;
        memcpy(&old, parts[i].field, sizeof old);
        void *grown = PyMem_Realloc(old, parts[i].bytes);
        if (grown == NULL) failed = 1;
        else memcpy(parts[i].field, &grown, sizeof grown);
    }
    if (failed) {
        PyErr_NoMemory();
        return -1;
    }
    scratch.capacity = n;
    return 0;
}

/* The context a row's repetition penalty reads: the distinct context tokens, and tokens drafted after it. */
typedef struct {
    const int64_t *ids;      /* [count] distinct */
    Py_ssize_t count;
    const uint8_t *mask;     /* [n]: 1 where a token is among ids */
    const Py_ssize_t *extras; /* [num_extras] drafted after the context, repeats allowed */
    Py_ssize_t num_extras;
} Context;

static inline float penalized(float logit, float penalty) { return logit < 0.0f ? logit * penalty : logit / penalty; }

/* out = logits with HF's repetition penalty on every token of the context (each once). */
static void penalize_into(const float *logits, float *out, Py_ssize_t n, const Context *context, float penalty) {
    memcpy(out, logits, (size_t)n * sizeof *out);
    for (Py_ssize_t j = 0; j < context->count; j++) out[context->ids[j]] = penalized(out[context->ids[j]], penalty);
    for (Py_ssize_t j = 0; j < context->num_extras; j++) {
        const Py_ssize_t token = context->extras[j];
        int seen = context->mask[token];
        for (Py_ssize_t i = 0; i < j && !seen; i++) seen = context->extras[i] == token;
        if (!seen) out[token] = penalized(out[token], penalty);
    }
}

/* The maximum of row [n], or NaN when the row holds a NaN: a truncated row's check, in one pass. */
#if defined(__GNUC__)
ROW_PASS static float checked_max(const float *restrict row, Py_ssize_t n) {
    FloatLanes lanes;
    for (int l = 0; l < LANES; l++) lanes[l] = -INFINITY;
    MaskLanes nan = {0};
    Py_ssize_t i = 0;
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
static float checked_max(const float *restrict row, Py_ssize_t n) {
    float best = -INFINITY;
    int found = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        best = row[i] > best ? row[i] : best;
        found |= row[i] != row[i];
    }
    return found ? NAN : best;
}
#endif

ROW_PASS static int any_nan(const float *restrict row, Py_ssize_t n) {
    int found = 0;
    for (Py_ssize_t i = 0; i < n; i++) found |= row[i] != row[i];
    return found;
}

/* The largest of the LANES values at x (no NaN): in vector registers with GCC (a max with the lanes
 * swapped in halves, quarters, ...), so that a row's chunk maxima cost about one pass over it. */
#if defined(__GNUC__)
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

ROW_PASS static Py_ssize_t count_at_least(const uint32_t *restrict keys, Py_ssize_t count, uint32_t threshold) {
    uint32_t reached = 0; /* count < 2^32: a row's length */
    for (Py_ssize_t i = 0; i < count; i++) reached += keys[i] >= threshold;
    return (Py_ssize_t)reached;
}

/* keys [return] = the keys [count] in [low, high], in order; *above += the number of keys above high
 * (branch-free). */
static Py_ssize_t keep_window(uint32_t *keys, Py_ssize_t count, uint32_t low, uint32_t high, Py_ssize_t *above) {
    Py_ssize_t kept = 0, over = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
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
static uint32_t kth_key(uint32_t *keys, Py_ssize_t count, Py_ssize_t k, uint32_t least, uint32_t largest) {
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
            Py_ssize_t above = 0; /* keys beyond the open bits: they rank before the k-th */
            count = keep_window(keys, count, result, result | ((1u << bit) - 1u), &above);
            k -= above;
        }
    }
    return result;
}

/* maxima [num_chunks_of(n)] = the largest value of each chunk of LANES values of row [n] (no NaN). */
ROW_PASS static void chunk_maxima(const float *restrict row, Py_ssize_t n, float *restrict maxima) {
    Py_ssize_t c = 0, start = 0;
    for (; start + LANES <= n; c++, start += LANES) maxima[c] = chunk_max(row + start);
    if (start < n) {
        float best = row[start];
        for (Py_ssize_t i = start + 1; i < n; i++) best = row[i] > best ? row[i] : best;
        maxima[c] = best;
    }
}

/* chunks [return] = the numbers of the chunks whose maximum (maxima [num_chunks]) reaches threshold,
 * ascending; branch-free, so that the loops over them branch only on their count. */
static Py_ssize_t chunks_at_least(const float *maxima, Py_ssize_t num_chunks, float threshold, Py_ssize_t *chunks) {
    Py_ssize_t count = 0;
    for (Py_ssize_t c = 0; c < num_chunks; c++) {
        chunks[count] = c;
        count += maxima[c] >= threshold;
    }
    return count;
}

/* The k-th largest of row [n] (1 <= k < n; no NaN), by partial selection. The k-th largest of the chunks'
 * maxima is a lower bound (k values reach it), so only the chunks whose maximum reaches it can hold the
 * k largest values; their values at or above it are few, and one selection over them finds the k-th.
 * chunks [*num_listed] = those chunks (chunks_at_least's); keys [n] is scratch. */
static float kth_largest(const float *row, Py_ssize_t n, Py_ssize_t k, const float *maxima, Py_ssize_t *chunks,
                         Py_ssize_t *num_listed, uint32_t *keys) {
    const Py_ssize_t num_chunks = num_chunks_of(n);
    float bound = -INFINITY, max = -INFINITY;
    for (Py_ssize_t c = 0; c < num_chunks; c++) max = maxima[c] > max ? maxima[c] : max;
    if (k <= num_chunks) {
        for (Py_ssize_t c = 0; c < num_chunks; c++) keys[c] = order_key(maxima[c]);
        bound = from_order_key(kth_key(keys, num_chunks, k, order_key(-INFINITY), order_key(max == 0.0f ? 0.0f : max)));
    }
    *num_listed = chunks_at_least(maxima, num_chunks, bound, chunks);
    Py_ssize_t count = 0;
    for (Py_ssize_t j = 0; j < *num_listed; j++) {
        const Py_ssize_t c = chunks[j], end = (c + 1) * LANES < n ? (c + 1) * LANES : n;
        for (Py_ssize_t i = c * LANES; i < end; i++) { /* branch-free: any of a chunk's values may pass */
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
static Py_ssize_t collect_at_least(const float *row, Py_ssize_t n, float threshold, const Py_ssize_t *chunks,
                                   Py_ssize_t num_listed, Py_ssize_t *indices) {
    Py_ssize_t count = 0;
    for (Py_ssize_t j = 0; j < num_listed; j++) {
        const Py_ssize_t c = chunks[j], end = (c + 1) * LANES < n ? (c + 1) * LANES : n;
        for (Py_ssize_t i = c * LANES; i < end; i++) {
            indices[count] = i;
            count += row[i] >= threshold;
        }
    }
    return count;
}

/* Whether token (weight, id) ranks before (other_weight, other_id): more probable, or as probable and a lower id. */
static inline int ranks_before(float weight, Py_ssize_t id, float other_weight, Py_ssize_t other_id) {
    return weight > other_weight || (weight == other_weight && id < other_id);
}

/* The nucleus's last token: ranking (values, ids) [count], the last one whose preceding mass is below
 * target (the first always is: target > 0). A selection by mass: partition around a pivot, and
 * continue in the part that holds the cut, O(count) on average. values and ids are reordered. */
static void nucleus_cut(float *values, Py_ssize_t *ids, Py_ssize_t count, double target, float *cut_value,
                        Py_ssize_t *cut_id) {
    Py_ssize_t low = 0, high = count; /* the cut lies in [low, high) */
    double before = 0.0;              /* mass of the tokens ranked before low: below target */
#define SWAP(a, b)                                                                      \
    do {                                                                                \
        const float v = values[a]; values[a] = values[b]; values[b] = v;                \
        const Py_ssize_t t = ids[a]; ids[a] = ids[b]; ids[b] = t;                       \
    } while (0)
    while (high - low > 16) {
        const Py_ssize_t middle = low + (high - low) / 2, last = high - 1;
        /* median of three to the end, as the pivot */
        if (ranks_before(values[middle], ids[middle], values[low], ids[low])) SWAP(middle, low);
        if (ranks_before(values[last], ids[last], values[low], ids[low])) SWAP(last, low);
        if (ranks_before(values[middle], ids[middle], values[last], ids[last])) SWAP(middle, last);
        const float pivot = values[last];
        const Py_ssize_t pivot_id = ids[last];
        Py_ssize_t store = low;
        double mass = 0.0;
        for (Py_ssize_t i = low; i < last; i++)
            if (ranks_before(values[i], ids[i], pivot, pivot_id)) {
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
    for (Py_ssize_t i = low + 1; i < high; i++) /* insertion sort of the few left */
        for (Py_ssize_t j = i; j > low && ranks_before(values[j], ids[j], values[j - 1], ids[j - 1]); j--) SWAP(j, j - 1);
#undef SWAP
    *cut_value = values[low];
    *cut_id = ids[low];
    for (Py_ssize_t i = low; i < high && before < target; i++) {
        *cut_value = values[i];
        *cut_id = ids[i];
        before += values[i];
    }
}

/* Keeps the support's tokens that rank no later than the nucleus's last token (in token order). */
static void keep_nucleus(Sparse *s, double target) {
    float *values = scratch.work;
    Py_ssize_t *ids = scratch.work_indices;
    memcpy(values, s->weights, (size_t)s->count * sizeof *values);
    memcpy(ids, s->indices, (size_t)s->count * sizeof *ids);
    float cut_value;
    Py_ssize_t cut_id;
    nucleus_cut(values, ids, s->count, target, &cut_value, &cut_id);
    Py_ssize_t kept = 0;
    for (Py_ssize_t j = 0; j < s->count; j++)
        if (!ranks_before(cut_value, cut_id, s->weights[j], s->indices[j])) {
            s->indices[kept] = s->indices[j];
            s->weights[kept++] = s->weights[j];
        }
    s->count = kept;
}

/* Keeps the support's tokens whose scaled logit row * inverse - shift is >= log_min_p (min-p). */
static void keep_min_p(Sparse *s, const float *row, float inverse, float shift, float log_min_p) {
    Py_ssize_t kept = 0;
    for (Py_ssize_t j = 0; j < s->count; j++)
        if (row[s->indices[j]] * inverse - shift >= log_min_p) {
            s->indices[kept] = s->indices[j];
            s->weights[kept++] = s->weights[j];
        }
    s->count = kept;
}

/* The block sums of a support's weights WEIGHT(j), as BLOCK_SUMS adds them over the dense row. */
#define SPARSE_SUMS(WEIGHT)                                                                    \
    double total = 0.0;                                                                        \
    Py_ssize_t j = 0, b = 0;                                                                   \
    while (j < s->count) {                                                                     \
        const Py_ssize_t limit = (s->indices[j] / BLOCK + 1) * BLOCK;                          \
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
    const Py_ssize_t block = pick_block(s->block_sums, s->num_blocks, &point);                 \
    if (block < 0) return -1;                                                                  \
    double running = 0.0;                                                                      \
    Py_ssize_t last_positive = -1;                                                             \
    for (Py_ssize_t j = s->block_starts[block]; j < s->block_starts[block + 1]; j++) {         \
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

static double sparse_sums(Sparse *s, Py_ssize_t n) { SPARSE_SUMS(SPARSE_PLAIN); }

static double sparse_residual_sums(Sparse *s, const float *draft, Py_ssize_t n) { SPARSE_SUMS(SPARSE_RESIDUAL); }

static Py_ssize_t sparse_draw(const Sparse *s, double total, double uniform) { SPARSE_DRAW(SPARSE_PLAIN); }

static Py_ssize_t sparse_residual_scan(const Sparse *s, const float *draft, double total, double uniform) {
    SPARSE_DRAW(SPARSE_RESIDUAL);
}

/* residual_draw_row with the target row's support: the residual is zero off it. */
static Py_ssize_t sparse_residual_draw(Sparse *s, const float *draft, Py_ssize_t n, double uniform) {
    const double total = sparse_residual_sums(s, draft, n);
    if (!(total > 0.0)) return sparse_draw(s, sparse_sums(s, n), uniform); /* the rows are equal up to rounding */
    return sparse_residual_scan(s, draft, total, uniform);
}

/* out = exp(logits * inverse_temperature - shift) where that exponent is >= floor, else 0 (min-p). */
ROW_PASS static void exp_row_above(const float *restrict logits, float *restrict out, Py_ssize_t n,
                                   float inverse_temperature, float shift, float floor) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const float scaled = logits[i] * inverse_temperature - shift;
        out[i] = scaled >= floor ? exp_nonpositive(scaled) : 0.0f;
    }
}

static Py_ssize_t no_distribution(float *out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) out[i] = NAN;
    return -1;
}

typedef struct {
    float inverse_temperature; /* 0: greedy (argmax only) */
    Py_ssize_t top_k;          /* 0: off */
    double top_p;              /* 1: off */
    float log_min_p;           /* -inf: off */
    float penalty;             /* 1: off */
} Settings;

/* A top-k row: its support by partial selection, then the nucleus and min-p within it; the support's
 * exponentials, from row [n] (no NaN, finite max). */
static Sparse *top_k_row(const Settings *p, const float *row, Py_ssize_t n, float shift) {
    Sparse *s = &scratch.sparse;
    const float inverse = p->inverse_temperature;
    chunk_maxima(row, n, scratch.maxima);
    Py_ssize_t num_listed;
    const float kth = kth_largest(row, n, p->top_k, scratch.maxima, scratch.chunks, &num_listed, scratch.keys);
    s->count = collect_at_least(row, n, kth, scratch.chunks, num_listed, s->indices);
    for (Py_ssize_t j = 0; j < s->count; j++) s->weights[j] = exp_nonpositive(row[s->indices[j]] * inverse - shift);
    if (p->top_p < 1.0) keep_nucleus(s, p->top_p * sparse_sums(s, n));
    if (p->log_min_p > -INFINITY) keep_min_p(s, row, inverse, shift, p->log_min_p);
    return s;
}

#define KEY_SHIFT 20 /* a weight's bucket: its float's exponent and 3 leading mantissa bits (2^(1/8) apart) */
#define MAX_BUCKETS 1024
#define HISTOGRAMS 4 /* interleaved, so that neighbouring tokens in one bucket do not wait on each other */

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
#if defined(__GNUC__)
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
ROW_PASS static Py_ssize_t bucket_members(const float *restrict weights, Py_ssize_t n, int32_t low, int32_t bucket,
                                          float *restrict values, Py_ssize_t *restrict ids) {
    Py_ssize_t count = 0, i = 0;
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
static Py_ssize_t dense_nucleus_cut(const float *weights, Py_ssize_t n, double top_p, float *cut_value, Py_ssize_t *cut_id) {
    static double histogram[HISTOGRAMS * MAX_BUCKETS];
    const int32_t low = weight_key((float)((1.0 - top_p) / (double)n * (1.0 - 1e-6)));
    const Py_ssize_t buckets = weight_key(1.0f) - low + 1; /* <= 1017: weights are in [0, 1] */
    memset(histogram, 0, sizeof(double) * HISTOGRAMS * (size_t)buckets);
    Py_ssize_t i = 0;
    for (; i + HISTOGRAMS <= n; i += HISTOGRAMS)
        for (int h = 0; h < HISTOGRAMS; h++) histogram[h * buckets + bucket_of(weights[i + h], low)] += weights[i + h];
    for (; i < n; i++) histogram[bucket_of(weights[i], low)] += weights[i];
    double total = 0.0;
    for (Py_ssize_t b = 0; b < buckets; b++) {
        for (int h = 1; h < HISTOGRAMS; h++) histogram[b] += histogram[h * buckets + b];
        total += histogram[b];
    }
    const double target = top_p * total;
    double before = 0.0; /* mass of the buckets above the cut's */
    Py_ssize_t bucket = buckets - 1;
    for (; bucket > 0 && before + histogram[bucket] < target; bucket--) before += histogram[bucket];
    Py_ssize_t count = bucket_members(weights, n, low, (int32_t)bucket, scratch.work, scratch.work_indices);
    /* Rounding can carry the scan (top_p within a few ulps of 1) down to an empty lowest bucket: the cut is
     * then the last token of the lowest bucket that has any, every token being kept. */
    while (count == 0 && bucket < buckets - 1) {
        bucket++;
        before -= histogram[bucket];
        count = bucket_members(weights, n, low, (int32_t)bucket, scratch.work, scratch.work_indices);
    }
    nucleus_cut(scratch.work, scratch.work_indices, count, target - before, cut_value, cut_id);
    return count;
}

/* Zeroes the weights tied with the nucleus's last token that rank after it (a higher id): they share its
 * bucket, whose members (values, ids) [count] dense_nucleus_cut left in scratch. The masking pass then
 * keeps every weight at or above the cut's value, with no id to compare per token. */
static void drop_later_ties(float *out, const float *values, const Py_ssize_t *ids, Py_ssize_t count, float cut_value,
                            Py_ssize_t cut_id) {
    for (Py_ssize_t j = 0; j < count; j++)
        if (values[j] == cut_value && ids[j] > cut_id) out[ids[j]] = 0.0f;
}

/* out [n] = the weights at or above the cut's value (the nucleus, once drop_later_ties has run) that min-p
 * keeps too (log_min_p -inf: every one), else 0. Their block sums are block_sums_of's pass: with the sums in
 * the same loop, the stores kept GCC 12 from vectorizing it under -fwrapv, which Python's build flags pass
 * (8x slower on an 8k row). */
ROW_PASS static void mask_row(float *restrict out, const float *restrict row, Py_ssize_t n, float cut_value,
                              float inverse, float shift, float log_min_p) {
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = out[i] >= cut_value && row[i] * inverse - shift >= log_min_p ? out[i] : 0.0f;
}

/* Normalizes a dense row of weights out [n] (the most probable one 1) whose block sums and total are known;
 * with a uniform, returns the token it draws from them first (as softmax_row does), else 0. */
static Py_ssize_t finish_dense(float *out, Py_ssize_t n, double total, const double *uniform) {
    const Py_ssize_t token = uniform != NULL ? draw_blocks(out, n, scratch.dense_blocks, total, *uniform) : 0;
    scale_row(out, n, (float)(1.0 / total));
    return token;
}

/* out [n] = the processed distribution of logits [n] (sampling.process_row), with the context's penalty
 * when context is not NULL. With a uniform, returns the token it draws from the row's weights before
 * they are normalized (as softmax_row does), else 0; -1 when the row has no distribution (a NaN or an
 * infinite logit; out is then NaN). *support is the truncated row's support (its weights normalized,
 * as out holds them), or NULL when the row is dense. */
static Py_ssize_t process_row(const Settings *p, const float *logits, float *out, Py_ssize_t n, const Context *context,
                              const double *uniform, Sparse **support) {
    const float *row = logits;
    if (context != NULL) {
        penalize_into(logits, scratch.penalized, n, context, p->penalty);
        row = scratch.penalized;
    }
    *support = NULL;
    const int truncated = (0 < p->top_k && p->top_k < n) || p->top_p < 1.0;
    if (!truncated && p->log_min_p == -INFINITY) return softmax_row(row, out, n, p->inverse_temperature, scratch.dense_blocks, uniform);
    const float max = checked_max(row, n);
    if (!isfinite(max)) return no_distribution(out, n); /* a NaN or an infinite logit, or every logit -inf */
    const float shift = max * p->inverse_temperature;
    if (!isfinite(shift)) return no_distribution(out, n); /* logits / temperature overflow float32 */
    if (!truncated) { /* min-p alone: one pass */
        exp_row_above(row, out, n, p->inverse_temperature, shift, p->log_min_p);
        return finish_dense(out, n, block_sums_of(out, n, scratch.dense_blocks), uniform);
    }
    if (!(0 < p->top_k && p->top_k < n)) { /* top-p over the whole row: dense, as the min-p row */
        float cut_value;
        Py_ssize_t cut_id;
        exp_row(row, out, n, p->inverse_temperature, shift);
        const Py_ssize_t members = dense_nucleus_cut(out, n, p->top_p, &cut_value, &cut_id);
        drop_later_ties(out, scratch.work, scratch.work_indices, members, cut_value, cut_id);
        mask_row(out, row, n, cut_value, p->inverse_temperature, shift, p->log_min_p);
        const double total = block_sums_of(out, n, scratch.dense_blocks);
        return finish_dense(out, n, total, uniform);
    }
    Sparse *s = top_k_row(p, row, n, shift);
    const double total = sparse_sums(s, n); /* >= 1: the most probable token stays, with e^0 */
    const Py_ssize_t token = uniform != NULL ? sparse_draw(s, total, *uniform) : 0;
    const float scale = (float)(1.0 / total);
    memset(out, 0, (size_t)n * sizeof *out);
    for (Py_ssize_t j = 0; j < s->count; j++) {
        s->weights[j] *= scale;
        out[s->indices[j]] = s->weights[j];
    }
    *support = s;
    return token;
}

/* np.argmax of row [n]: the first maximum, or the first NaN if there is one. */
static Py_ssize_t argmax_row(const float *row, Py_ssize_t n) {
    if (any_nan(row, n))
        for (Py_ssize_t i = 0; i < n; i++)
            if (row[i] != row[i]) return i;
    const float max = row_max(row, n);
    for (Py_ssize_t i = 0; i < n; i++)
        if (row[i] == max) return i;
    return 0;
}

/* ---- Python glue: arrays come through the buffer protocol, C-contiguous ---- */

typedef struct {
    Py_buffer view;
    int held;
} Buffer;

/* A C-contiguous non-empty array of ndim dimensions and struct format ("f": float32, "d": float64). */
static int get_buffer(PyObject *obj, Buffer *buffer, int ndim, const char *format, int writable, const char *name) {
    const int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    const char *type = format[0] == 'f' ? "float32" : "float64";
    if (PyObject_GetBuffer(obj, &buffer->view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a %scontiguous %s array", name, writable ? "writable " : "", type);
        return -1;
    }
    buffer->held = 1;
    const char *got = buffer->view.format == NULL ? "B" : buffer->view.format;
    if (got[0] == '<' || got[0] == '=' || got[0] == '@') got++;
    if (buffer->view.ndim != ndim || strcmp(got, format) != 0 || buffer->view.len == 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a non-empty %d-D %s array", name, ndim, type);
        return -1;
    }
    return 0;
}

static void release(Buffer *buffers, int count) {
    for (int i = 0; i < count; i++)
        if (buffers[i].held) PyBuffer_Release(&buffers[i].view);
}

static int same_length(Buffer *a, Buffer *b) {
    if (a->view.shape[a->view.ndim - 1] == b->view.shape[b->view.ndim - 1]) return 0;
    PyErr_SetString(PyExc_ValueError, "the rows differ in length");
    return -1;
}

static int check_uniform(double uniform) {
    if (uniform >= 0.0 && uniform < 1.0) return 0;
    PyErr_SetString(PyExc_ValueError, "uniforms must be in [0, 1)");
    return -1;
}

static int get_uniform(PyObject *obj, double *uniform) {
    *uniform = PyFloat_AsDouble(obj);
    if (*uniform == -1.0 && PyErr_Occurred()) return -1;
    return check_uniform(*uniform);
}

static int get_inverse_temperature(PyObject *obj, float *inverse) {
    const double value = PyFloat_AsDouble(obj);
    if (value == -1.0 && PyErr_Occurred()) return -1;
    if (!(value > 0.0 && isfinite(value))) {
        PyErr_SetString(PyExc_ValueError, "inverse_temperature must be positive and finite");
        return -1;
    }
    *inverse = (float)value;
    return 0;
}

/* Block sums live on the stack for ordinary vocabularies, on the heap beyond. */
static double *block_buffer(double *stack, Py_ssize_t n) {
    const Py_ssize_t blocks = num_blocks_of(n);
    if (blocks <= STACK_BLOCKS) return stack;
    double *heap = PyMem_Malloc(sizeof(double) * (size_t)blocks);
    if (heap == NULL) PyErr_NoMemory();
    return heap;
}

static void free_blocks(double *blocks, double *stack) {
    if (blocks != stack) PyMem_Free(blocks);
}

static PyObject *token_or_error(Py_ssize_t token, const char *what) {
    if (token >= 0) return PyLong_FromSsize_t(token);
    PyErr_Format(PyExc_ValueError, "%s have no positive entry", what);
    return NULL;
}

/* softmax(logits, out, inverse_temperature, uniform=None): out = softmax(logits * inverse_temperature);
 * with a uniform, also returns the token the inverse CDF draws at that uniform from the row's
 * exponentials, just before they are normalized into out (see softmax_row). */
static PyObject *fs_softmax(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "softmax(logits, out, inverse_temperature, uniform=None)");
        return NULL;
    }
    Buffer buffers[2] = {{.held = 0}, {.held = 0}};
    float inverse;
    double uniform = 0.0;
    const int draw = nargs == 4 && args[3] != Py_None;
    double stack[STACK_BLOCKS], *blocks = NULL;
    if (get_buffer(args[0], &buffers[0], 1, "f", 0, "logits") < 0 || get_buffer(args[1], &buffers[1], 1, "f", 1, "out") < 0
        || same_length(&buffers[0], &buffers[1]) < 0 || get_inverse_temperature(args[2], &inverse) < 0
        || (draw && get_uniform(args[3], &uniform) < 0)
        || (blocks = block_buffer(stack, buffers[0].view.shape[0])) == NULL) {
        release(buffers, 2);
        return NULL;
    }
    const Py_ssize_t n = buffers[0].view.shape[0];
    float *out = buffers[1].view.buf;
    const Py_ssize_t token = softmax_row(buffers[0].view.buf, out, n, inverse, blocks, draw ? &uniform : NULL);
    free_blocks(blocks, stack);
    release(buffers, 2);
    if (!draw) Py_RETURN_NONE;
    return token_or_error(token, "probabilities");
}

/* draw(weights, uniform): the inverse-CDF draw from non-negative weights (not necessarily normalized). */
static PyObject *fs_draw(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "draw(weights, uniform)");
        return NULL;
    }
    Buffer buffer = {.held = 0};
    double uniform;
    double stack[STACK_BLOCKS], *blocks = NULL;
    if (get_buffer(args[0], &buffer, 1, "f", 0, "weights") < 0 || get_uniform(args[1], &uniform) < 0
        || (blocks = block_buffer(stack, buffer.view.shape[0])) == NULL) {
        release(&buffer, 1);
        return NULL;
    }
    const Py_ssize_t token = draw_row(buffer.view.buf, buffer.view.shape[0], blocks, uniform);
    free_blocks(blocks, stack);
    release(&buffer, 1);
    return token_or_error(token, "weights");
}

/* residual_draw(target_probs, draft_probs, uniform): a draw from normalize(max(0, target - draft)),
 * the recovered token of speculative sampling; from target_probs if the residual has no mass (the
 * two rows are equal up to rounding). The residual is never stored. */
static PyObject *fs_residual_draw(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "residual_draw(target_probs, draft_probs, uniform)");
        return NULL;
    }
    Buffer buffers[2] = {{.held = 0}, {.held = 0}};
    double uniform;
    double stack[STACK_BLOCKS], *blocks = NULL;
    if (get_buffer(args[0], &buffers[0], 1, "f", 0, "target_probs") < 0
        || get_buffer(args[1], &buffers[1], 1, "f", 0, "draft_probs") < 0 || same_length(&buffers[0], &buffers[1]) < 0
        || get_uniform(args[2], &uniform) < 0 || (blocks = block_buffer(stack, buffers[0].view.shape[0])) == NULL) {
        release(buffers, 2);
        return NULL;
    }
    const Py_ssize_t token =
        residual_draw_row(buffers[0].view.buf, buffers[1].view.buf, buffers[0].view.shape[0], blocks, uniform);
    free_blocks(blocks, stack);
    release(buffers, 2);
    return token_or_error(token, "target_probs");
}

/* ---- Processor: one generate call's settings; sample / argmax / verify over its rows ---- */

typedef struct {
    PyObject_HEAD
    Settings settings;
} Processor;

/* An optional 1-D array: NULL data for None. */
static int get_optional(PyObject *obj, Buffer *buffer, const char *name, int itemsize, const char *formats) {
    if (obj == Py_None) return 0;
    if (PyObject_GetBuffer(obj, &buffer->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous array", name);
        return -1;
    }
    buffer->held = 1;
    const char *got = buffer->view.format == NULL ? "B" : buffer->view.format;
    if (got[0] == '<' || got[0] == '=' || got[0] == '@') got++;
    if (buffer->view.ndim != 1 || buffer->view.itemsize != itemsize || got[0] == '\0' || got[1] != '\0'
        || strchr(formats, got[0]) == NULL) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D array of %d-byte integers", name, itemsize);
        return -1;
    }
    return 0;
}

/* A sequence of token ids into ids [<= capacity], each in [0, n). */
static Py_ssize_t get_token_ids(PyObject *sequence, Py_ssize_t *ids, Py_ssize_t capacity, Py_ssize_t n, const char *name) {
    PyObject *snapshot = PySequence_Tuple(sequence);
    if (snapshot == NULL) return -1;
    const Py_ssize_t count = PyTuple_GET_SIZE(snapshot);
    if (count > capacity) {
        Py_DECREF(snapshot);
        PyErr_Format(PyExc_ValueError, "%s: at most %zd tokens", name, capacity);
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        ids[i] = PyNumber_AsSsize_t(PyTuple_GET_ITEM(snapshot, i), PyExc_OverflowError);
        if (ids[i] == -1 && PyErr_Occurred()) break;
        if (!(0 <= ids[i] && ids[i] < n)) {
            PyErr_Format(PyExc_ValueError, "%s: a token id is outside the vocabulary", name);
            break;
        }
    }
    Py_DECREF(snapshot);
    return PyErr_Occurred() ? -1 : count;
}

#define MAX_TOKENS 64 /* draft tokens a call takes (the generate loop drafts at most 32) */

/* The penalty's context from (ids, mask) buffers and the extras; context->ids is NULL without a penalty. */
static int get_context(Buffer *ids, Buffer *mask, Py_ssize_t n, Context *context) {
    context->ids = NULL;
    if (!ids->held) return 0;
    if (!mask->held || mask->view.shape[0] != n) {
        PyErr_SetString(PyExc_ValueError, "the penalty needs ids and a mask [vocab]");
        return -1;
    }
    context->ids = ids->view.buf;
    context->count = ids->view.shape[0];
    context->mask = mask->view.buf;
    for (Py_ssize_t j = 0; j < context->count; j++)
        if (!(0 <= context->ids[j] && context->ids[j] < n)) {
            PyErr_SetString(PyExc_ValueError, "a context token id is outside the vocabulary");
            return -1;
        }
    return 0;
}

static PyObject *processor_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    double inverse, top_p, min_p, penalty;
    Py_ssize_t top_k;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) > 0) {
        PyErr_SetString(PyExc_TypeError, "Processor takes positional arguments only");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "dnddd:Processor", &inverse, &top_k, &top_p, &min_p, &penalty)) return NULL;
    if (!(inverse >= 0.0 && isfinite(inverse)) || top_k < 0 || !(top_p > 0.0 && top_p <= 1.0)
        || !(min_p >= 0.0 && min_p <= 1.0) || !(penalty > 0.0 && isfinite(penalty))) {
        PyErr_SetString(PyExc_ValueError, "Processor(inverse_temperature >= 0, top_k >= 0, top_p in (0, 1], "
                                          "min_p in [0, 1], repetition_penalty > 0)");
        return NULL;
    }
    Processor *self = (Processor *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->settings = (Settings){(float)inverse, top_k, top_p, min_p > 0.0 ? (float)log(min_p) : -INFINITY, (float)penalty};
    return (PyObject *)self;
}

/* sample(logits, out, uniform, ids, mask, extras) -> token, or None when uniform is None */
static PyObject *processor_sample(Processor *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "sample(logits, out, uniform, ids, mask, extras)");
        return NULL;
    }
    if (self->settings.inverse_temperature == 0.0f) {
        PyErr_SetString(PyExc_ValueError, "a greedy Processor has no distribution (use argmax)");
        return NULL;
    }
    Buffer buffers[4] = {{.held = 0}, {.held = 0}, {.held = 0}, {.held = 0}};
    Py_ssize_t extras[MAX_TOKENS], num_extras = 0, token = 0;
    double uniform = 0.0;
    const int draw = args[2] != Py_None;
    Context context;
    PyObject *result = NULL;
    if (get_buffer(args[0], &buffers[0], 1, "f", 0, "logits") < 0 || get_buffer(args[1], &buffers[1], 1, "f", 1, "out") < 0
        || same_length(&buffers[0], &buffers[1]) < 0 || (draw && get_uniform(args[2], &uniform) < 0)
        || get_optional(args[3], &buffers[2], "ids", 8, "lq") < 0 || get_optional(args[4], &buffers[3], "mask", 1, "B?") < 0)
        goto done;
    const Py_ssize_t n = buffers[0].view.shape[0];
    if (get_context(&buffers[2], &buffers[3], n, &context) < 0 || ensure_scratch(n) < 0) goto done;
    if (context.ids != NULL && (num_extras = get_token_ids(args[5], extras, MAX_TOKENS, n, "extras")) < 0) goto done;
    context.extras = extras;
    context.num_extras = num_extras;
    Sparse *support;
    token = process_row(&self->settings, buffers[0].view.buf, buffers[1].view.buf, n, context.ids ? &context : NULL,
                        draw ? &uniform : NULL, &support);
    if (!draw) {
        result = Py_None;
        Py_INCREF(result);
    } else {
        result = token_or_error(token, "probabilities");
    }
done:
    release(buffers, 4);
    return result;
}

/* argmax(logits, ids, mask, extras) -> np.argmax of the penalized logits */
static PyObject *processor_argmax(Processor *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "argmax(logits, ids, mask, extras)");
        return NULL;
    }
    Buffer buffers[3] = {{.held = 0}, {.held = 0}, {.held = 0}};
    Py_ssize_t extras[MAX_TOKENS], num_extras = 0;
    Context context;
    PyObject *result = NULL;
    if (get_buffer(args[0], &buffers[0], 1, "f", 0, "logits") < 0 || get_optional(args[1], &buffers[1], "ids", 8, "lq") < 0
        || get_optional(args[2], &buffers[2], "mask", 1, "B?") < 0)
        goto done;
    const Py_ssize_t n = buffers[0].view.shape[0];
    if (get_context(&buffers[1], &buffers[2], n, &context) < 0 || ensure_scratch(n) < 0) goto done;
    const float *row = buffers[0].view.buf;
    if (context.ids != NULL) {
        if ((num_extras = get_token_ids(args[3], extras, MAX_TOKENS, n, "extras")) < 0) goto done;
        context.extras = extras;
        context.num_extras = num_extras;
        penalize_into(row, scratch.penalized, n, &context, self->settings.penalty);
        row = scratch.penalized;
    }
    result = PyLong_FromSsize_t(argmax_row(row, n));
done:
    release(buffers, 3);
    return result;
}

/* The accept rule of rejection.rejection_sample over rows formed as the scan reaches them (see verify). */
static Py_ssize_t scan(const Settings *p, const Py_ssize_t *ids, Py_ssize_t k, const float *draft, const float *logits,
                       const double *uniforms, float *target, Py_ssize_t n, Context *context, Py_ssize_t *accepted) {
    Sparse *support;
    Py_ssize_t position = 0;
    for (; position < k; position++) {
        float *row = target + position * n;
        if (context != NULL) context->num_extras = position; /* row i penalizes x_1..x_i too */
        if (process_row(p, logits + position * n, row, n, context, NULL, &support) < 0) return -1;
        if (uniforms[position] * (double)draft[position * n + ids[position]] < (double)row[ids[position]]) continue;
        *accepted = position;
        const float *draft_row = draft + position * n;
        return support != NULL ? sparse_residual_draw(support, draft_row, n, uniforms[k])
                               : residual_draw_row(row, draft_row, n, scratch.dense_blocks, uniforms[k]);
    }
    *accepted = k;
    float *row = target + k * n;
    if (context != NULL) context->num_extras = k;
    if (process_row(p, logits + k * n, row, n, context, NULL, &support) < 0) return -1;
    return support != NULL ? sparse_draw(support, sparse_sums(support, n), uniforms[k])
                           : draw_row(row, n, scratch.dense_blocks, uniforms[k]);
}

/* verify(draft_token_ids, draft_probs, target_logits, uniforms, target_probs, ids, mask) -> (num_accepted, next_token)
 * rejection.rejection_sample in one call: row i of target_probs [>= k + 1, vocab] is the processed
 * distribution of target_logits[i] (its penalty reads the context and x_1..x_i), formed only when the
 * scan reaches it; draft token i is accepted when uniforms[i] * draft_probs[i, token] <
 * target_probs[i, token]; the first rejection draws the recovered token from the residual with
 * uniforms[k], and k acceptances draw the bonus token from row k with it. */
static PyObject *processor_verify(Processor *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "verify(draft_token_ids, draft_probs, target_logits, uniforms, target_probs, ids, mask)");
        return NULL;
    }
    if (self->settings.inverse_temperature == 0.0f) {
        PyErr_SetString(PyExc_ValueError, "a greedy Processor has no distribution (use argmax)");
        return NULL;
    }
    /* The ids first, into our own array: converting the other arguments may run Python code. */
    Py_ssize_t ids[MAX_TOKENS];
    const Py_ssize_t k = get_token_ids(args[0], ids, MAX_TOKENS, PY_SSIZE_T_MAX, "draft_token_ids");
    if (k < 0) return NULL;
    if (k == 0) {
        PyErr_SetString(PyExc_ValueError, "draft_token_ids must not be empty");
        return NULL;
    }
    Buffer buffers[6] = {{.held = 0}, {.held = 0}, {.held = 0}, {.held = 0}, {.held = 0}, {.held = 0}};
    Context context;
    PyObject *result = NULL;
    if (get_buffer(args[1], &buffers[0], 2, "f", 0, "draft_probs") < 0
        || get_buffer(args[2], &buffers[1], 2, "f", 0, "target_logits") < 0
        || get_buffer(args[3], &buffers[2], 1, "d", 0, "uniforms") < 0
        || get_buffer(args[4], &buffers[3], 2, "f", 1, "target_probs") < 0
        || get_optional(args[5], &buffers[4], "ids", 8, "lq") < 0 || get_optional(args[6], &buffers[5], "mask", 1, "B?") < 0)
        goto done;
    const Py_ssize_t n = buffers[1].view.shape[1];
    if (buffers[0].view.shape[0] < k || buffers[1].view.shape[0] != k + 1 || buffers[2].view.shape[0] != k + 1
        || buffers[3].view.shape[0] < k + 1 || buffers[0].view.shape[1] != n || buffers[3].view.shape[1] != n) {
        PyErr_SetString(PyExc_ValueError, "verify needs draft_probs [>= k, vocab], target_logits [k + 1, vocab], "
                                          "uniforms [k + 1] and target_probs [>= k + 1, vocab]");
        goto done;
    }
    const double *uniforms = buffers[2].view.buf;
    for (Py_ssize_t i = 0; i <= k; i++) {
        if (check_uniform(uniforms[i]) < 0) goto done;
        if (i < k && ids[i] >= n) {
            PyErr_SetString(PyExc_ValueError, "a draft token id is outside the vocabulary");
            goto done;
        }
    }
    if (get_context(&buffers[4], &buffers[5], n, &context) < 0 || ensure_scratch(n) < 0) goto done;
    context.extras = ids;
    Py_ssize_t accepted = 0;
    const Py_ssize_t token = scan(&self->settings, ids, k, buffers[0].view.buf, buffers[1].view.buf, uniforms,
                                  buffers[3].view.buf, n, context.ids ? &context : NULL, &accepted);
    result = token < 0 ? token_or_error(token, "target_probs") : Py_BuildValue("nn", accepted, token);
done:
    release(buffers, 6);
    return result;
}

static PyMethodDef processor_methods[] = {
    {"sample", (PyCFunction)(void (*)(void))processor_sample, METH_FASTCALL,
     "sample(logits, out, uniform, ids, mask, extras): out = the processed distribution of logits (the repetition "
     "penalty on ids [m] and extras when ids is not None); with a uniform in [0, 1), returns the token it draws."},
    {"argmax", (PyCFunction)(void (*)(void))processor_argmax, METH_FASTCALL,
     "argmax(logits, ids, mask, extras): np.argmax of the penalized logits."},
    {"verify", (PyCFunction)(void (*)(void))processor_verify, METH_FASTCALL,
     "verify(draft_token_ids, draft_probs, target_logits, uniforms, target_probs, ids, mask): the rejection scan of "
     "speculative sampling -> (num_accepted, next_token)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ProcessorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "specdeploy.runtime._fastsample.Processor",
    .tp_doc = "Processor(inverse_temperature, top_k, top_p, min_p, repetition_penalty): one generate call's "
              "logits processing (inverse_temperature 0: greedy).",
    .tp_basicsize = sizeof(Processor),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = processor_new,
    .tp_methods = processor_methods,
};

static PyMethodDef methods[] = {
    {"softmax", (PyCFunction)(void (*)(void))fs_softmax, METH_FASTCALL,
     "softmax(logits, out, inverse_temperature, uniform=None): out = softmax(logits * inverse_temperature); "
     "with a uniform in [0, 1), returns the token the inverse CDF of out gives at it."},
    {"draw", (PyCFunction)(void (*)(void))fs_draw, METH_FASTCALL,
     "draw(weights, uniform): the inverse-CDF draw from non-negative float32 weights."},
    {"residual_draw", (PyCFunction)(void (*)(void))fs_residual_draw, METH_FASTCALL,
     "residual_draw(target_probs, draft_probs, uniform): a draw from normalize(max(0, target - draft))."},
{NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastsample", "The sampler's hot loop in C.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastsample(void) {
    if (PyType_Ready(&ProcessorType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&ProcessorType);
    if (PyModule_AddObject(m, "Processor", (PyObject *)&ProcessorType) < 0) {
        Py_DECREF(&ProcessorType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
