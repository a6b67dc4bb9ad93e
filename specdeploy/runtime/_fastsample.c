/* The CPython binding of the sampler's kernel (csrc/sampling.h): the Processor type whose sample /
 * argmax / verify the runtime calls (specdeploy/runtime/sampling.py's Sampler, rejection.py's accept).
 *
 * Here only arguments are taken apart: arrays through the buffer protocol, C-contiguous and of the
 * kernel's dtype (a TypeError names any other), token ids from any sequence of ints. The kernel checks
 * the rest (token ids, uniforms, overlapping arrays) and its errors become ValueError (MemoryError for
 * FS_ERROR_NO_MEMORY). Each Processor owns its kernel processor and so its scratch; the GIL is held
 * throughout a call.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "csrc/sampling.h"

#define MAX_TOKENS 64 /* draft tokens a call takes (the generate loop drafts at most 32) */

typedef struct {
    Py_buffer view;
    int held;
} Buffer;

static PyObject *kernel_error(fs_index error) {
    if (error == FS_ERROR_NO_MEMORY) return PyErr_NoMemory();
    PyErr_SetString(PyExc_ValueError, fs_error_message(error));
    return NULL;
}

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

/* An optional 1-D array of itemsize-byte integers of one of formats: nothing held for None. */
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

static void release(Buffer *buffers, int count) {
    for (int i = 0; i < count; i++)
        if (buffers[i].held) PyBuffer_Release(&buffers[i].view);
}

/* A sequence of ints into ids [<= MAX_TOKENS]; returns the count, or -1 with an exception set. */
static Py_ssize_t get_token_ids(PyObject *sequence, fs_index *ids, const char *name) {
    PyObject *snapshot = PySequence_Tuple(sequence);
    if (snapshot == NULL) return -1;
    const Py_ssize_t count = PyTuple_GET_SIZE(snapshot);
    if (count > MAX_TOKENS) {
        Py_DECREF(snapshot);
        PyErr_Format(PyExc_ValueError, "%s: at most %d tokens", name, MAX_TOKENS);
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        ids[i] = PyNumber_AsSsize_t(PyTuple_GET_ITEM(snapshot, i), PyExc_OverflowError);
        if (ids[i] == -1 && PyErr_Occurred()) break;
    }
    Py_DECREF(snapshot);
    return PyErr_Occurred() ? -1 : count;
}

/* The penalty's context from the (ids [count] int64, mask [n] uint8) buffers; *used is NULL when ids is None. */
static int get_context(Buffer *ids, Buffer *mask, Py_ssize_t n, fs_context *context, fs_context **used) {
    *used = NULL;
    if (!ids->held) return 0;
    if (!mask->held || mask->view.shape[0] != n) {
        PyErr_SetString(PyExc_ValueError, "the penalty needs ids and a mask [vocab]");
        return -1;
    }
    *context = (fs_context){ids->view.buf, ids->view.shape[0], mask->view.buf, NULL, 0};
    *used = context;
    return 0;
}

static int get_uniform(PyObject *obj, double *uniform) {
    *uniform = PyFloat_AsDouble(obj);
    return *uniform == -1.0 && PyErr_Occurred() ? -1 : 0;
}

typedef struct {
    PyObject_HEAD
    fs_processor *kernel;
} Processor;

static PyObject *processor_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    fs_settings settings;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs) > 0) {
        PyErr_SetString(PyExc_TypeError, "Processor takes positional arguments only");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "dnddd:Processor", &settings.inverse_temperature, &settings.top_k, &settings.top_p,
                          &settings.min_p, &settings.repetition_penalty))
        return NULL;
    int error;
    fs_processor *kernel = fs_processor_new(&settings, &error);
    if (kernel == NULL) return kernel_error(error);
    Processor *self = (Processor *)type->tp_alloc(type, 0);
    if (self == NULL) {
        fs_processor_free(kernel);
        return NULL;
    }
    self->kernel = kernel;
    return (PyObject *)self;
}

static void processor_dealloc(Processor *self) {
    fs_processor_free(self->kernel);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* sample(logits, out, uniform, ids, mask, extras) -> token, or None when uniform is None */
static PyObject *processor_sample(Processor *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "sample(logits, out, uniform, ids, mask, extras)");
        return NULL;
    }
    Buffer buffers[4] = {{.held = 0}, {.held = 0}, {.held = 0}, {.held = 0}};
    fs_index extras[MAX_TOKENS];
    double uniform = 0.0;
    const int draw = args[2] != Py_None;
    fs_context context, *used = NULL;
    PyObject *result = NULL;
    if (get_buffer(args[0], &buffers[0], 1, "f", 0, "logits") < 0 || get_buffer(args[1], &buffers[1], 1, "f", 1, "out") < 0
        || (draw && get_uniform(args[2], &uniform) < 0) || get_optional(args[3], &buffers[2], "ids", 8, "lq") < 0
        || get_optional(args[4], &buffers[3], "mask", 1, "B?") < 0)
        goto done;
    const Py_ssize_t n = buffers[0].view.shape[0];
    if (buffers[1].view.shape[0] != n) {
        PyErr_SetString(PyExc_ValueError, "logits and out differ in length");
        goto done;
    }
    if (get_context(&buffers[2], &buffers[3], n, &context, &used) < 0) goto done;
    if (used != NULL && (context.num_extras = get_token_ids(args[5], extras, "extras")) < 0) goto done;
    context.extras = extras;
    const fs_index token = fs_sample(self->kernel, buffers[0].view.buf, buffers[1].view.buf, n, used,
                                     draw ? &uniform : NULL);
    if (token < 0) kernel_error(token);
    else if (!draw) result = Py_NewRef(Py_None);
    else result = PyLong_FromSsize_t(token);
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
    fs_index extras[MAX_TOKENS];
    fs_context context, *used = NULL;
    PyObject *result = NULL;
    if (get_buffer(args[0], &buffers[0], 1, "f", 0, "logits") < 0 || get_optional(args[1], &buffers[1], "ids", 8, "lq") < 0
        || get_optional(args[2], &buffers[2], "mask", 1, "B?") < 0)
        goto done;
    const Py_ssize_t n = buffers[0].view.shape[0];
    if (get_context(&buffers[1], &buffers[2], n, &context, &used) < 0) goto done;
    if (used != NULL && (context.num_extras = get_token_ids(args[3], extras, "extras")) < 0) goto done;
    context.extras = extras;
    const fs_index token = fs_argmax(self->kernel, buffers[0].view.buf, n, used);
    result = token < 0 ? kernel_error(token) : PyLong_FromSsize_t(token);
done:
    release(buffers, 3);
    return result;
}

/* verify(draft_token_ids, draft_probs, target_logits, uniforms, target_probs, ids, mask) -> (num_accepted, next_token):
 * fs_verify over draft_probs [>= k, vocab], target_logits [k + 1, vocab], uniforms [k + 1] and target_probs
 * [>= k + 1, vocab], whose rows past the scan are left as they were. */
static PyObject *processor_verify(Processor *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "verify(draft_token_ids, draft_probs, target_logits, uniforms, target_probs, ids, mask)");
        return NULL;
    }
    /* The ids first, into our own array: converting the other arguments may run Python code. */
    fs_index ids[MAX_TOKENS];
    const Py_ssize_t k = get_token_ids(args[0], ids, "draft_token_ids");
    if (k < 0) return NULL;
    if (k == 0) return kernel_error(FS_ERROR_EMPTY); /* before the shapes, which a k of 0 cannot match */
    Buffer buffers[6] = {{.held = 0}, {.held = 0}, {.held = 0}, {.held = 0}, {.held = 0}, {.held = 0}};
    fs_context context, *used = NULL;
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
    if (get_context(&buffers[4], &buffers[5], n, &context, &used) < 0) goto done;
    fs_index accepted = 0;
    const fs_index token = fs_verify(self->kernel, ids, k, buffers[0].view.buf, buffers[1].view.buf,
                                     buffers[2].view.buf, buffers[3].view.buf, n, used, &accepted);
    result = token < 0 ? kernel_error(token) : Py_BuildValue("nn", accepted, token);
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
              "logits processing (inverse_temperature 0: greedy), with its own scratch.",
    .tp_basicsize = sizeof(Processor),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = processor_new,
    .tp_dealloc = (destructor)processor_dealloc,
    .tp_methods = processor_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastsample", "The sampler's kernel (csrc/sampling.c), bound to CPython.", -1, NULL,
    NULL, NULL, NULL, NULL,
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
