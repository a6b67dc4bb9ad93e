/* The sampler's C kernel (specdeploy/runtime/csrc/sampling.c) against references computed here, in
 * double precision and by the obvious method (sorts, full cumulative sums): the exponential against
 * libm, softmax and processed rows (repetition penalty, top-k, top-p, min-p) against their definition,
 * draws against the inverse CDF, the rejection scan against the rule, argument errors, and processors
 * used from several threads at once (each has its own scratch).
 *
 * Inputs come from integer arithmetic (splitmix64), never from libm, so that every build sees the same
 * bits. stdout is a digest of everything the kernel returned, one line per section: tests/test_c_kernel.py
 * compares the digests of the native build, the FS_PORTABLE build (no GNU extensions), clang's and the
 * aarch64 build under qemu, which must be equal. Exit status 1 and FAIL lines on stderr when a check fails.
 *
 *     cc -std=c99 -O3 -fno-trapping-math -ffp-contract=off -pthread -I specdeploy/runtime/csrc \
 *         tests/c/test_sampling.c specdeploy/runtime/csrc/sampling.c -lm -o test_sampling && ./test_sampling
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sampling.h"

static int failures = 0;

#define CHECK(cond, ...)                                                 \
    do {                                                                 \
        if (!(cond)) {                                                   \
            if (failures++ < 20) {                                       \
                fprintf(stderr, "FAIL %s:%d: ", __func__, __LINE__);     \
                fprintf(stderr, __VA_ARGS__);                            \
                fputc('\n', stderr);                                     \
            }                                                            \
        }                                                                \
    } while (0)

/* ---- inputs: splitmix64, and rows shaped like the Python tests' ---- */

static uint64_t state = 0x5eed;

static uint64_t next_bits(void) {
    uint64_t z = (state += 0x9e3779b97f4a7c15u);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    return z ^ (z >> 31);
}

static double uniform(void) { return (double)(next_bits() >> 11) * 0x1.0p-53; }

static fs_index below(fs_index n) { return (fs_index)(next_bits() % (uint64_t)n); }

/* Roughly N(0, 1) (Irwin-Hall of 4), in exact arithmetic. */
static float normal(void) { return (float)((uniform() + uniform() + uniform() + uniform() - 2.0) * 1.7320508075688772); }

/* logits [count, n]: flat and peaked rows (scales 1, 3, 8), every fourth one rounded to integers (ties at the
 * top-k and top-p boundaries), and a last row of equal values. */
static void fill_rows(float *logits, fs_index n, fs_index count) {
    static const float scales[3] = {1.0f, 3.0f, 8.0f};
    for (fs_index r = 0; r < count; r++)
        for (fs_index i = 0; i < n; i++) {
            float x = normal() * scales[r % 3];
            if (r % 4 == 1) x = floorf(x + 0.5f);
            logits[r * n + i] = r == count - 1 ? 2.0f : x;
        }
}

/* ---- the digest: FNV-1a over the kernel's outputs ---- */

static uint64_t digest = 1469598103934665603u;

static void absorb(const void *data, size_t bytes) {
    const unsigned char *p = data;
    for (size_t i = 0; i < bytes; i++) digest = (digest ^ p[i]) * 1099511628211u;
}

static void absorb_index(fs_index value) {
    const int64_t v = value;
    absorb(&v, sizeof v);
}

static void section(const char *name) {
    printf("%s %016llx\n", name, (unsigned long long)digest);
    digest = 1469598103934665603u;
}

/* ---- the references ---- */

static const fs_index SIZES[] = {1, 5, 63, 64, 65, 1000, 8192, 50257};
#define NUM_SIZES ((int)(sizeof SIZES / sizeof SIZES[0]))
#define MAX_N 50257
#define ROWS 6

typedef struct {
    const char *name;
    double temperature, top_p, min_p, penalty;
    fs_index top_k;
} Setting;

static const Setting SETTINGS[] = {
    {"T0.8", 0.8, 1.0, 0.0, 1.0, 0},
    {"T0.8/top-k50", 0.8, 1.0, 0.0, 1.0, 50},
    {"T0.8/top-p0.95", 0.8, 0.95, 0.0, 1.0, 0},
    {"T0.8/top-k50/top-p0.95", 0.8, 0.95, 0.0, 1.0, 50},
    {"T0.8/min-p0.05", 0.8, 1.0, 0.05, 1.0, 0},
    {"T0.8/top-p0.95/penalty1.1", 0.8, 0.95, 0.0, 1.1, 0},
    {"T1.3/penalty0.8", 1.3, 1.0, 0.0, 0.8, 0},
    {"T0.6/top-k7/min-p0.2/penalty1.5", 0.6, 1.0, 0.2, 1.5, 7},
    {"T0.9/top-p0.8/min-p0.1", 0.9, 0.8, 0.1, 1.0, 0},
    {"T1.1/top-k300/top-p0.7/min-p0.01/penalty1.2", 1.1, 0.7, 0.01, 1.2, 300},
    {"T0.3/top-p1-2^-52", 0.3, 1.0 - 0x1.0p-52, 0.0, 1.0, 0},
};
#define NUM_SETTINGS ((int)(sizeof SETTINGS / sizeof SETTINGS[0]))

static fs_processor *processor_for(const Setting *s) {
    const fs_settings settings = {1.0 / s->temperature, s->top_k, s->top_p, s->min_p, s->penalty};
    int error;
    fs_processor *p = fs_processor_new(&settings, &error);
    if (p == NULL) {
        fprintf(stderr, "FAIL processor %s: %s\n", s->name, fs_error_message(error));
        exit(1);
    }
    return p;
}

static int descending(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

static const double *rank_weights; /* qsort's comparison reads these: (weight desc, id asc) */

static int by_rank(const void *a, const void *b) {
    const fs_index i = *(const fs_index *)a, j = *(const fs_index *)b;
    if (rank_weights[i] != rank_weights[j]) return rank_weights[i] > rank_weights[j] ? -1 : 1;
    return (i > j) - (i < j);
}

/* Tokens whose top-p membership rounding decides: their preceding mass lies within 1e-12 of the cut's
 * (top_p a few ulps below 1 puts the whole tail there). compare_row takes either answer for them. */
static unsigned char on_the_cut[MAX_N];

/* probs [n] = the processed distribution of logits [n] by the definition (sampling.process_row): penalize
 * the distinct tokens of context and extras, keep the top-k (>= the k-th largest logit), then the
 * smallest most probable set whose mass reaches top_p (ties ranked by id), then min-p; softmax over
 * what is kept, in double. The weights are the kernel's exponential (checked against libm on its own),
 * 0 below e^-87 of the top one as the kernel's contract says. Returns 0, or -1 for a row with a NaN or an
 * infinite logit. */
static int reference_row(const Setting *s, const float *logits, fs_index n, const fs_context *context, double *probs) {
    float *x = malloc((size_t)n * sizeof *x), *sorted = malloc((size_t)n * sizeof *sorted);
    unsigned char *keep = malloc((size_t)n), *seen = calloc((size_t)n, 1);
    double *weights = malloc((size_t)n * sizeof *weights);
    fs_index *order = malloc((size_t)n * sizeof *order);
    memcpy(x, logits, (size_t)n * sizeof *x);
    memset(on_the_cut, 0, (size_t)n);
    if (context != NULL && s->penalty != 1.0) {
        const float penalty = (float)s->penalty;
        for (fs_index j = 0; j < context->count + context->num_extras; j++) {
            const fs_index t = j < context->count ? (fs_index)context->ids[j] : context->extras[j - context->count];
            if (seen[t]) continue;
            seen[t] = 1;
            x[t] = x[t] < 0.0f ? x[t] * penalty : x[t] / penalty;
        }
    }
    const float inverse = (float)(1.0 / s->temperature);
    float max = -INFINITY;
    int nan = 0;
    for (fs_index i = 0; i < n; i++) {
        nan |= x[i] != x[i];
        if (x[i] > max) max = x[i];
    }
    int result = 0;
    if (nan || !isfinite(max)) { /* -inf logits are fine (masked tokens); a NaN, +inf or no finite one is not */
        result = -1;
        goto done;
    }
    const float shift = max * inverse;
    for (fs_index i = 0; i < n; i++) keep[i] = 1;
    if (0 < s->top_k && s->top_k < n) {
        memcpy(sorted, x, (size_t)n * sizeof *sorted);
        qsort(sorted, (size_t)n, sizeof *sorted, descending);
        for (fs_index i = 0; i < n; i++) keep[i] = x[i] >= sorted[s->top_k - 1];
    }
    if (s->top_p < 1.0) {
        double total = 0.0;
        fs_index count = 0;
        for (fs_index i = 0; i < n; i++) {
            weights[i] = keep[i] ? (double)fs_exp(x[i] * inverse - shift) : 0.0;
            total += weights[i];
            if (keep[i]) order[count++] = i;
        }
        rank_weights = weights;
        qsort(order, (size_t)count, sizeof *order, by_rank);
        double before = 0.0;
        for (fs_index j = 0; j < count; j++) {
            keep[order[j]] = before < s->top_p * total;
            on_the_cut[order[j]] = fabs(before - s->top_p * total) <= 1e-12 * total;
            before += weights[order[j]];
        }
    }
    if (s->min_p > 0.0) {
        const float log_min_p = (float)log(s->min_p);
        for (fs_index i = 0; i < n; i++) keep[i] &= x[i] * inverse - shift >= log_min_p;
    }
    double total = 0.0;
    for (fs_index i = 0; i < n; i++) {
        const float scaled = x[i] * inverse - shift;
        probs[i] = keep[i] && scaled >= -87.0f ? exp((double)scaled) : 0.0;
        total += probs[i];
    }
    for (fs_index i = 0; i < n; i++) probs[i] /= total;
done:
    free(x), free(sorted), free(keep), free(seen), free(weights), free(order);
    return result;
}

/* The inverse-CDF token at u of weights whose cumulative sums (sequential, in double) are cdf [n]: the first
 * token whose cdf exceeds u * total (a token of zero weight never does first), else the last with weight. */
static fs_index pick(const double *cdf, fs_index n, double u) {
    const double point = u * cdf[n - 1];
    fs_index low = 0, high = n; /* the first cdf > point is in [low, high] */
    while (low < high) {
        const fs_index middle = low + (high - low) / 2;
        if (cdf[middle] > point) high = middle;
        else low = middle + 1;
    }
    if (low < n) return low;
    while (low > 0 && cdf[low - 1] == (low > 1 ? cdf[low - 2] : 0.0)) low--; /* rounding ran off the end */
    return low - 1;
}

/* The inverse-CDF token of weights [n] at u; cdf [n] receives their cumulative sums (for near_step). */
static fs_index reference_draw(const double *weights, fs_index n, double u, double *cdf) {
    double total = 0.0;
    for (fs_index i = 0; i < n; i++) {
        total += weights[i];
        cdf[i] = total;
    }
    return pick(cdf, n, u);
}

/* Whether tokens a and b (a draw's two answers) differ only because u lies within tolerance of the step
 * between them. */
static int near_step(const double *cdf, fs_index n, fs_index a, fs_index b, double u, double tolerance) {
    if (a == b) return 1;
    if (a < 0 || b < 0) return 0;
    const fs_index first = a < b ? a : b;
    return fabs(cdf[first] - u * cdf[n - 1]) <= tolerance * cdf[n - 1];
}

/* ---- checks ---- */

static void check_exp(void) {
    for (int i = 0; i <= 175000; i++) {
        const float x = fminf(-87.0f + (float)i * 0.001f, 88.0f);
        const float ours = fs_exp(x);
        const double expected = exp((double)x);
        CHECK(fabs(ours - expected) <= 2.5e-7 * expected, "exp(%.9g) = %.9g, libm %.9g", x, ours, expected);
        absorb(&ours, sizeof ours);
    }
    const float specials[] = {-87.5f, -88.0f, -1e30f, -INFINITY, 88.5f, 89.0f, 100.0f, 1e30f, INFINITY, NAN, 0.0f, -0.0f};
    for (size_t i = 0; i < sizeof specials / sizeof specials[0]; i++) {
        const float x = specials[i], ours = fs_exp(x);
        if (x != x) CHECK(ours != ours, "exp(NaN) = %g", ours);
        else if (x < -87.0f) CHECK(ours == 0.0f, "exp(%g) = %g, expected 0 (flushed)", x, ours);
        else if (x > 88.0f) CHECK(ours == INFINITY, "exp(%g) = %g, expected inf (guarded)", x, ours);
        else CHECK(ours == 1.0f, "exp(%g) = %g", x, ours);
        absorb(&ours, sizeof ours);
    }
    section("exp");
}

/* Compares the kernel's row [n] with the reference's: the same support, probabilities to rounding. */
static void compare_row(const char *what, const float *ours, const double *reference, fs_index n) {
    int reported = 0;
    for (fs_index i = 0; i < n && !reported; i++) {
        if (on_the_cut[i] && (ours[i] == 0.0f || reference[i] == 0.0)) continue;
        const int same_support = (ours[i] > 0.0f) == (reference[i] > 0.0);
        const int close = fabs((double)ours[i] - reference[i]) <= 3e-6 * reference[i] + 1e-30;
        if (!same_support || !close) {
            CHECK(0, "%s: token %td: %.9g, reference %.9g", what, i, (double)ours[i], reference[i]);
            reported = 1;
        }
    }
}


static float logits[ROWS * MAX_N], out[MAX_N], draft_rows[8 * MAX_N], target_rows[8 * MAX_N];
static double reference[MAX_N], cdf[MAX_N], weights[MAX_N];

/* A context of 40 tokens with repeats (the penalty reads each once) and the extras a draft adds. */
static int64_t context_ids[40];
static uint8_t context_mask[MAX_N];
static fs_index extras[8];

static fs_context make_context(fs_index n, fs_index num_extras) {
    memset(context_mask, 0, (size_t)n);
    fs_index count = 0;
    for (int j = 0; j < 40; j++) {
        const fs_index t = below(n);
        if (context_mask[t]) continue;
        context_mask[t] = 1;
        context_ids[count++] = t;
    }
    for (fs_index j = 0; j < num_extras; j++) extras[j] = j % 2 && count ? (fs_index)context_ids[0] : below(n);
    return (fs_context){context_ids, count, context_mask, extras, num_extras};
}

static float all_rows[NUM_SIZES][ROWS * MAX_N]; /* the same rows for every setting */

static void check_rows(void) {
    int draws = 0, on_a_step = 0;
    for (int zi = 1; zi < NUM_SIZES; zi++) fill_rows(all_rows[zi], SIZES[zi], ROWS);
    for (int si = 0; si < NUM_SETTINGS; si++) {
        const Setting *s = &SETTINGS[si];
        fs_processor *p = processor_for(s);
        for (int zi = 1; zi < NUM_SIZES; zi++) {
            const fs_index n = SIZES[zi];
            const float *logits = all_rows[zi];
            for (fs_index r = 0; r < (n >= 8192 ? 3 : ROWS); r++) { /* fewer long rows: qemu runs this too */
                const fs_context context = make_context(n, r % 4);
                const double u = uniform();
                const fs_index token = fs_sample(p, logits + r * n, out, n, &context, &u);
                absorb_index(token);
                absorb(out, (size_t)n * sizeof *out);
                char what[96];
                snprintf(what, sizeof what, "%s n=%td row %td", s->name, n, r);
                CHECK(reference_row(s, logits + r * n, n, &context, reference) == 0, "%s: no reference row", what);
                compare_row(what, out, reference, n);
                const fs_index expected = reference_draw(reference, n, u, cdf);
                CHECK(token >= 0 && out[token] > 0.0f, "%s: drew %td", what, token);
                draws++;
                if (token != expected) {
                    on_a_step++;
                    CHECK(near_step(cdf, n, token, expected, u, 1e-6), "%s: drew %td, reference %td", what, token, expected);
                }
                /* without a uniform: the same row */
                static float again[MAX_N];
                CHECK(fs_sample(p, logits + r * n, again, n, &context, NULL) == 0, "%s: no draw", what);
                CHECK(memcmp(again, out, (size_t)n * sizeof *out) == 0, "%s: sample and distribution differ", what);
            }
        }
        fs_processor_free(p);
        section(s->name);
    }
    CHECK(on_a_step <= draws / 50, "%d of %d draws differ from the reference", on_a_step, draws);
}

static void check_softmax_rows(void) {
    /* -inf logits (what masking leaves), huge equal logits, NaN and inf rows */
    const Setting plain = {"T1", 1.0, 1.0, 0.0, 1.0, 0};
    fs_processor *p = processor_for(&plain);
    for (int zi = 0; zi < NUM_SIZES; zi++) {
        const fs_index n = SIZES[zi];
        fill_rows(logits, n, 3);
        for (fs_index i = 0; i < n; i++) {
            if (below(2)) logits[i] = -INFINITY;
            logits[2 * n + i] = 1e4f;
        }
        logits[0] = 3.0f;
        for (fs_index r = 0; r < 3; r++) {
            CHECK(fs_sample(p, logits + r * n, out, n, NULL, NULL) == 0, "softmax n=%td", n);
            absorb(out, (size_t)n * sizeof *out);
            reference_row(&plain, logits + r * n, n, NULL, reference);
            compare_row("softmax", out, reference, n);
        }
        const double u = 0.5;
        logits[n - 1] = NAN;
        CHECK(fs_sample(p, logits, out, n, NULL, &u) == FS_ERROR_NO_DISTRIBUTION, "a NaN logit has no distribution");
        logits[n - 1] = INFINITY;
        CHECK(fs_sample(p, logits, out, n, NULL, &u) == FS_ERROR_NO_DISTRIBUTION, "an inf logit has no distribution");
    }
    fs_processor_free(p);
    section("softmax");
}

static void check_draws(void) {
    const Setting plain = {"T1", 1.0, 1.0, 0.0, 1.0, 0};
    fs_processor *p = processor_for(&plain);
    static float w[MAX_N], draft[MAX_N];
    int draws = 0, on_a_step = 0;
    for (int zi = 0; zi < NUM_SIZES; zi++) {
        const fs_index n = SIZES[zi];
        for (fs_index i = 0; i < n; i++) {
            const double v = uniform();
            w[i] = below(3) == 0 ? 0.0f : (float)(v * v * v * v * v * v * v * v); /* uneven, a third zero */
            draft[i] = below(2) ? w[i] : (float)uniform() * w[i] * 2.0f;
        }
        if (n > 1) w[n - 1] = 0.0f; /* mass never lands on an empty tail */
        w[0] = n == 1 ? 1.0f : w[0];
        static double residual_cdf[MAX_N];
        double mass = 0.0, total = 0.0;
        for (fs_index i = 0; i < n; i++) {
            total += w[i];
            cdf[i] = total;
            mass += w[i] > draft[i] ? (double)w[i] - draft[i] : 0.0;
            residual_cdf[i] = mass;
        }
        for (int t = 0; t < (n >= 8192 ? 60 : 400); t++) {
            const double u = t == 0 ? 0.0 : t == 1 ? 1.0 - 0x1.0p-53 : uniform();
            const fs_index token = fs_draw(p, w, n, u);
            absorb_index(token);
            const fs_index expected = pick(cdf, n, u);
            CHECK(token >= 0 && w[token] > 0.0f, "draw n=%td u=%.17g: %td", n, u, token);
            draws++;
            if (token != expected) {
                on_a_step++;
                CHECK(near_step(cdf, n, token, expected, u, 1e-9), "draw n=%td: %td, reference %td", n, token, expected);
            }
            const fs_index recovered = fs_residual_draw(p, w, draft, n, u);
            absorb_index(recovered);
            if (mass > 0.0) {
                const fs_index residual_expected = pick(residual_cdf, n, u);
                CHECK(w[recovered] > draft[recovered], "residual draw n=%td: %td has no residual mass", n, recovered);
                if (recovered != residual_expected)
                    CHECK(near_step(residual_cdf, n, recovered, residual_expected, u, 1e-6),
                          "residual n=%td: %td, reference %td", n, recovered, residual_expected);
            } else {
                CHECK(recovered == token, "an empty residual draws from the target");
            }
        }
        CHECK(fs_draw(p, draft, n, 0.5) >= 0 || n == 1, "draw");
        static float zeros[MAX_N];
        CHECK(fs_draw(p, zeros, n, 0.5) == FS_ERROR_NO_DISTRIBUTION, "no mass, no draw");
    }
    CHECK(on_a_step <= draws / 100, "%d of %d draws differ from the reference", on_a_step, draws);
    fs_processor_free(p);
    section("draw");
}

static void check_argmax(void) {
    const Setting greedy = {"greedy/penalty1.3", 0.0, 1.0, 0.0, 1.3, 0};
    const fs_settings settings = {0.0, 0, 1.0, 0.0, 1.3};
    int error;
    fs_processor *p = fs_processor_new(&settings, &error);
    const fs_index n = 300;
    for (int trial = 0; trial < 300; trial++) {
        fill_rows(logits, n, 2);
        const float *row = logits + (trial % 2) * n;
        const fs_context context = make_context(n, trial % 5);
        const fs_index token = fs_argmax(p, row, n, &context);
        absorb_index(token);
        /* the reference: the penalized row's first maximum */
        float best = -INFINITY;
        fs_index expected = 0;
        static unsigned char seen[300];
        memset(seen, 0, sizeof seen);
        static float x[300];
        memcpy(x, row, sizeof x);
        for (fs_index j = 0; j < context.count + context.num_extras; j++) {
            const fs_index t = j < context.count ? (fs_index)context.ids[j] : context.extras[j - context.count];
            if (!seen[t]) x[t] = x[t] < 0.0f ? x[t] * 1.3f : x[t] / 1.3f;
            seen[t] = 1;
        }
        for (fs_index i = 0; i < n; i++)
            if (x[i] > best) best = x[i], expected = i;
        CHECK(token == expected, "argmax %d: %td, reference %td", trial, token, expected);
    }
    CHECK(fs_sample(p, logits, out, n, NULL, NULL) == FS_ERROR_GREEDY, "a greedy processor has no distribution");
    (void)greedy;
    fs_processor_free(p);
    section("argmax");
}

/* The reference scan (rejection.rejection_sample) over reference rows; *decided: whether rounding could
 * make the kernel's answer differ (a tied acceptance test, an empty residual, a draw at a step). */
static fs_index reference_verify(const Setting *s, const fs_index *ids, fs_index k, const float *draft, const float *target_logits,
                                 const double *uniforms, fs_index n, const fs_context *context, fs_index *accepted,
                                 fs_index kernel_token, int *decided) {
    fs_context with = *context;
    with.extras = ids;
    *decided = 0;
    for (fs_index i = 0; i <= k; i++) {
        with.num_extras = i;
        reference_row(s, target_logits + i * n, n, &with, reference);
        if (i == k) break;
        const double test = uniforms[i] * draft[i * n + ids[i]], target = reference[ids[i]];
        if (fabs(test - target) <= 1e-5 * (target > 1e-30 ? target : 1e-30)) *decided = 1;
        if (test < target) continue;
        double mass = 0.0;
        for (fs_index t = 0; t < n; t++) {
            weights[t] = reference[t] > draft[i * n + t] ? reference[t] - draft[i * n + t] : 0.0;
            mass += weights[t];
        }
        if (mass <= 1e-5) *decided = 1;
        *accepted = i;
        const fs_index token = reference_draw(mass > 0.0 ? weights : reference, n, uniforms[k], cdf);
        if (near_step(cdf, n, token, kernel_token, uniforms[k], 1e-5) && token != kernel_token) *decided = 1;
        return token;
    }
    *accepted = k;
    const fs_index token = reference_draw(reference, n, uniforms[k], cdf);
    if (near_step(cdf, n, token, kernel_token, uniforms[k], 1e-5) && token != kernel_token) *decided = 1;
    return token;
}

static void check_verify(void) {
    static const fs_index vocabularies[] = {5, 64, 300, 1000};
    int rounds = 0, differ = 0;
    for (int si = 0; si < NUM_SETTINGS; si++) {
        const Setting *s = &SETTINGS[si];
        fs_processor *p = processor_for(s);
        for (int trial = 0; trial < 120; trial++) {
            const fs_index n = vocabularies[below(4)], k = 1 + below(5);
            fill_rows(target_rows, n, k + 1);
            fs_context context = make_context(n, 0);
            fs_index ids[8];
            double uniforms[8];
            if (trial % 3 == 0) { /* prompt lookup: one-hot draft rows */
                memset(draft_rows, 0, (size_t)(k * n) * sizeof *draft_rows);
                for (fs_index i = 0; i < k; i++) draft_rows[i * n + (ids[i] = below(n))] = 1.0f;
            } else {
                for (fs_index i = 0; i < k; i++) {
                    for (fs_index t = 0; t < n; t++)
                        logits[t] = trial % 5 == 0 && i == 0 ? target_rows[t] : target_rows[i * n + t] + 0.5f * normal();
                    context.extras = ids;
                    context.num_extras = i;
                    const double u = uniform();
                    ids[i] = fs_sample(p, logits, draft_rows + i * n, n, &context, &u);
                }
            }
            context.num_extras = 0;
            for (fs_index i = 0; i <= k; i++) uniforms[i] = uniform();
            static float formed[8 * MAX_N];
            for (fs_index i = 0; i < (k + 1) * n; i++) formed[i] = -1.0f;
            fs_index accepted = -1;
            const fs_index token = fs_verify(p, ids, k, draft_rows, target_rows, uniforms, formed, n, &context, &accepted);
            absorb_index(token);
            absorb_index(accepted);
            absorb(formed, (size_t)((accepted + 1) * n) * sizeof *formed);
            CHECK(token >= 0, "%s verify %d: %s", s->name, trial, fs_error_message(token));
            for (fs_index i = (accepted + 1) * n; i < (k + 1) * n; i++)
                if (formed[i] != -1.0f) {
                    CHECK(0, "%s verify %d: a row past the scan was formed", s->name, trial);
                    break;
                }
            fs_index expected_accepted;
            int decided;
            const fs_index expected = reference_verify(s, ids, k, draft_rows, target_rows, uniforms, n, &context,
                                                       &expected_accepted, token, &decided);
            rounds++;
            if (expected != token || expected_accepted != accepted) {
                differ++;
                CHECK(decided, "%s verify %d: (%td, %td), reference (%td, %td)", s->name, trial, accepted, token,
                      expected_accepted, expected);
            }
        }
        fs_processor_free(p);
        char name[80];
        snprintf(name, sizeof name, "verify/%s", s->name);
        section(name);
    }
    CHECK(differ <= rounds / 50, "%d of %d rounds differ from the reference", differ, rounds);
}

static void check_errors(void) {
    const Setting penalized = {"penalty", 1.0, 0.9, 0.0, 1.2, 0};
    fs_processor *p = processor_for(&penalized);
    const fs_index n = 64;
    fill_rows(logits, n, 3);
    const double u = 0.5, bad_u = 1.0;
    fs_context context = make_context(n, 0);
    CHECK(fs_sample(p, logits, logits, n, NULL, &u) == FS_ERROR_OVERLAP, "out == logits");
    CHECK(fs_sample(p, logits, logits + n / 2, n, NULL, &u) == FS_ERROR_OVERLAP, "out overlaps logits");
    CHECK(fs_sample(p, logits, logits + n, n, NULL, &u) >= 0, "adjacent rows do not overlap");
    float *aliased = (float *)(void *)context_mask; /* n floats over the mask's first 4n bytes */
    CHECK(fs_sample(p, logits, aliased, n, &context, &u) == FS_ERROR_OVERLAP, "out overlaps the penalty's mask");
    CHECK(fs_sample(p, logits, out, n, NULL, &bad_u) == FS_ERROR_UNIFORM, "uniform 1");
    CHECK(fs_sample(p, logits, out, 0, NULL, &u) == FS_ERROR_EMPTY, "empty row");
    context_ids[0] = n;
    CHECK(fs_sample(p, logits, out, n, &context, &u) == FS_ERROR_TOKEN, "a context id outside the vocabulary");
    context_ids[0] = 0;
    fs_index ids[2] = {1, n}, accepted;
    double uniforms[3] = {0.1, 0.2, 0.3};
    CHECK(fs_verify(p, ids, 2, logits, logits, uniforms, out, n, NULL, &accepted) == FS_ERROR_TOKEN, "draft id");
    ids[1] = 2;
    CHECK(fs_verify(p, ids, 2, logits, logits, uniforms, logits + n, n, NULL, &accepted) == FS_ERROR_OVERLAP,
          "target_probs overlaps target_logits");
    CHECK(fs_verify(p, ids, 2, target_rows + n, logits, uniforms, target_rows, n, NULL, &accepted) == FS_ERROR_OVERLAP,
          "target_probs overlaps draft_probs");
    CHECK(fs_verify(p, ids, 0, logits, logits, uniforms, out, n, NULL, &accepted) == FS_ERROR_EMPTY, "no drafts");
    uniforms[2] = -0.1;
    CHECK(fs_verify(p, ids, 2, logits, logits, uniforms, target_rows, n, NULL, &accepted) == FS_ERROR_UNIFORM, "uniform");
    fs_processor_free(p);
    const fs_settings bad[] = {{-1.0, 0, 1.0, 0.0, 1.0}, {1.0, -1, 1.0, 0.0, 1.0}, {1.0, 0, 0.0, 0.0, 1.0},
                               {1.0, 0, 1.5, 0.0, 1.0}, {1.0, 0, 1.0, 1.5, 1.0}, {1.0, 0, 1.0, 0.0, 0.0},
                               {INFINITY, 0, 1.0, 0.0, 1.0}, {1.0, 0, NAN, 0.0, 1.0}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int error = 0;
        CHECK(fs_processor_new(&bad[i], &error) == NULL && error == FS_ERROR_SETTINGS, "bad settings %zu", i);
    }
    section("errors");
}

/* ---- processors on threads: each its own scratch ---- */

#define THREADS 4
#define THREAD_N 3000
#define THREAD_ROWS 8
#define REPEATS 25

static float thread_logits[THREAD_ROWS * THREAD_N];
static float expected_rows[THREADS][THREAD_ROWS * THREAD_N];
static fs_index expected_tokens[THREADS][THREAD_ROWS];
static const int THREAD_SETTINGS[THREADS] = {1, 2, 5, 9}; /* top-k, top-p, top-p with a penalty, everything */
static int thread_mismatches[THREADS];

static fs_index thread_rows(fs_processor *p, int row, float *into) {
    static const int64_t ids[3] = {1, 2, 3};
    static uint8_t mask[THREAD_N] = {0, 1, 1, 1};
    const fs_context context = {ids, 3, mask, NULL, 0};
    const double u = (row + 0.5) / THREAD_ROWS;
    return fs_sample(p, thread_logits + row * THREAD_N, into, THREAD_N, &context, &u);
}

static void *thread_main(void *arg) {
    const int t = (int)(intptr_t)arg;
    fs_processor *p = processor_for(&SETTINGS[THREAD_SETTINGS[t]]);
    float *row = malloc(THREAD_N * sizeof *row);
    for (int repeat = 0; repeat < REPEATS; repeat++)
        for (int r = 0; r < THREAD_ROWS; r++) {
            const fs_index token = thread_rows(p, r, row);
            thread_mismatches[t] += token != expected_tokens[t][r]
                                    || memcmp(row, expected_rows[t] + r * THREAD_N, THREAD_N * sizeof *row) != 0;
        }
    free(row);
    fs_processor_free(p);
    return NULL;
}

static void check_threads(void) {
    fill_rows(thread_logits, THREAD_N, THREAD_ROWS);
    for (int t = 0; t < THREADS; t++) {
        fs_processor *p = processor_for(&SETTINGS[THREAD_SETTINGS[t]]);
        for (int r = 0; r < THREAD_ROWS; r++) expected_tokens[t][r] = thread_rows(p, r, expected_rows[t] + r * THREAD_N);
        fs_processor_free(p);
    }
    pthread_t threads[THREADS];
    for (int t = 0; t < THREADS; t++) CHECK(pthread_create(&threads[t], NULL, thread_main, (void *)(intptr_t)t) == 0, "thread");
    for (int t = 0; t < THREADS; t++) pthread_join(threads[t], NULL);
    for (int t = 0; t < THREADS; t++)
        CHECK(thread_mismatches[t] == 0, "thread %d (%s): %d of %d rows differ from one thread's", t,
              SETTINGS[THREAD_SETTINGS[t]].name, thread_mismatches[t], REPEATS * THREAD_ROWS);
}

int main(void) {
    check_exp();
    check_softmax_rows();
    check_draws();
    check_rows();
    check_argmax();
    check_verify();
    check_errors();
    check_threads();
    if (failures) fprintf(stderr, "%d checks failed\n", failures);
    return failures != 0;
}
