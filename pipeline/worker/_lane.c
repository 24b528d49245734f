/*
 * The worker's fast lane: a C twin of what Worker._process_batch does with an ordinary
 * request when the backend answers at once (the simulated model without latency).
 *
 * Like the native codec it is a fast path, never the judge. run() takes the consumed
 * messages from index `start` on, one by one, and stops at the first one that is not
 * ordinary in every respect: an error, a value that is not a current single-object
 * request read completely and canonically, any field the validation would question (or
 * that this code does not check as precisely: a tenant id that is not printable ASCII, a
 * non-empty map), a request id seen before, a cancelled or expired request, a response
 * over the caps. It returns where it stopped, and the worker takes that message through
 * the Python path, which decides and explains, then calls run() again after it. So every
 * message is handled in consumption order, by exactly one of the two, and the answers
 * are the bytes the Python path writes (tests/unit/worker/test_fastlane.py compares them).
 *
 * It transcodes: the request body is read in place (strings as spans of the message's
 * bytes, checked to be UTF-8 as strictly as the decoder does) and the response is written
 * straight from them, so an answer costs no Python objects but its request id, its bytes
 * and its offset.
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
 * ctx (built and checked by pipeline/worker/fastlane.py):
 *   0 request program (fastpath's native program of the current LLMRequest schema)
 *   1 field index in it of each of the F_* fields below (tuple of int)
 *   2 request header (bytes): the single-object header of the current schema
 *   3 response program (native program of the current LLMResponse schema)
 *   4 response header (bytes)
 *   5 Status.COMPLETED    6 worker id (str)
 *   7 answers: tuple of 256 tuples of str (the simulated model's sentence prefixes)
 *   8 max output tokens   9 seen request ids (set)   10 cancelled ids (dict) or None
 *   11 {Priority: band index}   12 wait bucket bounds (tuple of float, ascending)
 *   13 max clock skew (ms)  14 max_tokens limit  15 max tenant id characters
 *   16 max trace id characters
 * A response program's fields are written from the positions (field_slots) of
 * RESPONSE_FIELDS: request_id, tenant_id, status, reason, output, prompt_tokens,
 * completion_tokens, model, degraded, requested_priority, served_priority, created_at,
 * admitted_at, started_at, finished_at, worker_id, retry_after_ms, metadata,
 * queue_position, eta_ms.
 */
#include "../serde/_request.h"

#define CTX_SIZE 17
#define NBANDS 5
#define MAX_BOUNDS 64
#define RESPONSE_POSITIONS 20

/* Positions of RESPONSE_FIELDS. */
enum {
    R_REQUEST_ID, R_TENANT_ID, R_STATUS, R_REASON, R_OUTPUT, R_PROMPT_TOKENS, R_COMPLETION_TOKENS, R_MODEL,
    R_DEGRADED, R_REQUESTED_PRIORITY, R_SERVED_PRIORITY, R_CREATED_AT, R_ADMITTED_AT, R_STARTED_AT,
    R_FINISHED_AT, R_WORKER_ID, R_RETRY_AFTER_MS, R_METADATA, R_QUEUE_POSITION, R_ETA_MS
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

/* The message methods run() calls, looked up once per call on the messages' type. */
enum { M_ERROR, M_VALUE, M_TOPIC, M_PARTITION, M_OFFSET, M_COUNT };
static PyObject *method_names[M_COUNT];

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




/* The response program, unpacked once per run(). */
typedef struct {
    Py_ssize_t nfields, max_record;
    const uint8_t *ops;
    int position[MAX_FIELDS];        /* R_* */
    Py_ssize_t cap[MAX_FIELDS];      /* strings: byte cap, -1 none */
    long map_entries[MAX_FIELDS];    /* maps: most entries */
    Py_ssize_t map_bytes[MAX_FIELDS];/* maps: most bytes of a key or value */
    int64_t completed;               /* the index of COMPLETED in the status enum */
    int64_t requested[MAX_ENUM];     /* request priority index -> requested_priority index */
    int64_t served[MAX_ENUM];        /* request priority index -> served_priority index */
    int64_t served_eff[MAX_ENUM];    /* effective_priority index -> served_priority index */
    long band[MAX_ENUM];             /* request priority index -> band */
} ResponsePlan;


/* The response program and the enum mappings; -1 when it is not the one this code writes. */
static int response_plan(ResponsePlan *plan, PyObject *program, PyObject *completed,
                         PyObject *req_program, PyObject *band_of, PyObject *request_index) {
    if (!PyTuple_CheckExact(program) || PyTuple_GET_SIZE(program) != PROGRAM_SIZE) return -1;
    PyObject *ops = PyTuple_GET_ITEM(program, 0), *args = PyTuple_GET_ITEM(program, 1);
    PyObject *slots = PyTuple_GET_ITEM(program, 7);
    if (!PyBytes_CheckExact(ops) || !PyTuple_CheckExact(args) || !PyTuple_CheckExact(slots)) return -1;
    plan->nfields = PyBytes_GET_SIZE(ops);
    if (plan->nfields > MAX_FIELDS || PyTuple_GET_SIZE(args) != plan->nfields ||
        PyTuple_GET_SIZE(slots) != plan->nfields)
        return -1;
    plan->ops = (const uint8_t *)PyBytes_AS_STRING(ops);
    plan->max_record = PyLong_AsSsize_t(PyTuple_GET_ITEM(program, 9));
    if (PyErr_Occurred()) return -1;
    int have_requested = 0, have_served = 0, have_status = 0;
    plan->completed = -1; /* set below, or the plan is refused */
    for (Py_ssize_t i = 0; i < plan->nfields; i++) {
        PyObject *arg = PyTuple_GET_ITEM(args, i);
        Py_ssize_t position = PyLong_AsSsize_t(PyTuple_GET_ITEM(slots, i));
        if (position < 0 || position >= RESPONSE_POSITIONS) return -1;
        plan->position[i] = (int)position;
        int type = plan->ops[i] & OP_TYPE;
        plan->cap[i] = type == OP_STRING ? cap_of(arg) : -1;
        if (type == OP_MAP) {
            if (!PyTuple_CheckExact(arg) || PyTuple_GET_SIZE(arg) != 2) return -1;
            plan->map_entries[i] = PyLong_AsLong(PyTuple_GET_ITEM(arg, 0));
            plan->map_bytes[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(arg, 1));
            if (PyErr_Occurred()) return -1;
        }
        if (type != OP_ENUM) continue;
        if (!PyTuple_CheckExact(arg) || PyTuple_GET_SIZE(arg) != 2 || !PyDict_Check(PyTuple_GET_ITEM(arg, 1)))
            return -1;
        PyObject *to = PyTuple_GET_ITEM(arg, 1);
        /* from: the request enum whose member this field carries */
        int from_field = position == R_REQUESTED_PRIORITY ? F_PRIORITY : position == R_SERVED_PRIORITY ? F_PRIORITY : -1;
        if (position == R_STATUS) {
            PyObject *index = PyDict_GetItemWithError(to, completed);
            if (index == NULL) return -1;
            plan->completed = PyLong_AsLongLong(index);
            have_status = 1;
            continue;
        }
        if (from_field < 0) return -1;
        for (int pass = 0; pass < (position == R_SERVED_PRIORITY ? 2 : 1); pass++) {
            int f = pass == 0 ? F_PRIORITY : F_EFFECTIVE_PRIORITY;
            Py_ssize_t ri = PyLong_AsSsize_t(PyTuple_GET_ITEM(request_index, f));
            PyObject *members = PyTuple_GET_ITEM(PyTuple_GET_ITEM(PyTuple_GET_ITEM(req_program, 1), ri), 0);
            Py_ssize_t n = PyTuple_GET_SIZE(members);
            if (n > MAX_ENUM) return -1;
            for (Py_ssize_t v = 0; v < n; v++) {
                PyObject *member = PyTuple_GET_ITEM(members, v);
                PyObject *index = PyDict_GetItemWithError(to, member);
                if (index == NULL) return -1;
                int64_t out = PyLong_AsLongLong(index);
                if (position == R_REQUESTED_PRIORITY) plan->requested[v] = out;
                else if (pass == 0) plan->served[v] = out;
                else plan->served_eff[v] = out;
                if (pass == 0 && position == R_REQUESTED_PRIORITY) {
                    PyObject *band = PyDict_GetItemWithError(band_of, member);
                    if (band == NULL) return -1;
                    plan->band[v] = PyLong_AsLong(band);
                    if (plan->band[v] < 0 || plan->band[v] >= NBANDS) return -1;
                }
            }
        }
        if (position == R_REQUESTED_PRIORITY) have_requested = 1;
        else have_served = 1;
    }
    if (PyErr_Occurred() || !have_requested || !have_served || !have_status) return -1;
    return 0;
}

/* One response field: null (NULL value), a string span, a number, or a one-entry map
 * {"trace_id": span} (map with s.p != NULL) / {} (s.p == NULL). -1: not writable. */
static int put_null(Writer *w, int op) {
    if (!(op & (NULL_FIRST | NULL_SECOND))) return -1;
    return put_long(w, (op & NULL_FIRST) ? 0 : 1);
}

static int put_branch(Writer *w, int op) {
    if (!(op & (NULL_FIRST | NULL_SECOND))) return 0;
    return put_long(w, (op & NULL_FIRST) ? 1 : 0);
}

static int put_str(Writer *w, int op, Py_ssize_t cap, const uint8_t *p, Py_ssize_t n) {
    if ((op & OP_TYPE) != OP_STRING || (cap >= 0 && n > cap) || put_branch(w, op) < 0) return -1;
    return put_bytes(w, (const char *)p, n);
}

static int put_num(Writer *w, int op, int64_t v) {
    int type = op & OP_TYPE;
    if (type != OP_INT && type != OP_LONG) return -1;
    if (type == OP_INT && (v < INT32_MIN || v > INT32_MAX)) return -1;
    if (put_branch(w, op) < 0) return -1;
    return put_long(w, v);
}

static int put_enum(Writer *w, int op, int64_t index) {
    if ((op & OP_TYPE) != OP_ENUM || put_branch(w, op) < 0) return -1;
    return put_long(w, index);
}


/* -- per-run tables: distinct tenants and models, found by their bytes ---------------- */

typedef struct {
    uint64_t hash;
    PyObject *str; /* NULL: empty slot */
    Py_ssize_t index;
} Entry;

typedef struct {
    Entry *slots;
    Py_ssize_t mask, used;
    PyObject **strs; /* by index */
} Table;

static int table_init(Table *t, Py_ssize_t most) {
    Py_ssize_t cap = 16;
    while (cap < 2 * most + 2) cap *= 2;
    t->slots = PyMem_Calloc(cap, sizeof(Entry));
    t->strs = PyMem_Calloc(most + 1, sizeof(PyObject *));
    t->mask = cap - 1;
    t->used = 0;
    return t->slots && t->strs ? 0 : -1;
}

static void table_free(Table *t) {
    for (Py_ssize_t i = 0; i < t->used; i++) Py_XDECREF(t->strs[i]);
    PyMem_Free(t->slots);
    PyMem_Free(t->strs);
}

static uint64_t fnv1a(const uint8_t *p, Py_ssize_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (Py_ssize_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
    return h;
}

/* The index of the UTF-8 span s in t, adding it (as a new str) if new: >= 0, or -1 with an
 * exception set. *added says whether it was new. */
static Py_ssize_t table_find(Table *t, const Span *s, int *added) {
    uint64_t h = fnv1a(s->p, s->n);
    Py_ssize_t i = (Py_ssize_t)(h & (uint64_t)t->mask);
    *added = 0;
    for (;;) {
        Entry *e = &t->slots[i];
        if (e->str == NULL) break;
        if (e->hash == h) {
            Py_ssize_t n;
            const char *utf8 = PyUnicode_AsUTF8AndSize(e->str, &n);
            if (utf8 != NULL && n == s->n && memcmp(utf8, s->p, n) == 0) return e->index;
        }
        i = (i + 1) & t->mask;
    }
    PyObject *str = PyUnicode_DecodeUTF8((const char *)s->p, s->n, "strict");
    if (str == NULL) return -1;
    Entry *e = &t->slots[i];
    e->hash = h;
    e->str = str; /* owned through t->strs */
    e->index = t->used;
    t->strs[t->used] = str;
    *added = 1;
    return t->used++;
}

/* -- metric sums, in C until the end of the run -------------------------------------- */

typedef struct {
    Py_ssize_t nbuckets; /* bounds + 1 (+Inf) */
    long long band_count[NBANDS], band_prompt[NBANDS], band_completion[NBANDS];
    double band_wait[NBANDS];
    long long band_buckets[NBANDS][MAX_BOUNDS + 1];
    Table tenants, models;
    PyObject **tenant_key;                    /* [tenant]: its UTF-8 bytes, the message key */
    long long *tenant_count, *tenant_buckets; /* [tenant], [tenant * nbuckets + bucket] */
    double *tenant_wait;
    uint32_t *model_crc;    /* [model]: crc32 of its UTF-8, the simulated model's seed */
    long long *model_count; /* [model * NBANDS + band] */
} Sums;

static int sums_init(Sums *t, Py_ssize_t nbuckets, Py_ssize_t most) {
    memset(t, 0, sizeof *t);
    t->nbuckets = nbuckets;
    if (most < 1) most = 1;
    if (table_init(&t->tenants, most) < 0 || table_init(&t->models, most) < 0) goto nomem;
    t->tenant_key = PyMem_Calloc(most, sizeof(PyObject *));
    t->tenant_count = PyMem_Calloc(most, sizeof(long long));
    t->tenant_buckets = PyMem_Calloc(most * nbuckets, sizeof(long long));
    t->tenant_wait = PyMem_Calloc(most, sizeof(double));
    t->model_crc = PyMem_Calloc(most, sizeof(uint32_t));
    t->model_count = PyMem_Calloc(most * NBANDS, sizeof(long long));
    if (!t->tenant_key || !t->tenant_count || !t->tenant_buckets || !t->tenant_wait || !t->model_crc ||
        !t->model_count)
        goto nomem;
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

static void sums_free(Sums *t) {
    if (t->tenant_key != NULL)
        for (Py_ssize_t i = 0; i < t->tenants.used; i++) Py_XDECREF(t->tenant_key[i]);
    table_free(&t->tenants);
    table_free(&t->models);
    PyMem_Free(t->tenant_key);
    PyMem_Free(t->tenant_count);
    PyMem_Free(t->tenant_buckets);
    PyMem_Free(t->tenant_wait);
    PyMem_Free(t->model_crc);
    PyMem_Free(t->model_count);
}

/* A list of head (stolen on success) followed by the ints of values. */
static PyObject *int_list(const long long *values, Py_ssize_t n, Py_ssize_t prefix, PyObject **head) {
    PyObject *list = PyList_New(prefix + n);
    if (list == NULL) return NULL;
    for (Py_ssize_t k = 0; k < prefix; k++) PyList_SET_ITEM(list, k, head[k]);
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

/* The sums as run() returns them: a tuple (bands, tenants, models). */
static PyObject *sums_result(Sums *t) {
    PyObject *bands = PyList_New(NBANDS), *tenants = PyDict_New(), *models = PyDict_New();
    if (!bands || !tenants || !models) goto fail;
    for (int b = 0; b < NBANDS; b++) {
        if (!t->band_count[b]) {
            Py_INCREF(Py_None);
            PyList_SET_ITEM(bands, b, Py_None);
            continue;
        }
        PyObject *head[4] = {PyLong_FromLongLong(t->band_count[b]), PyLong_FromLongLong(t->band_prompt[b]),
                             PyLong_FromLongLong(t->band_completion[b]), PyFloat_FromDouble(t->band_wait[b])};
        PyObject *agg = head[0] && head[1] && head[2] && head[3] ? int_list(t->band_buckets[b], t->nbuckets, 4, head)
                                                                 : NULL;
        if (agg == NULL) {
            for (int k = 0; k < 4; k++) Py_XDECREF(head[k]);
            goto fail;
        }
        PyList_SET_ITEM(bands, b, agg);
    }
    for (Py_ssize_t i = 0; i < t->tenants.used; i++) {
        PyObject *head[2] = {PyLong_FromLongLong(t->tenant_count[i]), PyFloat_FromDouble(t->tenant_wait[i])};
        PyObject *agg = head[0] && head[1] ? int_list(t->tenant_buckets + i * t->nbuckets, t->nbuckets, 2, head) : NULL;
        if (agg == NULL) {
            Py_XDECREF(head[0]);
            Py_XDECREF(head[1]);
            goto fail;
        }
        int failed = PyDict_SetItem(tenants, t->tenants.strs[i], agg);
        Py_DECREF(agg);
        if (failed) goto fail;
    }
    for (Py_ssize_t i = 0; i < t->models.used; i++) {
        PyObject *agg = int_list(t->model_count + i * NBANDS, NBANDS, 0, NULL);
        if (agg == NULL) goto fail;
        int failed = PyDict_SetItem(models, t->models.strs[i], agg);
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

static PyObject *s_trace_id_bytes; /* b"trace_id" */

/* The COMPLETED response, straight from the request's fields, into w (header first).
 * 0, or -1: not writable here (the Python path writes it, or its FAILED fallback). */
static int write_response(const ResponsePlan *plan, Writer *w, PyObject *header, const Field *f,
                          const uint8_t *output, Py_ssize_t output_n, int64_t prompt_tokens, int64_t tokens,
                          long long started, long long finished, const uint8_t *worker, Py_ssize_t worker_n) {
    Py_ssize_t hlen = PyBytes_GET_SIZE(header);
    if (reserve(w, hlen) < 0) return -1;
    memcpy(w->buf, PyBytes_AS_STRING(header), hlen);
    w->len = hlen;
    for (Py_ssize_t i = 0; i < plan->nfields; i++) {
        int op = plan->ops[i], rc;
        Py_ssize_t cap = plan->cap[i];
        switch (plan->position[i]) {
        case R_REQUEST_ID: rc = put_str(w, op, cap, f[F_REQUEST_ID].s.p, f[F_REQUEST_ID].s.n); break;
        case R_TENANT_ID: rc = put_str(w, op, cap, f[F_TENANT_ID].s.p, f[F_TENANT_ID].s.n); break;
        case R_STATUS: rc = put_enum(w, op, plan->completed); break;
        case R_OUTPUT: rc = put_str(w, op, cap, output, output_n); break;
        case R_PROMPT_TOKENS: rc = put_num(w, op, prompt_tokens); break;
        case R_COMPLETION_TOKENS: rc = put_num(w, op, tokens); break;
        case R_MODEL: rc = put_str(w, op, cap, f[F_MODEL].s.p, f[F_MODEL].s.n); break;
        case R_DEGRADED:
            rc = (op & OP_TYPE) != OP_BOOL || put_branch(w, op) < 0 || reserve(w, 1) < 0 ? -1 : 0;
            if (rc == 0) w->buf[w->len++] = f[F_DEGRADED_FROM].null ? 0 : 1;
            break;
        case R_REQUESTED_PRIORITY: rc = put_enum(w, op, plan->requested[f[F_PRIORITY].v]); break;
        case R_SERVED_PRIORITY:
            rc = put_enum(w, op, f[F_EFFECTIVE_PRIORITY].null ? plan->served[f[F_PRIORITY].v]
                                                              : plan->served_eff[f[F_EFFECTIVE_PRIORITY].v]);
            break;
        case R_CREATED_AT: rc = put_num(w, op, f[F_CREATED_AT].v); break;
        case R_ADMITTED_AT:
            rc = f[F_ADMITTED_AT].null ? put_null(w, op) : put_num(w, op, f[F_ADMITTED_AT].v);
            break;
        case R_STARTED_AT: rc = put_num(w, op, started); break;
        case R_FINISHED_AT: rc = put_num(w, op, finished); break;
        case R_WORKER_ID: rc = put_str(w, op, cap, worker, worker_n); break;
        case R_METADATA: {
            if ((op & OP_TYPE) != OP_MAP || put_branch(w, op) < 0) {
                rc = -1;
                break;
            }
            if (f[F_TRACE_ID].null) {
                rc = put_long(w, 0);
                break;
            }
            Py_ssize_t kn = PyBytes_GET_SIZE(s_trace_id_bytes);
            rc = plan->map_entries[i] < 1 || kn > plan->map_bytes[i] || f[F_TRACE_ID].s.n > plan->map_bytes[i] ||
                         put_long(w, 1) < 0 || put_bytes(w, PyBytes_AS_STRING(s_trace_id_bytes), kn) < 0 ||
                         put_bytes(w, (const char *)f[F_TRACE_ID].s.p, f[F_TRACE_ID].s.n) < 0 || put_long(w, 0) < 0
                     ? -1
                     : 0;
            break;
        }
        default: /* reason, retry_after_ms, queue_position, eta_ms */
            rc = put_null(w, op);
        }
        if (rc < 0) return -1;
    }
    return w->len > plan->max_record ? -1 : 0;
}

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
    PyObject *req_header = PyTuple_GET_ITEM(ctx, 2), *resp_header = PyTuple_GET_ITEM(ctx, 4);
    PyObject *completed = PyTuple_GET_ITEM(ctx, 5), *worker_id = PyTuple_GET_ITEM(ctx, 6);
    PyObject *answers = PyTuple_GET_ITEM(ctx, 7), *seen = PyTuple_GET_ITEM(ctx, 9);
    PyObject *cancelled = PyTuple_GET_ITEM(ctx, 10), *band_of = PyTuple_GET_ITEM(ctx, 11);
    PyObject *bounds = PyTuple_GET_ITEM(ctx, 12);
    long long max_out, max_skew, max_tokens_limit, max_tenant, max_trace;
    RequestPlan rplan;
    ResponsePlan wplan;
    Py_ssize_t worker_n = 0;
    const char *worker = PyUnicode_Check(worker_id) ? PyUnicode_AsUTF8AndSize(worker_id, &worker_n) : NULL;
    if (get_ll(PyTuple_GET_ITEM(ctx, 8), &max_out) < 0 || get_ll(PyTuple_GET_ITEM(ctx, 13), &max_skew) < 0 ||
        get_ll(PyTuple_GET_ITEM(ctx, 14), &max_tokens_limit) < 0 || get_ll(PyTuple_GET_ITEM(ctx, 15), &max_tenant) < 0 ||
        get_ll(PyTuple_GET_ITEM(ctx, 16), &max_trace) < 0 || !PyBytes_CheckExact(req_header) ||
        !PyBytes_CheckExact(resp_header) || worker == NULL || !PyTuple_CheckExact(answers) ||
        PyTuple_GET_SIZE(answers) != 256 || !PyAnySet_CheckExact(seen) || !PyDict_Check(band_of) ||
        !PyTuple_CheckExact(bounds) || PyTuple_GET_SIZE(bounds) > MAX_BOUNDS || max_out < 1 ||
        (cancelled != Py_None && !PyDict_Check(cancelled)) ||
        request_plan(&rplan, PyTuple_GET_ITEM(ctx, 0), PyTuple_GET_ITEM(ctx, 1)) < 0 ||
        response_plan(&wplan, PyTuple_GET_ITEM(ctx, 3), completed, PyTuple_GET_ITEM(ctx, 0), band_of,
                      PyTuple_GET_ITEM(ctx, 1)) < 0) {
        if (PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_MemoryError)) return NULL;
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "malformed fast-lane context");
        return NULL;
    }
    Py_ssize_t nbounds = PyTuple_GET_SIZE(bounds);
    double bound[MAX_BOUNDS];
    for (Py_ssize_t j = 0; j < nbounds; j++) bound[j] = PyFloat_AsDouble(PyTuple_GET_ITEM(bounds, j));
    if (PyErr_Occurred()) return NULL;
    const char *rh = PyBytes_AS_STRING(req_header);
    Py_ssize_t rh_len = PyBytes_GET_SIZE(req_header);
    /* our own list of the messages: Python code run from here (a message's methods) cannot
     * shrink it or free one under us */
    msgs = PyList_GetSlice(msgs, 0, PyList_GET_SIZE(msgs));
    if (msgs == NULL) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(msgs);
    if (start < 0) start = 0;

    Sums sums;
    PyObject *values = PyList_New(0), *keys = PyList_New(0), *ids = PyList_New(0), *runs = PyList_New(0);
    PyObject *pos = NULL, *result = NULL, *sums_out = NULL;
    PyObject *run_topic = NULL, *run_offsets = NULL; /* borrowed from runs */
    long run_partition = -1;
    int sums_ready = sums_init(&sums, nbounds + 1, n - start) == 0;
    if (!values || !keys || !ids || !runs || !sums_ready) goto fail;
    Methods methods = {NULL, {NULL}};
    uint8_t local[2048];
    Py_ssize_t i = start;
    for (; i < n; i++) {
        PyObject *msg = PyList_GET_ITEM(msgs, i);
        if (Py_TYPE(msg) != methods.type) methods_for(&methods, Py_TYPE(msg));
        PyObject *tmp = call(&methods, msg, M_ERROR);
        if (tmp == NULL) goto fail;
        int is_error = tmp != Py_None;
        Py_DECREF(tmp);
        if (is_error) break;
        /* -- read: only a current-schema single-object body, as the native decoder would */
        PyObject *value = call(&methods, msg, M_VALUE);
        if (value == NULL) goto fail;
        Py_ssize_t size = PyBytes_CheckExact(value) ? PyBytes_GET_SIZE(value) : -1;
        const uint8_t *data = size >= 0 ? (const uint8_t *)PyBytes_AS_STRING(value) : NULL;
        Field f[F_COUNT];
        int ok = size > rh_len && memcmp(data, rh, rh_len) == 0 && size - rh_len <= rplan.quick &&
                 size <= rplan.max_record && read_request(&rplan, data + rh_len, data + size, f);
        /* -- validate_request, expiry (the duplicate and cancellation checks need the id) */
        ok = ok && tenant_ok(&f[F_TENANT_ID].s, (Py_ssize_t)max_tenant) && f[F_PROMPT].s.n > 0 &&
             f[F_MAX_TOKENS].v > 0 && f[F_MAX_TOKENS].v <= max_tokens_limit && f[F_TIMEOUT_MS].v > 0 &&
             f[F_MODEL].s.n > 0 && uuid_ok(&f[F_REQUEST_ID].s) && trace_ok(&f[F_TRACE_ID], (Py_ssize_t)max_trace) &&
             f[F_CREATED_AT].v <= started + max_skew && !expired(f[F_CREATED_AT].v, f[F_TIMEOUT_MS].v, started);
        if (!ok) {
            Py_DECREF(value);
            break;
        }
        PyObject *request_id = PyUnicode_DecodeASCII((const char *)f[F_REQUEST_ID].s.p, 36, "strict");
        if (request_id == NULL) {
            Py_DECREF(value);
            goto fail;
        }
        int found = PySet_Contains(seen, request_id);
        if (found == 0 && cancelled != Py_None) found = PyDict_Contains(cancelled, request_id);
        if (found != 0) {
            Py_DECREF(request_id);
            Py_DECREF(value);
            if (found < 0) goto fail;
            break;
        }
        /* -- the simulated model: SimulatedBackend._answer */
        int added;
        Py_ssize_t m = table_find(&sums.models, &f[F_MODEL].s, &added);
        if (m < 0) {
            Py_DECREF(request_id);
            Py_DECREF(value);
            goto fail;
        }
        if (added) sums.model_crc[m] = crc32_update(0, f[F_MODEL].s.p, f[F_MODEL].s.n);
        int64_t tokens = f[F_MAX_TOKENS].v > max_out ? max_out : (f[F_MAX_TOKENS].v < 1 ? 1 : f[F_MAX_TOKENS].v);
        uint32_t variant = crc32_update(sums.model_crc[m], f[F_PROMPT].s.p, f[F_PROMPT].s.n) % 256;
        PyObject *sentences = PyTuple_GET_ITEM(answers, variant);
        Py_ssize_t output_n = 0;
        const char *output = PyTuple_CheckExact(sentences) && PyTuple_GET_SIZE(sentences) > tokens
                                 ? PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(sentences, tokens), &output_n)
                                 : NULL;
        int64_t prompt_tokens = (f[F_PROMPT].s.chars + 3) / 4;
        if (prompt_tokens == 0) prompt_tokens = 1;
        /* -- the COMPLETED response, as _respond_completed_many writes it */
        Writer w = {local, 0, sizeof local, local};
        int written = output != NULL && write_response(&wplan, &w, resp_header, f, (const uint8_t *)output, output_n,
                                                       prompt_tokens, tokens, started, finished,
                                                       (const uint8_t *)worker, worker_n) == 0;
        if (PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_MemoryError)) {
                Py_DECREF(request_id);
                Py_DECREF(value);
                goto fail;
            }
            PyErr_Clear();
        }
        PyObject *encoded = written ? PyBytes_FromStringAndSize((const char *)w.buf, w.len) : NULL;
        writer_free(&w);
        if (!written) { /* e.g. over the size caps: the Python path answers FAILED */
            Py_DECREF(request_id);
            Py_DECREF(value);
            break;
        }
        /* -- where it came from (before anything is recorded: a message that cannot say is
         * left to the Python path whole) */
        PyObject *topic = call(&methods, msg, M_TOPIC);
        PyObject *part_obj = topic ? call(&methods, msg, M_PARTITION) : NULL;
        PyObject *off_obj = part_obj ? call(&methods, msg, M_OFFSET) : NULL;
        long partition = off_obj && PyUnicode_Check(topic) && PyLong_CheckExact(part_obj) && PyLong_CheckExact(off_obj)
                             ? PyLong_AsLong(part_obj)
                             : -1;
        if (partition < 0) {
            int raised = PyErr_Occurred() != NULL;
            Py_XDECREF(topic);
            Py_XDECREF(part_obj);
            Py_XDECREF(off_obj);
            Py_XDECREF(encoded);
            Py_DECREF(request_id);
            Py_DECREF(value);
            if (raised) goto fail;
            break;
        }
        /* -- recorded: the answer, the id, where it came from, the metric sums */
        Py_ssize_t t = encoded ? table_find(&sums.tenants, &f[F_TENANT_ID].s, &added) : -1;
        if (t >= 0 && added) {
            sums.tenant_key[t] = PyBytes_FromStringAndSize((const char *)f[F_TENANT_ID].s.p, f[F_TENANT_ID].s.n);
            if (sums.tenant_key[t] == NULL) t = -1;
        }
        int failed = t < 0 || PyList_Append(values, encoded) < 0 || PyList_Append(keys, sums.tenant_key[t]) < 0 ||
                     PySet_Add(seen, request_id) < 0 || PyList_Append(ids, request_id) < 0;
        Py_XDECREF(encoded);
        Py_DECREF(request_id);
        long long created_at = f[F_CREATED_AT].v;
        long band = wplan.band[f[F_PRIORITY].v];
        Py_DECREF(value); /* f's spans are no longer used */
        if (failed) {
            Py_DECREF(topic);
            Py_DECREF(part_obj);
            Py_DECREF(off_obj);
            goto fail;
        }
        int same = run_topic != NULL && partition == run_partition;
        if (same) {
            same = PyUnicode_Compare(topic, run_topic) == 0;
            if (PyErr_Occurred()) PyErr_Clear();
        }
        if (!same) {
            run_offsets = PyList_New(0);
            PyObject *entry = run_offsets ? PyTuple_Pack(3, topic, part_obj, run_offsets) : NULL;
            Py_XDECREF(run_offsets); /* entry holds it */
            failed = entry == NULL || PyList_Append(runs, entry) < 0;
            Py_XDECREF(entry); /* runs holds it */
            if (!failed) {
                run_topic = PyTuple_GET_ITEM(entry, 0);
                run_partition = partition;
            }
        }
        failed = failed || PyList_Append(run_offsets, off_obj) < 0;
        Py_DECREF(topic);
        Py_DECREF(part_obj);
        Py_DECREF(off_obj);
        if (failed) goto fail;
        /* the wait (WorkerMetrics.waited_many) and the outcome (completed_many, backend time 0) */
        long long waited;
        double seconds = __builtin_sub_overflow(started, created_at, &waited) ? (double)started - (double)created_at
                                                                              : (double)waited;
        seconds = seconds > 0 ? seconds / 1000.0 : 0.0;
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
        sums.model_count[m * NBANDS + band]++;
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
    Py_DECREF(msgs);
    Py_XDECREF(sums_out);
    Py_XDECREF(pos);
    Py_XDECREF(values);
    Py_XDECREF(keys);
    Py_XDECREF(ids);
    Py_XDECREF(runs);
    return result;
}

/* ranks(msgs, rank: dict, default: int) -> None when the messages all have one topic, else
 * the rank of each message's topic (rank.get(topic, default)): a consume's worth is usually
 * one topic, and this tells without a Python frame per message. */
static PyObject *ranks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_CheckExact(args[0]) || !PyDict_Check(args[1]) || !PyLong_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "ranks(msgs: list, rank: dict, default: int)");
        return NULL;
    }
    PyObject *msgs = args[0], *rank = args[1];
    Py_ssize_t n = PyList_GET_SIZE(msgs);
    Methods methods = {NULL, {NULL}};
    PyObject **topics = PyMem_Calloc(n ? n : 1, sizeof(PyObject *));
    if (topics == NULL) return PyErr_NoMemory();
    PyObject *out = NULL;
    int mixed = 0;
    Py_ssize_t got = 0;
    for (; got < n; got++) {
        PyObject *msg = PyList_GET_ITEM(msgs, got);
        if (Py_TYPE(msg) != methods.type) methods_for(&methods, Py_TYPE(msg));
        topics[got] = call(&methods, msg, M_TOPIC);
        if (topics[got] == NULL) goto done;
        if (!mixed && got > 0 && topics[got] != topics[0]) {
            int same = PyObject_RichCompareBool(topics[got], topics[0], Py_EQ);
            if (same < 0) {
                got++;
                goto done;
            }
            mixed = !same;
        }
    }
    if (!mixed) {
        Py_INCREF(Py_None);
        out = Py_None;
        goto done;
    }
    out = PyList_New(n);
    if (out == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *r = PyDict_GetItemWithError(rank, topics[i]);
        if (r == NULL && PyErr_Occurred()) {
            Py_CLEAR(out);
            goto done;
        }
        if (r == NULL) r = args[2];
        Py_INCREF(r);
        PyList_SET_ITEM(out, i, r);
    }
done:
    for (Py_ssize_t i = 0; i < got && i < n; i++) Py_XDECREF(topics[i]);
    PyMem_Free(topics);
    return out;
}

/* -- delivery: one countdown per lane call, answers produced from C -------------------- */

/* Countdown(count, done, failed): the delivery callback of one lane call's answers. Called
 * (err, msg) by the producer: a report without error counts one down and the last one calls
 * done(); a report with an error calls failed(err, msg, self), which publishes it again
 * with this same callback. A C callable, because it runs once per answer. */
typedef struct {
    PyObject_HEAD
    Py_ssize_t left;
    PyObject *done, *failed;
} Countdown;

static void countdown_dealloc(Countdown *self) {
    Py_XDECREF(self->done);
    Py_XDECREF(self->failed);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *countdown_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    Py_ssize_t left;
    PyObject *done, *failed;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "Countdown(count, done, failed)");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "nOO:Countdown", &left, &done, &failed)) return NULL;
    Countdown *self = (Countdown *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->left = left;
    Py_INCREF(done);
    Py_INCREF(failed);
    self->done = done;
    self->failed = failed;
    return (PyObject *)self;
}

static PyObject *countdown_call(Countdown *self, PyObject *args, PyObject *kwargs) {
    if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) != 2 || (kwargs != NULL && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "a delivery callback takes (err, msg)");
        return NULL;
    }
    PyObject *err = PyTuple_GET_ITEM(args, 0);
    if (err != Py_None) return PyObject_CallFunctionObjArgs(self->failed, err, PyTuple_GET_ITEM(args, 1), self, NULL);
    if (--self->left == 0) return PyObject_CallNoArgs(self->done);
    Py_RETURN_NONE;
}

static PyObject *countdown_left(Countdown *self, void *closure) { return PyLong_FromSsize_t(self->left); }

static PyGetSetDef countdown_getset[] = {
    {"left", (getter)countdown_left, NULL, "answers not acknowledged yet", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CountdownType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "pipeline.worker._lane.Countdown",
    .tp_basicsize = sizeof(Countdown),
    .tp_dealloc = (destructor)countdown_dealloc,
    .tp_call = (ternaryfunc)countdown_call,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Countdown(count, done, failed): the delivery callback of one lane call's answers",
    .tp_new = countdown_new,
    .tp_getset = countdown_getset,
};

static PyObject *s_on_delivery_names; /* ("on_delivery",) */

/* produce_all(produce, topic, values, keys, on_delivery) -> how many were produced: all of
 * them, or the index of the first that raised BufferError or KafkaException (the caller
 * publishes that one the careful way and calls again for the rest; any other exception
 * propagates). produce(topic, value, key, on_delivery=...) for each, without a Python loop. */
static PyObject *produce_all(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyList_CheckExact(args[2]) || !PyList_CheckExact(args[3]) ||
        PyList_GET_SIZE(args[2]) != PyList_GET_SIZE(args[3])) {
        PyErr_SetString(PyExc_TypeError, "produce_all(produce, topic, values: list, keys: list, on_delivery, retry)");
        return NULL;
    }
    PyObject *produce = args[0], *values = args[2], *keys = args[3], *retry = args[5];
    Py_ssize_t n = PyList_GET_SIZE(values), j = 0;
    for (; j < n; j++) {
        PyObject *call_args[4] = {args[1], PyList_GET_ITEM(values, j), PyList_GET_ITEM(keys, j), args[4]};
        PyObject *out = PyObject_Vectorcall(produce, call_args, 3, s_on_delivery_names);
        if (out != NULL) {
            Py_DECREF(out);
            continue;
        }
        if (!PyErr_ExceptionMatches(retry)) return NULL;
        PyErr_Clear();
        break;
    }
    return PyLong_FromSsize_t(j);
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
    {"ranks", (PyCFunction)(void (*)(void))ranks, METH_FASTCALL,
     "ranks(msgs, rank: dict, default: int) -> None if all have one topic, else each one's rank.get(topic, default)"},
    {"produce_all", (PyCFunction)(void (*)(void))produce_all, METH_FASTCALL,
     "produce_all(produce, topic, values, keys, on_delivery, retry: exception types) -> how many were produced"},
    {"crc32", (PyCFunction)(void (*)(void))crc32_py, METH_FASTCALL, "crc32(data: bytes, seed: int = 0) -> int"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pipeline.worker._lane",
    "The worker's fast lane for requests the simulated model answers at once (see pipeline/worker/fastlane.py).",
    -1, methods,
};

/* The context layout and results this file implements; fastlane.py refuses any other. */
#define LANE_ABI 4

PyMODINIT_FUNC PyInit__lane(void) {
    crc_init();
    static const char *names[M_COUNT] = {"error", "value", "topic", "partition", "offset"};
    for (int k = 0; k < M_COUNT; k++)
        if ((method_names[k] = PyUnicode_InternFromString(names[k])) == NULL) return NULL;
    if ((s_trace_id_bytes = PyBytes_FromString("trace_id")) == NULL) return NULL;
    if ((s_on_delivery_names = Py_BuildValue("(s)", "on_delivery")) == NULL) return NULL;
    if (PyType_Ready(&CountdownType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&CountdownType);
    if (PyModule_AddIntConstant(m, "ABI", LANE_ABI) < 0 ||
        PyModule_AddObject(m, "Countdown", (PyObject *)&CountdownType) < 0) {
        Py_DECREF(&CountdownType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
