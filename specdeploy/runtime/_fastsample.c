/* The sampler's hot loop in C: a softmax and inverse-CDF draws over one float32 row.
 *
 * Why: at temperature > 0 every draft token needs a softmax over the vocabulary and a draw, and
 * every verify row the rejection scan reaches needs a softmax. In NumPy that is about 15 calls per
 * draft token; right after an ONNX Runtime pass has streamed the model's weights through the cache,
 * each call runs cold, and on the benchmark pair (8k vocabulary, 0.2 ms draft steps) they cost
 * ~57 us per draft token, a quarter of the step. Here it is one call and three passes over the row.
 *
 * The NumPy functions in sampling.py remain the definition; this module computes the same
 * quantities (tests compare the two) and the runtime uses it when it was built (it is optional).
 * Portable C99: no intrinsics, no fast-math; loops are written in 16 independent lanes so that
 * compilers vectorize them without reassociating anything (GCC needs -fno-trapping-math to turn
 * the selects into blends; pyproject.toml passes it).
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
 * FLT_MIN there, and every caller divides by a sum that holds at least e^0 = 1). */
static inline float exp_nonpositive(float x) {
    const float clamped = x < -87.0f ? -87.0f : x;
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
    return x < -87.0f ? 0.0f : p * scale;
}

/* Row passes are compiled for AVX-512, AVX2 and the baseline, and picked at load time (GCC on x86-64
 * Linux; other compilers and CPUs get one portable build: NEON on aarch64 vectorizes the same loops).
 * No fp contraction (pyproject.toml passes -ffp-contract=off) and a fixed lane layout: every build
 * computes the same bits. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__x86_64__) && defined(__linux__)
#define ROW_PASS __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define ROW_PASS
#endif

ROW_PASS static float row_max(const float *restrict row, Py_ssize_t n) {
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

/* out = exp(logits * inverse_temperature - shift) */
ROW_PASS static void exp_row(const float *restrict logits, float *restrict out, Py_ssize_t n, float inverse_temperature,
                             float shift) {
    for (Py_ssize_t i = 0; i < n; i++) out[i] = exp_nonpositive(logits[i] * inverse_temperature - shift);
}

ROW_PASS static void scale_row(float *restrict row, Py_ssize_t n, float scale) {
    for (Py_ssize_t i = 0; i < n; i++) row[i] *= scale;
}

/* block_sums[b] = the sum of the weights of block b (positions [b * BLOCK, (b + 1) * BLOCK)), where
 * the weight at i is WEIGHT(i); returns the total. */
#define BLOCK_SUMS(WEIGHT)                                                  \
    double total = 0.0;                                                     \
    Py_ssize_t b = 0, start = 0;                                            \
    for (; start + BLOCK <= n; b++, start += BLOCK) {                       \
        float lanes[LANES] = {0};                                           \
        for (Py_ssize_t i = start; i < start + BLOCK; i += LANES)           \
            for (int l = 0; l < LANES; l++) lanes[l] += WEIGHT(i + l);      \
        float sum = 0.0f;                                                   \
        for (int l = 0; l < LANES; l++) sum += lanes[l];                    \
        block_sums[b] = sum;                                                \
        total += sum;                                                       \
    }                                                                       \
    if (start < n) {                                                        \
        float sum = 0.0f;                                                   \
        for (Py_ssize_t i = start; i < n; i++) sum += WEIGHT(i);            \
        block_sums[b] = sum;                                                \
        total += sum;                                                       \
    }                                                                       \
    return total

#define PLAIN(i) weights[i]
#define RESIDUAL(i) (target[i] > draft[i] ? target[i] - draft[i] : 0.0f)

ROW_PASS static double block_sums_of(const float *restrict weights, Py_ssize_t n, float *restrict block_sums) {
    BLOCK_SUMS(PLAIN);
}

/* The same for the residual max(0, target - draft) of speculative sampling, which is never stored. */
ROW_PASS static double residual_block_sums(const float *restrict target, const float *restrict draft, Py_ssize_t n,
                                           float *restrict block_sums) {
    BLOCK_SUMS(RESIDUAL);
}

/* out = softmax(logits * inverse_temperature), in NumPy's order of operations (sampling.process_logits:
 * scale, subtract the scaled maximum, exp, multiply by the reciprocal of the sum); block_sums are of out. */
static void softmax_row(const float *logits, float *out, Py_ssize_t n, float inverse_temperature, float *block_sums) {
    exp_row(logits, out, n, inverse_temperature, row_max(logits, n) * inverse_temperature);
    const double total = block_sums_of(out, n, block_sums); /* >= 1: the maximum contributes e^0 */
    const float scale = (float)(1.0 / total);
    scale_row(out, n, scale);
    for (Py_ssize_t b = 0; b * BLOCK < n; b++) block_sums[b] *= scale;
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
static Py_ssize_t pick_block(const float *block_sums, Py_ssize_t num_blocks, double *point) {
    double before = 0.0;
    Py_ssize_t last_positive = -1;
    for (Py_ssize_t b = 0; b < num_blocks; b++) {
        if (block_sums[b] <= 0.0f) continue;
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
static Py_ssize_t draw_blocks(const float *weights, Py_ssize_t n, const float *block_sums, double total, double uniform) {
    double point = uniform * total;
    const Py_ssize_t block = pick_block(block_sums, num_blocks_of(n), &point);
    if (block < 0) return -1;
    const Py_ssize_t start = block * BLOCK, end = start + BLOCK < n ? start + BLOCK : n;
    return scan_weights(weights, start, end, point);
}

/* ---- Python glue: buffers are 1-D C-contiguous float32 ('f') ---- */

typedef struct {
    Py_buffer view;
    int held;
} Row;

static int get_row(PyObject *obj, Row *row, int writable, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &row->view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a %scontiguous float32 array", name, writable ? "writable " : "");
        return -1;
    }
    row->held = 1;
    if (row->view.ndim != 1 || row->view.itemsize != 4 || row->view.format == NULL || strcmp(row->view.format, "f") != 0
        || row->view.shape[0] < 1) {
        PyErr_Format(PyExc_TypeError, "%s must be a non-empty 1-D float32 array", name);
        return -1;
    }
    return 0;
}

static void release(Row *rows, int count) {
    for (int i = 0; i < count; i++)
        if (rows[i].held) PyBuffer_Release(&rows[i].view);
}

static int same_length(Row *a, Row *b) {
    if (a->view.shape[0] == b->view.shape[0]) return 0;
    PyErr_SetString(PyExc_ValueError, "the two rows differ in length");
    return -1;
}

static int get_uniform(PyObject *obj, double *uniform) {
    *uniform = PyFloat_AsDouble(obj);
    if (*uniform == -1.0 && PyErr_Occurred()) return -1;
    if (!(*uniform >= 0.0 && *uniform < 1.0)) {
        PyErr_SetString(PyExc_ValueError, "uniform must be in [0, 1)");
        return -1;
    }
    return 0;
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
static float *block_buffer(float *stack, Py_ssize_t n) {
    const Py_ssize_t blocks = num_blocks_of(n);
    if (blocks <= STACK_BLOCKS) return stack;
    float *heap = PyMem_Malloc(sizeof(float) * (size_t)blocks);
    if (heap == NULL) PyErr_NoMemory();
    return heap;
}

static void free_blocks(float *blocks, float *stack) {
    if (blocks != stack) PyMem_Free(blocks);
}

/* softmax(logits, out, inverse_temperature, uniform=None): out = softmax(logits * inverse_temperature);
 * with a uniform, also returns the token drawn from out by the inverse CDF at that uniform. */
static PyObject *fs_softmax(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "softmax(logits, out, inverse_temperature, uniform=None)");
        return NULL;
    }
    Row rows[2] = {{.held = 0}, {.held = 0}};
    float inverse;
    double uniform = 0.0;
    const int draw = nargs == 4 && args[3] != Py_None;
    if (get_row(args[0], &rows[0], 0, "logits") < 0 || get_row(args[1], &rows[1], 1, "out") < 0
        || same_length(&rows[0], &rows[1]) < 0 || get_inverse_temperature(args[2], &inverse) < 0
        || (draw && get_uniform(args[3], &uniform) < 0)) {
        release(rows, 2);
        return NULL;
    }
    const Py_ssize_t n = rows[0].view.shape[0];
    float *out = rows[1].view.buf, stack[STACK_BLOCKS];
    float *blocks = block_buffer(stack, n);
    if (blocks == NULL) {
        release(rows, 2);
        return NULL;
    }
    softmax_row(rows[0].view.buf, out, n, inverse, blocks);
    Py_ssize_t token = -1;
    if (draw) {
        double total = 0.0;
        for (Py_ssize_t b = 0; b < num_blocks_of(n); b++) total += blocks[b];
        token = draw_blocks(out, n, blocks, total, uniform);
    }
    free_blocks(blocks, stack);
    release(rows, 2);
    if (!draw) Py_RETURN_NONE;
    return PyLong_FromSsize_t(token);
}

/* draw(weights, uniform): the inverse-CDF draw from non-negative weights (not necessarily normalized). */
static PyObject *fs_draw(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "draw(weights, uniform)");
        return NULL;
    }
    Row row = {.held = 0};
    double uniform;
    if (get_row(args[0], &row, 0, "weights") < 0 || get_uniform(args[1], &uniform) < 0) {
        release(&row, 1);
        return NULL;
    }
    const Py_ssize_t n = row.view.shape[0];
    const float *weights = row.view.buf;
    float stack[STACK_BLOCKS];
    float *blocks = block_buffer(stack, n);
    if (blocks == NULL) {
        release(&row, 1);
        return NULL;
    }
    const double total = block_sums_of(weights, n, blocks);
    const Py_ssize_t token = draw_blocks(weights, n, blocks, total, uniform);
    free_blocks(blocks, stack);
    release(&row, 1);
    if (token < 0) {
        PyErr_SetString(PyExc_ValueError, "weights have no positive entry");
        return NULL;
    }
    return PyLong_FromSsize_t(token);
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
    Row rows[2] = {{.held = 0}, {.held = 0}};
    double uniform;
    if (get_row(args[0], &rows[0], 0, "target_probs") < 0 || get_row(args[1], &rows[1], 0, "draft_probs") < 0
        || same_length(&rows[0], &rows[1]) < 0 || get_uniform(args[2], &uniform) < 0) {
        release(rows, 2);
        return NULL;
    }
    const Py_ssize_t n = rows[0].view.shape[0];
    const float *target = rows[0].view.buf, *draft = rows[1].view.buf;
    float stack[STACK_BLOCKS];
    float *blocks = block_buffer(stack, n);
    if (blocks == NULL) {
        release(rows, 2);
        return NULL;
    }
    const double total = residual_block_sums(target, draft, n, blocks);
    Py_ssize_t token;
    if (total > 0.0) {
        double point = uniform * total;
        const Py_ssize_t block = pick_block(blocks, num_blocks_of(n), &point);
        const Py_ssize_t start = block * BLOCK, end = start + BLOCK < n ? start + BLOCK : n;
        token = scan_residual(target, draft, start, end, point);
    } else {
        const double sum = block_sums_of(target, n, blocks);
        token = draw_blocks(target, n, blocks, sum, uniform);
    }
    free_blocks(blocks, stack);
    release(rows, 2);
    if (token < 0) {
        PyErr_SetString(PyExc_ValueError, "target_probs have no positive entry");
        return NULL;
    }
    return PyLong_FromSsize_t(token);
}

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

PyMODINIT_FUNC PyInit__fastsample(void) { return PyModule_Create(&module); }
