/* The sampler's kernel in portable C: a float32 logits row processed into its distribution (repetition
 * penalty, temperature, top-k, top-p, min-p), inverse-CDF draws, and the rejection scan of speculative
 * sampling. No Python here: specdeploy/runtime/_fastsample.c binds it to CPython, tests/c drives it.
 *
 * The NumPy functions in specdeploy/runtime/sampling.py and rejection.py define every quantity; this
 * kernel computes the same ones (the tests compare the two) without touching more of the row than it
 * must. Every call that takes a processor uses that processor's scratch: calls on different processors
 * never share memory, so each may run on its own thread.
 *
 * Errors are negative return values (FS_ERROR_*); fs_error_message names each. Arrays a call writes
 * must not overlap the arrays it reads: the calls check it (FS_ERROR_OVERLAP) rather than assume it.
 */
#ifndef SPECDEPLOY_SAMPLING_H
#define SPECDEPLOY_SAMPLING_H

#include <stddef.h>
#include <stdint.h>

typedef ptrdiff_t fs_index; /* a position or a count in a row (Py_ssize_t on every CPython platform) */

enum {
    FS_ERROR_NO_DISTRIBUTION = -1, /* a NaN or an infinite logit, or no positive weight: nothing to draw */
    FS_ERROR_NO_MEMORY = -2,
    FS_ERROR_OVERLAP = -3,         /* an array the call writes overlaps one it reads */
    FS_ERROR_TOKEN = -4,           /* a token id outside the vocabulary */
    FS_ERROR_UNIFORM = -5,         /* a uniform outside [0, 1) */
    FS_ERROR_GREEDY = -6,          /* a distribution asked of a greedy processor */
    FS_ERROR_SETTINGS = -7,        /* settings out of range (see fs_processor_new) */
    FS_ERROR_EMPTY = -8,           /* no draft tokens, or an empty row */
};

typedef struct {
    double inverse_temperature; /* >= 0, finite; 0: greedy (fs_argmax only) */
    fs_index top_k;             /* >= 0; 0: off */
    double top_p;               /* in (0, 1]; 1: off */
    double min_p;               /* in [0, 1]; 0: off */
    double repetition_penalty;  /* > 0, finite; 1: off */
} fs_settings;

/* The context a row's repetition penalty reads: the distinct context tokens, and tokens drafted after it. */
typedef struct {
    const int64_t *ids;      /* [count] distinct, each in [0, n) */
    fs_index count;
    const uint8_t *mask;     /* [n]: 1 where a token is among ids, else 0 */
    const fs_index *extras;  /* [num_extras] drafted after the context, repeats allowed, each in [0, n) */
    fs_index num_extras;
} fs_context;

typedef struct fs_processor fs_processor;

/* A processor for these settings, or NULL with *error set (FS_ERROR_SETTINGS, FS_ERROR_NO_MEMORY). Its
 * scratch grows to the largest row it has processed; fs_processor_free releases it. */
fs_processor *fs_processor_new(const fs_settings *settings, int *error);
void fs_processor_free(fs_processor *processor);

/* out [n] = the processed distribution of logits [n] (sampling.process_row), penalized by context unless it
 * is NULL (or the penalty is 1). With a uniform (in [0, 1)), returns the token it draws from the row,
 * else 0; FS_ERROR_NO_DISTRIBUTION when the row has none (out is then NaN). */
fs_index fs_sample(fs_processor *processor, const float *logits, float *out, fs_index n, const fs_context *context,
                   const double *uniform);

/* np.argmax of logits [n] penalized by context (NULL: none): the first maximum, or the first NaN. */
fs_index fs_argmax(fs_processor *processor, const float *logits, fs_index n, const fs_context *context);

/* rejection.rejection_sample over processed rows, formed as the scan reaches them: row i of target_probs
 * [k + 1, n] becomes the distribution of target_logits [k + 1, n] row i (penalized by the context and
 * draft_ids[:i]; context->extras is ignored); draft token i is accepted when uniforms[i] *
 * draft_probs[i, token] < target_probs[i, token]; the first rejection draws the recovered token from
 * the residual max(0, target - draft) with uniforms[k], k acceptances the bonus token from row k. Returns
 * the next token and sets *accepted; rows past the scan are left as they were. */
fs_index fs_verify(fs_processor *processor, const fs_index *draft_ids, fs_index k, const float *draft_probs,
                   const float *target_logits, const double *uniforms, float *target_probs, fs_index n,
                   const fs_context *context, fs_index *accepted);

/* The kernel's primitives, for tests: the inverse-CDF draw from non-negative weights [n] (not necessarily
 * normalized), the draw from normalize(max(0, target - draft)) (from target when that has no mass), and
 * the exponential every row pass uses. */
fs_index fs_draw(fs_processor *processor, const float *weights, fs_index n, double uniform);
fs_index fs_residual_draw(fs_processor *processor, const float *target, const float *draft, fs_index n, double uniform);
float fs_exp(float x);

const char *fs_error_message(fs_index error);

#endif
