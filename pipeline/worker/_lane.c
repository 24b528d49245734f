/*
 * The worker's fast lane: a C twin of what Worker._process_batch does with an ordinary
 * request when the backend answers at once (the simulated model without latency).
 *
 * Like the native codec it is a fast path, never the judge. run() takes the consumed
 * messages from index `start` on, one by one, and stops at the first one that is not
 * ordinary in every respect: an error, a value that is not a current single-object
 * request the native decoder reads, any field the validation would question (or that
 * this code does not check as precisely: a tenant id that is not printable ASCII, say),
 * a request id seen before, a cancelled or expired request, metadata, a response the
 * native encoder will not write. It returns where it stopped, and the worker takes that
 * message through the Python path, which decides and explains, then calls run() again
 * after it. So every message is handled in consumption order, by exactly one of the two,
 * and the answers are the bytes the Python path would write.
 *
 * run(ctx, msgs, start, started_ms, finished_ms) -> (stop, values, keys, ids, runs, bands, tenants, models)
 *   stop      index of the first message left to the caller (len(msgs): none)
 *   values    the COMPLETED responses of msgs[start:stop], encoded; keys: their keys
 *   ids       their request ids, already added to the seen set (the caller keeps its order)
 *   runs      [(topic, partition, [offsets])] of msgs[start:stop], consecutive messages of
 *             one partition together
 *   bands     per band index: None or [count, prompt tokens, completion tokens, wait sum,
 *             wait bucket counts...]
 *   tenants   {tenant: [count, wait sum, wait bucket counts...]}
 *   models    {model: [count per band index]}
 *
 * ctx (built by pipeline/worker/fastlane.py):
 *   0 decode(data, pos) -> Request | None   the native request decoder
 *   1 request header (bytes)                the single-object header of the current schema
 *   2 offsets of Request's slots, in the READ order below
 *   3 encode(values, header) -> bytes | None  the native response encoder (RESPONSE_FIELDS order)
 *   4 response header (bytes)
 *   5 Status.COMPLETED     6 worker id (str)
 *   7 answers: tuple of 256 tuples of str (the simulated model's sentence prefixes)
 *   8 max output tokens    9 seen request ids (set)   10 cancelled ids (dict) or None
 *   11 {Priority: band index}   12 wait bucket bounds (tuple of float, ascending)
 *   13 max clock skew (ms)  14 max_tokens limit  15 max tenant id characters
 *   16 max trace id characters  17 the Request type (whose slots ctx[2] locates)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define CTX_SIZE 18
#define NBANDS 5
#define MAX_BOUNDS 64

/* Request slots read, in the order of ctx[2]. */
enum {
    F_REQUEST_ID, F_TENANT_ID, F_PRIORITY, F_PROMPT, F_MODEL, F_MAX_TOKENS, F_CREATED_AT, F_TIMEOUT_MS,
    F_TRACE_ID, F_METADATA, F_ADMITTED_AT, F_EFFECTIVE_PRIORITY, F_DEGRADED_FROM, F_COUNT
};

/* zlib's CRC-32 (reflected 0xEDB88320), so the variant is the one zlib.crc32 picks. */
static uint32_t crc_table[8][256];

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++) crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
}

static uint32_t crc32_update(uint32_t crc, const uint8_t *p, Py_ssize_t n) {
    crc = ~crc;
    while (n >= 8) { /* slicing by 8 */
        uint32_t a = crc ^ ((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
        uint32_t b = (uint32_t)p[4] | (uint32_t)p[5] << 8 | (uint32_t)p[6] << 16 | (uint32_t)p[7] << 24;
        crc = crc_table[7][a & 0xFF] ^ crc_table[6][(a >> 8) & 0xFF] ^ crc_table[5][(a >> 16) & 0xFF] ^
              crc_table[4][a >> 24] ^ crc_table[3][b & 0xFF] ^ crc_table[2][(b >> 8) & 0xFF] ^
              crc_table[1][(b >> 16) & 0xFF] ^ crc_table[0][b >> 24];
        p += 8;
        n -= 8;
    }
    while (n-- > 0) crc = crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

/* crc32 of the str's UTF-8 bytes, continuing from seed; -1 when it has none (a lone surrogate). */
static int64_t crc_of(PyObject *s, uint32_t seed) {
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(s, &n);
    if (utf8 == NULL) {
        PyErr_Clear();
        return -1;
    }
    return crc32_update(seed, (const uint8_t *)utf8, n);
}

/* A C long out of an exact int, or fail (-1, no exception) when it is not one or too big. */
static int get_ll(PyObject *v, long long *out) {
    if (!PyLong_CheckExact(v)) return -1;
    int overflow;
    *out = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || (*out == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

static int is_hex(Py_UCS4 c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

/* validate_request's tenant check, for the tenants it can decide on alone: 1..max printable
 * ASCII characters, not all spaces. Anything else is left to the Python code. */
static int tenant_ok(PyObject *s, Py_ssize_t max_chars) {
    if (!PyUnicode_CheckExact(s) || PyUnicode_KIND(s) != PyUnicode_1BYTE_KIND) return 0;
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    if (n < 1 || n > max_chars) return 0;
    const Py_UCS1 *d = PyUnicode_1BYTE_DATA(s);
    int printable = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (d[i] < 0x20 || d[i] > 0x7E) return 0;
        if (d[i] != 0x20) printable = 1;
    }
    return printable;
}

static int uuid_ok(PyObject *s) {
    if (!PyUnicode_CheckExact(s) || PyUnicode_KIND(s) != PyUnicode_1BYTE_KIND || PyUnicode_GET_LENGTH(s) != 36)
        return 0;
    const Py_UCS1 *d = PyUnicode_1BYTE_DATA(s);
    for (int i = 0; i < 36; i++) {
        if (i == 8 || i == 13 || i == 18 || i == 23) {
            if (d[i] != '-') return 0;
        } else if (!is_hex(d[i])) {
            return 0;
        }
    }
    return 1;
}

static int trace_ok(PyObject *s, Py_ssize_t max_chars) {
    if (s == Py_None) return 1;
    if (!PyUnicode_CheckExact(s) || PyUnicode_KIND(s) != PyUnicode_1BYTE_KIND) return 0;
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    if (n < 1 || n > max_chars) return 0;
    const Py_UCS1 *d = PyUnicode_1BYTE_DATA(s);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_UCS1 c = d[i];
        if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
              c == ':' || c == '-'))
            return 0;
    }
    return 1;
}

static int nonempty_str(PyObject *s) { return PyUnicode_CheckExact(s) && PyUnicode_GET_LENGTH(s) > 0; }

/* The message methods run() calls, looked up once per call on the messages' type. */
enum { M_ERROR, M_VALUE, M_TOPIC, M_PARTITION, M_OFFSET, M_COUNT };
static PyObject *method_names[M_COUNT];
static PyObject *s_trace_id;

typedef struct {
    PyTypeObject *type;
    PyObject *descr[M_COUNT]; /* borrowed from the type; NULL: call by name */
} Methods;

static void methods_for(Methods *m, PyTypeObject *type) {
    m->type = type;
    for (int k = 0; k < M_COUNT; k++) {
        PyObject *d = type->tp_dictoffset == 0 ? _PyType_Lookup(type, method_names[k]) : NULL;
        m->descr[k] = d != NULL && (Py_IS_TYPE(d, &PyMethodDescr_Type) || PyFunction_Check(d)) ? d : NULL;
    }
}

static PyObject *call(Methods *m, PyObject *msg, int k) {
    if (Py_TYPE(msg) == m->type && m->descr[k] != NULL) return PyObject_Vectorcall(m->descr[k], &msg, 1, NULL);
    return PyObject_CallMethodNoArgs(msg, method_names[k]);
}

/* Per-run sums of the metrics, in C until the end of the run. */
typedef struct {
    Py_ssize_t nbuckets; /* bounds + 1 (+Inf) */
    long long band_count[NBANDS], band_prompt[NBANDS], band_completion[NBANDS];
    double band_wait[NBANDS];
    long long band_buckets[NBANDS][MAX_BOUNDS + 1];
    PyObject *tenant_index; /* {tenant: i} */
    PyObject **tenant_key;  /* [i]: the tenant's UTF-8 bytes (the message key) */
    long long *tenant_count, *tenant_buckets; /* [i], [i * nbuckets + b] */
    double *tenant_wait;
    PyObject *model_index; /* {model: i} */
    long long *model_count; /* [i * NBANDS + band] */
    Py_ssize_t tenants, models, capacity;
} Sums;

static int sums_init(Sums *t, Py_ssize_t nbuckets, Py_ssize_t capacity) {
    memset(t, 0, sizeof *t);
    t->nbuckets = nbuckets;
    t->capacity = capacity < 1 ? 1 : capacity;
    t->tenant_index = PyDict_New();
    t->model_index = PyDict_New();
    t->tenant_key = PyMem_Calloc(t->capacity, sizeof(PyObject *));
    t->tenant_count = PyMem_Calloc(t->capacity, sizeof(long long));
    t->tenant_buckets = PyMem_Calloc(t->capacity * nbuckets, sizeof(long long));
    t->tenant_wait = PyMem_Calloc(t->capacity, sizeof(double));
    t->model_count = PyMem_Calloc(t->capacity * NBANDS, sizeof(long long));
    if (!t->tenant_index || !t->model_index || !t->tenant_key || !t->tenant_count || !t->tenant_buckets ||
        !t->tenant_wait || !t->model_count) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void sums_free(Sums *t) {
    for (Py_ssize_t i = 0; i < t->tenants; i++) Py_XDECREF(t->tenant_key[i]);
    Py_XDECREF(t->tenant_index);
    Py_XDECREF(t->model_index);
    PyMem_Free(t->tenant_key);
    PyMem_Free(t->tenant_count);
    PyMem_Free(t->tenant_buckets);
    PyMem_Free(t->tenant_wait);
    PyMem_Free(t->model_count);
}

/* The index of key in index (adding it as the next one): >= 0, or -1 with an exception set. */
static Py_ssize_t index_of(PyObject *index, PyObject *key, Py_ssize_t *used) {
    PyObject *i = PyDict_GetItemWithError(index, key);
    if (i != NULL) return PyLong_AsSsize_t(i);
    if (PyErr_Occurred()) return -1;
    i = PyLong_FromSsize_t(*used);
    if (i == NULL || PyDict_SetItem(index, key, i) < 0) {
        Py_XDECREF(i);
        return -1;
    }
    Py_DECREF(i);
    return (*used)++;
}

static PyObject *int_list(const long long *values, Py_ssize_t n, Py_ssize_t prefix, PyObject **head) {
    PyObject *list = PyList_New(prefix + n);
    if (list == NULL) return NULL;
    for (Py_ssize_t k = 0; k < prefix; k++) PyList_SET_ITEM(list, k, head[k]); /* stolen */
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *v = PyLong_FromLongLong(values[k]);
        if (v == NULL) {
            for (Py_ssize_t h = 0; h < prefix; h++) PyList_SET_ITEM(list, h, NULL); /* the caller's again */
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, prefix + k, v);
    }
    return list;
}

/* The sums as run() returns them: (bands, tenants, models). */
static PyObject *sums_result(Sums *t) {
    PyObject *bands = PyList_New(NBANDS), *tenants = PyDict_New(), *models = PyDict_New();
    if (!bands || !tenants || !models) goto fail;
    for (int b = 0; b < NBANDS; b++) {
        PyObject *agg = Py_None;
        Py_INCREF(Py_None);
        if (t->band_count[b]) {
            Py_DECREF(Py_None);
            PyObject *head[4] = {PyLong_FromLongLong(t->band_count[b]), PyLong_FromLongLong(t->band_prompt[b]),
                                 PyLong_FromLongLong(t->band_completion[b]), PyFloat_FromDouble(t->band_wait[b])};
            if (!head[0] || !head[1] || !head[2] || !head[3]) {
                for (int k = 0; k < 4; k++) Py_XDECREF(head[k]);
                PyList_SET_ITEM(bands, b, NULL);
                goto fail;
            }
            agg = int_list(t->band_buckets[b], t->nbuckets, 4, head);
            if (agg == NULL) {
                for (int k = 0; k < 4; k++) Py_DECREF(head[k]);
                goto fail;
            }
        }
        PyList_SET_ITEM(bands, b, agg);
    }
    Py_ssize_t it = 0;
    PyObject *key, *index;
    while (PyDict_Next(t->tenant_index, &it, &key, &index)) {
        Py_ssize_t i = PyLong_AsSsize_t(index);
        PyObject *head[2] = {PyLong_FromLongLong(t->tenant_count[i]), PyFloat_FromDouble(t->tenant_wait[i])};
        PyObject *agg = head[0] && head[1] ? int_list(t->tenant_buckets + i * t->nbuckets, t->nbuckets, 2, head) : NULL;
        if (agg == NULL) {
            Py_XDECREF(head[0]);
            Py_XDECREF(head[1]);
            goto fail;
        }
        int failed = PyDict_SetItem(tenants, key, agg);
        Py_DECREF(agg);
        if (failed) goto fail;
    }
    it = 0;
    while (PyDict_Next(t->model_index, &it, &key, &index)) {
        Py_ssize_t i = PyLong_AsSsize_t(index);
        PyObject *agg = int_list(t->model_count + i * NBANDS, NBANDS, 0, NULL);
        if (agg == NULL) goto fail;
        int failed = PyDict_SetItem(models, key, agg);
        Py_DECREF(agg);
        if (failed) goto fail;
    }
    PyObject *out = PyTuple_Pack(3, bands, tenants, models);
    Py_DECREF(bands);
    Py_DECREF(tenants);
    Py_DECREF(models);
    return out;
fail:
    Py_XDECREF(bands);
    Py_XDECREF(tenants);
    Py_XDECREF(models);
    return NULL;
}

#define SLOT(obj, k) (*(PyObject **)((char *)(obj) + slot_at[k]))

static PyObject *run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) != CTX_SIZE ||
        !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "run(ctx, msgs: list, start, started_ms, finished_ms)");
        return NULL;
    }
    PyObject *ctx = args[0], *msgs = args[1];
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    long long started, finished;
    if ((start == -1 && PyErr_Occurred()) || get_ll(args[3], &started) < 0 || get_ll(args[4], &finished) < 0) {
        PyErr_SetString(PyExc_TypeError, "start, started_ms and finished_ms must be ints");
        return NULL;
    }
    PyObject *decode = PyTuple_GET_ITEM(ctx, 0), *req_header = PyTuple_GET_ITEM(ctx, 1);
    PyObject *offsets = PyTuple_GET_ITEM(ctx, 2), *encode = PyTuple_GET_ITEM(ctx, 3);
    PyObject *resp_header = PyTuple_GET_ITEM(ctx, 4), *completed = PyTuple_GET_ITEM(ctx, 5);
    PyObject *worker_id = PyTuple_GET_ITEM(ctx, 6), *answers = PyTuple_GET_ITEM(ctx, 7);
    PyObject *seen = PyTuple_GET_ITEM(ctx, 9), *cancelled = PyTuple_GET_ITEM(ctx, 10);
    PyObject *band_of = PyTuple_GET_ITEM(ctx, 11), *bounds = PyTuple_GET_ITEM(ctx, 12);
    PyObject *request_type = PyTuple_GET_ITEM(ctx, 17);
    long long max_out, max_skew, max_tokens_limit, max_tenant, max_trace;
    if (get_ll(PyTuple_GET_ITEM(ctx, 8), &max_out) < 0 || get_ll(PyTuple_GET_ITEM(ctx, 13), &max_skew) < 0 ||
        get_ll(PyTuple_GET_ITEM(ctx, 14), &max_tokens_limit) < 0 || get_ll(PyTuple_GET_ITEM(ctx, 15), &max_tenant) < 0 ||
        get_ll(PyTuple_GET_ITEM(ctx, 16), &max_trace) < 0 || !PyBytes_CheckExact(req_header) ||
        !PyTuple_CheckExact(offsets) || PyTuple_GET_SIZE(offsets) != F_COUNT || !PyTuple_CheckExact(answers) ||
        PyTuple_GET_SIZE(answers) != 256 || !PyAnySet_CheckExact(seen) || !PyDict_Check(band_of) ||
        !PyTuple_CheckExact(bounds) || PyTuple_GET_SIZE(bounds) > MAX_BOUNDS || max_out < 1 ||
        (cancelled != Py_None && !PyDict_Check(cancelled)) || !PyType_Check(request_type)) {
        PyErr_SetString(PyExc_TypeError, "malformed fast-lane context");
        return NULL;
    }
    Py_ssize_t slot_at[F_COUNT];
    for (int k = 0; k < F_COUNT; k++) {
        slot_at[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(offsets, k));
        if (slot_at[k] <= 0 || (size_t)slot_at[k] + sizeof(PyObject *) > (size_t)((PyTypeObject *)request_type)->tp_basicsize) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "malformed fast-lane context: slot offsets");
            return NULL;
        }
    }
    Py_ssize_t nbounds = PyTuple_GET_SIZE(bounds);
    double bound[MAX_BOUNDS];
    for (Py_ssize_t j = 0; j < nbounds; j++) bound[j] = PyFloat_AsDouble(PyTuple_GET_ITEM(bounds, j));
    if (PyErr_Occurred()) return NULL;
    const char *rh = PyBytes_AS_STRING(req_header);
    Py_ssize_t rh_len = PyBytes_GET_SIZE(req_header);
    Py_ssize_t n = PyList_GET_SIZE(msgs);
    if (start < 0) start = 0;

    Sums sums;
    PyObject *values = PyList_New(0), *keys = PyList_New(0), *ids = PyList_New(0), *runs = PyList_New(0);
    PyObject *header_len = PyLong_FromSsize_t(rh_len), *started_obj = PyLong_FromLongLong(started);
    PyObject *finished_obj = PyLong_FromLongLong(finished);
    PyObject *pos = NULL, *result = NULL, *sums_out = NULL;
    PyObject *run_topic = NULL, *run_offsets = NULL; /* borrowed from runs */
    long run_partition = -1;
    int sums_ready = sums_init(&sums, nbounds + 1, n - start) == 0;
    if (!values || !keys || !ids || !runs || !header_len || !started_obj || !finished_obj || !sums_ready) goto fail;
    Methods methods = {NULL, {NULL}};
    Py_ssize_t i = start;
    for (; i < n; i++) {
        PyObject *msg = PyList_GET_ITEM(msgs, i);
        if (Py_TYPE(msg) != methods.type) methods_for(&methods, Py_TYPE(msg));
        PyObject *req = NULL, *topic = NULL, *value = NULL, *tmp = NULL;
        /* -- decode: only a current-schema single-object body the native decoder reads */
        tmp = call(&methods, msg, M_ERROR);
        if (tmp == NULL) goto fail;
        int is_error = tmp != Py_None;
        Py_DECREF(tmp);
        if (is_error) break;
        value = call(&methods, msg, M_VALUE);
        if (value == NULL) goto fail;
        if (!PyBytes_CheckExact(value) || PyBytes_GET_SIZE(value) <= rh_len ||
            memcmp(PyBytes_AS_STRING(value), rh, rh_len) != 0) {
            Py_DECREF(value);
            break;
        }
        PyObject *call_args[2] = {value, header_len};
        req = PyObject_Vectorcall(decode, call_args, 2, NULL);
        Py_DECREF(value);
        if (req == NULL) goto fail;
        if ((PyObject *)Py_TYPE(req) != request_type) { /* None: not read natively */
            Py_DECREF(req);
            break;
        }
        /* -- validate_request, expiry, cancellation, duplicate (checked, not yet recorded) */
        PyObject *f[F_COUNT];
        int ok = 1;
        for (int k = 0; k < F_COUNT && ok; k++) ok = (f[k] = SLOT(req, k)) != NULL;
        long long max_tokens = 0, created_at = 0, timeout_ms = 0;
        ok = ok && tenant_ok(f[F_TENANT_ID], (Py_ssize_t)max_tenant) && nonempty_str(f[F_PROMPT]) &&
             get_ll(f[F_MAX_TOKENS], &max_tokens) == 0 && max_tokens > 0 && max_tokens <= max_tokens_limit &&
             get_ll(f[F_TIMEOUT_MS], &timeout_ms) == 0 && timeout_ms > 0 && nonempty_str(f[F_MODEL]) &&
             uuid_ok(f[F_REQUEST_ID]) && trace_ok(f[F_TRACE_ID], (Py_ssize_t)max_trace) &&
             get_ll(f[F_CREATED_AT], &created_at) == 0 && created_at <= started + max_skew &&
             created_at + timeout_ms > started && PyDict_CheckExact(f[F_METADATA]) &&
             PyDict_GET_SIZE(f[F_METADATA]) == 0 && (f[F_ADMITTED_AT] == Py_None || PyLong_CheckExact(f[F_ADMITTED_AT]));
        PyObject *band_index = ok ? PyDict_GetItemWithError(band_of, f[F_PRIORITY]) : NULL;
        if (ok && band_index == NULL) {
            if (PyErr_Occurred()) goto fail_req;
            ok = 0;
        }
        if (ok && f[F_EFFECTIVE_PRIORITY] != Py_None && PyDict_GetItemWithError(band_of, f[F_EFFECTIVE_PRIORITY]) == NULL) {
            if (PyErr_Occurred()) goto fail_req;
            ok = 0;
        }
        if (ok) {
            int found = PySet_Contains(seen, f[F_REQUEST_ID]);
            if (found < 0) goto fail_req;
            if (!found && cancelled != Py_None) {
                found = PyDict_Contains(cancelled, f[F_REQUEST_ID]);
                if (found < 0) goto fail_req;
            }
            ok = !found;
        }
        long band = ok ? PyLong_AsLong(band_index) : -1;
        if (band < 0 || band >= NBANDS) {
            PyErr_Clear();
            Py_DECREF(req);
            break;
        }
        /* -- the simulated model: SimulatedBackend._answer */
        long long tokens = max_tokens > max_out ? max_out : (max_tokens < 1 ? 1 : max_tokens);
        int64_t seed = crc_of(f[F_MODEL], 0);
        int64_t variant = seed < 0 ? -1 : crc_of(f[F_PROMPT], (uint32_t)seed);
        if (variant < 0) {
            Py_DECREF(req);
            break;
        }
        PyObject *sentences = PyTuple_GET_ITEM(answers, variant % 256);
        if (!PyTuple_CheckExact(sentences) || PyTuple_GET_SIZE(sentences) <= tokens) {
            Py_DECREF(req);
            break;
        }
        PyObject *output = PyTuple_GET_ITEM(sentences, tokens);
        Py_ssize_t prompt_chars = PyUnicode_GET_LENGTH(f[F_PROMPT]);
        long long prompt_tokens = (prompt_chars + 3) / 4;
        if (prompt_tokens == 0) prompt_tokens = 1;
        /* -- the COMPLETED response, in RESPONSE_FIELDS order (as _respond_completed_many builds it) */
        PyObject *meta = PyDict_New();
        if (meta == NULL) goto fail_req;
        if (f[F_TRACE_ID] != Py_None && PyDict_SetItem(meta, s_trace_id, f[F_TRACE_ID]) < 0) {
            Py_DECREF(meta);
            goto fail_req;
        }
        PyObject *served = f[F_EFFECTIVE_PRIORITY] != Py_None ? f[F_EFFECTIVE_PRIORITY] : f[F_PRIORITY];
        PyObject *prompt_obj = PyLong_FromLongLong(prompt_tokens), *tokens_obj = PyLong_FromLongLong(tokens);
        PyObject *fields = prompt_obj && tokens_obj ? PyTuple_New(20) : NULL;
        if (fields == NULL) {
            Py_DECREF(meta);
            Py_XDECREF(prompt_obj);
            Py_XDECREF(tokens_obj);
            goto fail_req;
        }
        PyObject *items[20] = {
            f[F_REQUEST_ID], f[F_TENANT_ID], completed, Py_None, output, prompt_obj, tokens_obj, f[F_MODEL],
            f[F_DEGRADED_FROM] != Py_None ? Py_True : Py_False, f[F_PRIORITY], served, f[F_CREATED_AT],
            f[F_ADMITTED_AT], started_obj, finished_obj, worker_id, Py_None, meta, Py_None, Py_None,
        };
        for (int k = 0; k < 20; k++) {
            if (k != 5 && k != 6 && k != 17) Py_INCREF(items[k]); /* the three new ones are stolen */
            PyTuple_SET_ITEM(fields, k, items[k]);
        }
        PyObject *enc_args[2] = {fields, resp_header};
        PyObject *encoded = PyObject_Vectorcall(encode, enc_args, 2, NULL);
        Py_DECREF(fields);
        if (encoded == NULL) goto fail_req;
        if (encoded == Py_None) { /* e.g. over the size caps: the Python path answers FAILED */
            Py_DECREF(encoded);
            Py_DECREF(req);
            break;
        }
        /* -- recorded: the answer, the id, where it came from, the metric sums */
        Py_ssize_t used = sums.tenants;
        Py_ssize_t t = index_of(sums.tenant_index, f[F_TENANT_ID], &sums.tenants);
        if (t >= 0 && t == used) {
            sums.tenant_key[t] = PyUnicode_AsUTF8String(f[F_TENANT_ID]);
            if (sums.tenant_key[t] == NULL) t = -1;
        }
        int failed = t < 0 || PyList_Append(values, encoded) < 0 || PyList_Append(keys, sums.tenant_key[t]) < 0 ||
                     PySet_Add(seen, f[F_REQUEST_ID]) < 0 || PyList_Append(ids, f[F_REQUEST_ID]) < 0;
        Py_DECREF(encoded);
        if (failed) goto fail_req;
        topic = call(&methods, msg, M_TOPIC);
        PyObject *part_obj = topic ? call(&methods, msg, M_PARTITION) : NULL;
        PyObject *off_obj = part_obj ? call(&methods, msg, M_OFFSET) : NULL;
        if (off_obj == NULL) {
            Py_XDECREF(part_obj);
            goto fail_req;
        }
        long partition = PyLong_AsLong(part_obj);
        int same = run_topic != NULL && partition == run_partition;
        if (same) {
            same = PyUnicode_Compare(topic, run_topic) == 0;
            if (PyErr_Occurred()) PyErr_Clear();
        }
        if (!same) {
            run_offsets = PyList_New(0);
            PyObject *entry = run_offsets ? PyTuple_Pack(3, topic, part_obj, run_offsets) : NULL;
            Py_XDECREF(run_offsets); /* entry holds it */
            if (entry == NULL || PyList_Append(runs, entry) < 0) {
                Py_XDECREF(entry);
                Py_DECREF(part_obj);
                Py_DECREF(off_obj);
                goto fail_req;
            }
            Py_DECREF(entry);
            run_topic = PyTuple_GET_ITEM(entry, 0);
            run_partition = partition;
        }
        failed = PyList_Append(run_offsets, off_obj) < 0;
        Py_DECREF(part_obj);
        Py_DECREF(off_obj);
        if (failed) goto fail_req;
        /* the wait (WorkerMetrics.waited_many) and the outcome (completed_many, backend time 0) */
        long long waited = started - created_at;
        double seconds = waited > 0 ? waited / 1000.0 : 0.0;
        Py_ssize_t bucket = 0;
        while (bucket < nbounds && bound[bucket] < seconds) bucket++; /* bisect_left */
        sums.band_count[band]++;
        sums.band_prompt[band] += prompt_tokens;
        sums.band_completion[band] += tokens;
        sums.band_wait[band] += seconds;
        sums.band_buckets[band][bucket]++;
        sums.tenant_count[t]++;
        sums.tenant_wait[t] += seconds;
        sums.tenant_buckets[t * sums.nbuckets + bucket]++;
        Py_ssize_t mi = index_of(sums.model_index, f[F_MODEL], &sums.models);
        if (mi < 0) goto fail_req;
        sums.model_count[mi * NBANDS + band]++;
        Py_DECREF(topic);
        Py_DECREF(req);
        continue;
    fail_req:
        Py_XDECREF(topic);
        Py_DECREF(req);
        goto fail;
    }
    pos = PyLong_FromSsize_t(i);
    sums_out = pos ? sums_result(&sums) : NULL;
    if (sums_out != NULL)
        result = PyTuple_Pack(8, pos, values, keys, ids, runs, PyTuple_GET_ITEM(sums_out, 0),
                              PyTuple_GET_ITEM(sums_out, 1), PyTuple_GET_ITEM(sums_out, 2));
    goto done;
fail:
    result = NULL;
done:
    sums_free(&sums);
    Py_XDECREF(sums_out);
    Py_XDECREF(pos);
    Py_XDECREF(values);
    Py_XDECREF(keys);
    Py_XDECREF(ids);
    Py_XDECREF(runs);
    Py_XDECREF(header_len);
    Py_XDECREF(started_obj);
    Py_XDECREF(finished_obj);
    return result;
}

/* crc32(data: bytes, seed: int = 0) -> int: the CRC run() uses, for tests against zlib.crc32. */
static PyObject *crc32_py(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2 || !PyBytes_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "crc32(data: bytes, seed: int = 0)");
        return NULL;
    }
    unsigned long seed = nargs == 2 ? PyLong_AsUnsignedLong(args[1]) : 0;
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLong(
        crc32_update((uint32_t)seed, (const uint8_t *)PyBytes_AS_STRING(args[0]), PyBytes_GET_SIZE(args[0])));
}

static PyMethodDef methods[] = {
    {"run", (PyCFunction)(void (*)(void))run, METH_FASTCALL,
     "run(ctx, msgs, start, started_ms, finished_ms) -> (stop, values, keys, ids, runs, bands, tenants, models)"},
    {"crc32", (PyCFunction)(void (*)(void))crc32_py, METH_FASTCALL, "crc32(data: bytes, seed: int = 0) -> int"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pipeline.worker._lane",
    "The worker's fast lane for requests the simulated model answers at once (see pipeline/worker/fastlane.py).",
    -1, methods,
};

/* The context layout and results this file implements; fastlane.py refuses any other. */
#define LANE_ABI 1

PyMODINIT_FUNC PyInit__lane(void) {
    crc_init();
    static const char *names[M_COUNT] = {"error", "value", "topic", "partition", "offset"};
    for (int k = 0; k < M_COUNT; k++)
        if ((method_names[k] = PyUnicode_InternFromString(names[k])) == NULL) return NULL;
    if ((s_trace_id = PyUnicode_InternFromString("trace_id")) == NULL) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "ABI", LANE_ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
