/* The sampler's hot loop in C: a softmax and inverse-CDF draws over one float32 row.
 *
 * Why: at temperature > 0 every draft token needs a softmax over the vocabulary and a draw, and
 * every verify row the rejection scan reaches needs a softmax. In NumPy that is about 15 calls per
 * draft token; right after an ONNX Runtime pass has streamed the model's weights through the cache,
 * each call runs cold, and on the benchmark pair (8k vocabulary, 0.2 ms draft steps) they cost
 * ~57 us per draft token, a quarter of the step. Here it is one call and a few passes over the row.
 *
 * The NumPy functions in sampling.py remain the definition; this module computes the same
 * quantities (tests compare the two) and the runtime uses it when it was built (it is optional).
 * Portable C99: no intrinsics, no fast-math; loops are written in 16 independent lanes so that
 * compilers vectorize them without reassociating anything (GCC needs -fno-trapping-math to turn
 * the selects into blends; setup.py passes it).
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

/* verify(draft_token_ids, draft_probs, target_logits, inverse_temperature, uniforms, target_probs)
 *   -> (num_accepted, next_token)
 * The rejection scan of rejection.rejection_sample_lazy in one call, for temperature-only sampling:
 * row i of target_probs [k + 1, vocab] = softmax(target_logits[i] * inverse_temperature), formed only
 * when the scan reaches it; draft token i is accepted when uniforms[i] * draft_probs[i, token] <
 * target_probs[i, token]; the first rejection draws the recovered token from the residual with
 * uniforms[k], and k acceptances draw the bonus token from row k with it. The same arithmetic as
 * the Python scan over softmax/residual_draw/draw, so both return the same tokens. */
static PyObject *fs_verify(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "verify(draft_token_ids, draft_probs, target_logits, inverse_temperature, uniforms, target_probs)");
        return NULL;
    }
    /* The ids first, into our own array: converting the other arguments may run Python code. */
    PyObject *snapshot = PySequence_Tuple(args[0]);
    if (snapshot == NULL) return NULL;
    const Py_ssize_t k = PyTuple_GET_SIZE(snapshot);
    Py_ssize_t stack_ids[64], *ids = k <= 64 ? stack_ids : PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(k > 0 ? k : 1));
    if (ids == NULL) {
        Py_DECREF(snapshot);
        return PyErr_NoMemory();
    }
    int failed = k < 1;
    if (failed) PyErr_SetString(PyExc_ValueError, "draft_token_ids must not be empty");
    for (Py_ssize_t i = 0; i < k && !failed; i++) {
        ids[i] = PyNumber_AsSsize_t(PyTuple_GET_ITEM(snapshot, i), PyExc_OverflowError);
        failed = ids[i] == -1 && PyErr_Occurred();
    }
    Py_DECREF(snapshot);
    Buffer buffers[4] = {{.held = 0}, {.held = 0}, {.held = 0}, {.held = 0}};
    float inverse;
    double stack[STACK_BLOCKS], *blocks = NULL;
    if (failed || get_buffer(args[1], &buffers[0], 2, "f", 0, "draft_probs") < 0
        || get_buffer(args[2], &buffers[1], 2, "f", 0, "target_logits") < 0
        || get_inverse_temperature(args[3], &inverse) < 0 || get_buffer(args[4], &buffers[2], 1, "d", 0, "uniforms") < 0
        || get_buffer(args[5], &buffers[3], 2, "f", 1, "target_probs") < 0) {
        goto fail;
    }
    const Py_ssize_t n = buffers[1].view.shape[1];
    if (buffers[0].view.shape[0] < k || buffers[1].view.shape[0] != k + 1 || buffers[2].view.shape[0] != k + 1
        || buffers[3].view.shape[0] < k + 1 || buffers[0].view.shape[1] != n || buffers[3].view.shape[1] != n) {
        PyErr_SetString(PyExc_ValueError, "verify needs draft_probs [>= k, vocab], target_logits [k + 1, vocab], "
                                          "uniforms [k + 1] and target_probs [>= k + 1, vocab]");
        goto fail;
    }
    const float *draft = buffers[0].view.buf, *logits = buffers[1].view.buf;
    const double *uniforms = buffers[2].view.buf;
    float *target = buffers[3].view.buf;
    for (Py_ssize_t i = 0; i <= k; i++) {
        if (check_uniform(uniforms[i]) < 0) goto fail;
        if (i < k && !(0 <= ids[i] && ids[i] < n)) {
            PyErr_SetString(PyExc_ValueError, "a draft token id is outside the vocabulary");
            goto fail;
        }
    }
    if ((blocks = block_buffer(stack, n)) == NULL) goto fail;
    Py_ssize_t position = 0, token = -1;
    for (; position < k; position++) {
        float *row = target + position * n;
        softmax_row(logits + position * n, row, n, inverse, blocks, NULL);
        if (uniforms[position] * (double)draft[position * n + ids[position]] < (double)row[ids[position]]) continue;
        token = residual_draw_row(row, draft + position * n, n, blocks, uniforms[k]);
        break;
    }
    if (position == k) {
        float *row = target + k * n;
        softmax_row(logits + k * n, row, n, inverse, blocks, NULL);
        token = draw_row(row, n, blocks, uniforms[k]);
    }
    free_blocks(blocks, stack);
    release(buffers, 4);
    if (ids != stack_ids) PyMem_Free(ids);
    if (token < 0) return token_or_error(token, "target_probs");
    return Py_BuildValue("nn", position, token);

fail:
    release(buffers, 4);
    if (ids != stack_ids) PyMem_Free(ids);
    return NULL;
}

static PyMethodDef methods[] = {
    {"softmax", (PyCFunction)(void (*)(void))fs_softmax, METH_FASTCALL,
     "softmax(logits, out, inverse_temperature, uniform=None): out = softmax(logits * inverse_temperature); "
     "with a uniform in [0, 1), returns the token the inverse CDF of out gives at it."},
    {"draw", (PyCFunction)(void (*)(void))fs_draw, METH_FASTCALL,
     "draw(weights, uniform): the inverse-CDF draw from non-negative float32 weights."},
    {"residual_draw", (PyCFunction)(void (*)(void))fs_residual_draw, METH_FASTCALL,
     "residual_draw(target_probs, draft_probs, uniform): a draw from normalize(max(0, target - draft))."},
    {"verify", (PyCFunction)(void (*)(void))fs_verify, METH_FASTCALL,
     "verify(draft_token_ids, draft_probs, target_logits, inverse_temperature, uniforms, target_probs): "
     "the rejection scan of speculative sampling -> (num_accepted, next_token)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastsample", "The sampler's hot loop in C.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastsample(void) { return PyModule_Create(&module); }
