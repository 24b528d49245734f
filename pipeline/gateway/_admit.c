/*
 * The gateway's admission lane: a C twin of what Gateway._admit_one and Admission.decide do
 * with an ordinary request, one that is dispatched to the band it asked for.
 *
 * Like the worker's lane it is a fast path, never the judge. admit() takes the records from
 * index `start` on and stops at the first one that is not ordinary in every respect: a value
 * that is not a current single-object request read completely and canonically, anything the
 * validation would question (or that this code does not check as precisely), an id seen
 * before or cancelled, a deadline passed or out of reach, any move of its band (tier,
 * urgency, load), a tenant with its own caps or limits, a quota, queue or rate limit without
 * room, a degradation, a QUEUED notice asked for, or gateway fields already set. Nothing is
 * changed for the record it stops at: the gateway takes it through the Python path, which
 * decides and explains, and calls admit() again after it. So every record is handled in
 * order, by exactly one of the two, and the lane leaves the state and writes the bytes the
 * Python path would (tests/unit/gateway/test_admit_lane.py runs both on the same records).
 *
 * admit(ctx, records, start, seen_new, cancelled) -> (stop, values, keys, owners, admitted, failure)
 *   stop      index of the first record left to the caller (len(records): none)
 *   values    per band index, the dispatch records of records[start:stop] (bytes); keys:
 *             their keys (the tenant); owners: the records they were made from
 *   admitted  per band index, how many were admitted
 *   seen_new  the gateway's ids remembered this period: partition -> [first record, [(id, source)]]
 *   cancelled the cancellation view's ids (a dict, an OrderedDict there), or None
 *   failure   None, or the exception raised while admitting records[stop] (a bug, or out of
 *             memory: the caller logs it and goes on without the lane); what was admitted
 *             before it is returned. Every counter a record adds to is read and checked before
 *             its first change, so a record's changes are made completely or, but for memory
 *             running out, not at all
 *
 * ctx (built and checked by pipeline/gateway/admitlane.py):
 *   0 request program   1 field index (F_* order)   2 request header (bytes)
 *   3 gateway (its _clock_s is set as Gateway._admit_one sets it)   4 now_ms()
 *   5 seen (dict)   6 append of the seen order (deque.append)
 *   7 outlook(now) -> (rate, load)   8 queue depths (list)   9 queue caps (list)
 *   10 admitted(rank, now) (QueueModel.admitted)
 *   11 tier offsets (dict)  12 urgent_ms  13 urgent_eta_factor  14 high_load  15 highest promoted rank
 *   16 fairness band caps (tuple)  17 tenant caps (dict)  18 outstanding key suffix per band (tuple of str)
 *   19 admitted view (values, dirty, get)  20 finished view (values, dirty, get)
 *   21 downgrade map (dict)  22 degrade load  23 simple prompt tokens  24 simple max tokens
 *   25 default limits: tuple of (name, window_ms, requests, tokens, per_tenant, (values, dirty, get))
 *   26 tenant limits (dict)   27 max_timeout_ms
 *   28 max clock skew   29 max_tokens limit   30 max tenant id chars   31 max trace id chars
 *   32 depth key prefix per band (tuple of str)   33 band index of each request priority index (tuple)
 *   34 the encoded tail of a dispatched record: (admitted_at branch, effective_priority branch,
 *      effective_priority index per band (tuple), degraded_from null byte)
 */
#include "../serde/_request.h"
#include <math.h>

#define CTX_SIZE 35
#define NBANDS 5
#define MAX_LIMITS 16

typedef struct {
    PyObject *values, *dirty, *get; /* borrowed from ctx */
} View;

typedef struct {
    PyObject *name;
    long long window, requests, tokens;
    int per_tenant;
    View view;
} Limit;

static PyObject *s_value, *s_topic, *s_partition, *s_offset, *s_clock, *s_sep;

static int view_of(PyObject *t, View *v) {
    if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 3) return -1;
    v->values = PyTuple_GET_ITEM(t, 0);
    v->dirty = PyTuple_GET_ITEM(t, 1);
    v->get = PyTuple_GET_ITEM(t, 2);
    return PyDict_CheckExact(v->values) && PyDict_CheckExact(v->dirty) ? 0 : -1;
}

/* _View.get(key): the batch's value, else the table's (read once, through Python). New ref. */
static PyObject *view_get(const View *v, PyObject *key) {
    PyObject *value = PyDict_GetItemWithError(v->values, key);
    if (value != NULL) {
        Py_INCREF(value);
        return value;
    }
    if (PyErr_Occurred()) return NULL;
    return PyObject_CallOneArg(v->get, key);
}

/* _View.__setitem__: the value, and the write kept for the period's end. */
static int view_set(const View *v, PyObject *key, PyObject *value, PyObject *partition, PyObject *clock) {
    if (PyDict_SetItem(v->values, key, value) < 0) return -1;
    PyObject *entry = PyTuple_Pack(3, value, partition, clock);
    if (entry == NULL) return -1;
    int rc = PyDict_SetItem(v->dirty, key, entry);
    Py_DECREF(entry);
    return rc;
}

/* int(x or 0) of a counter's value; -1 (no exception) when it is not a small int. */
static int counter_of(PyObject *x, long long *out) {
    if (x == Py_None) {
        *out = 0;
        return 0;
    }
    return get_ll(x, out);
}

/* _View.add's write, of a value already read and checked. */
static int view_set_ll(const View *v, PyObject *key, long long n, PyObject *partition, PyObject *clock) {
    PyObject *value = PyLong_FromLongLong(n);
    if (value == NULL) return -1;
    int rc = view_set(v, key, value, partition, clock);
    Py_DECREF(value);
    return rc;
}

static PyObject *list_of_lists(void) {
    PyObject *out = PyList_New(NBANDS);
    if (out == NULL) return NULL;
    for (int b = 0; b < NBANDS; b++) {
        PyObject *l = PyList_New(0);
        if (l == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, b, l);
    }
    return out;
}

static int ctx_ll(PyObject *ctx, int i, long long *out) { return get_ll(PyTuple_GET_ITEM(ctx, i), out); }

static int ctx_double(PyObject *ctx, int i, double *out) {
    *out = PyFloat_AsDouble(PyTuple_GET_ITEM(ctx, i));
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* The parts of ctx that stay the same through one call. */
typedef struct {
    RequestPlan plan;
    PyObject *header;
    long long urgent_ms, highest_promoted, simple_prompt, simple_max, max_timeout, skew, max_tokens, max_tenant,
        max_trace;
    double urgent_factor, high_load, degrade_load;
    long long fair_caps[NBANDS];
    View admitted, finished;
    Limit limits[MAX_LIMITS];
    Py_ssize_t nlimits;
    long band_of[MAX_ENUM];
    Py_ssize_t npriorities;
    uint8_t admitted_branch, eff_branch, degraded_null;
    long long eff_index[NBANDS];
} Plan;

static int plan_of(PyObject *ctx, Plan *p) {
    if (!PyTuple_CheckExact(ctx) || PyTuple_GET_SIZE(ctx) != CTX_SIZE) return -1;
    if (request_plan(&p->plan, PyTuple_GET_ITEM(ctx, 0), PyTuple_GET_ITEM(ctx, 1)) < 0) return -1;
    p->header = PyTuple_GET_ITEM(ctx, 2);
    if (!PyBytes_CheckExact(p->header)) return -1;
    /* The gateway's three fields close the record, in this order: the dispatched record is the
     * request's bytes up to them and the three written anew. */
    Py_ssize_t n = p->plan.nfields;
    if (n < 3 || p->plan.which[n - 3] != F_ADMITTED_AT || p->plan.which[n - 2] != F_EFFECTIVE_PRIORITY ||
        p->plan.which[n - 1] != F_DEGRADED_FROM)
        return -1;
    if (!PyDict_CheckExact(PyTuple_GET_ITEM(ctx, 5)) || !PyList_CheckExact(PyTuple_GET_ITEM(ctx, 8)) ||
        !PyList_CheckExact(PyTuple_GET_ITEM(ctx, 9)) || PyList_GET_SIZE(PyTuple_GET_ITEM(ctx, 8)) != NBANDS ||
        PyList_GET_SIZE(PyTuple_GET_ITEM(ctx, 9)) != NBANDS || !PyDict_CheckExact(PyTuple_GET_ITEM(ctx, 11)) ||
        !PyDict_CheckExact(PyTuple_GET_ITEM(ctx, 17)) || !PyDict_CheckExact(PyTuple_GET_ITEM(ctx, 21)) ||
        !PyDict_CheckExact(PyTuple_GET_ITEM(ctx, 26)))
        return -1;
    if (ctx_ll(ctx, 12, &p->urgent_ms) || ctx_double(ctx, 13, &p->urgent_factor) || ctx_double(ctx, 14, &p->high_load) ||
        ctx_ll(ctx, 15, &p->highest_promoted) || ctx_double(ctx, 22, &p->degrade_load) ||
        ctx_ll(ctx, 23, &p->simple_prompt) || ctx_ll(ctx, 24, &p->simple_max) || ctx_ll(ctx, 27, &p->max_timeout) ||
        ctx_ll(ctx, 28, &p->skew) || ctx_ll(ctx, 29, &p->max_tokens) || ctx_ll(ctx, 30, &p->max_tenant) ||
        ctx_ll(ctx, 31, &p->max_trace))
        return -1;
    PyObject *caps = PyTuple_GET_ITEM(ctx, 16), *suffix = PyTuple_GET_ITEM(ctx, 18), *prefix = PyTuple_GET_ITEM(ctx, 32);
    if (!PyTuple_CheckExact(caps) || PyTuple_GET_SIZE(caps) != NBANDS || !PyTuple_CheckExact(suffix) ||
        PyTuple_GET_SIZE(suffix) != NBANDS || !PyTuple_CheckExact(prefix) || PyTuple_GET_SIZE(prefix) != NBANDS)
        return -1;
    for (int b = 0; b < NBANDS; b++)
        if (get_ll(PyTuple_GET_ITEM(caps, b), &p->fair_caps[b]) || !PyUnicode_CheckExact(PyTuple_GET_ITEM(suffix, b)) ||
            !PyUnicode_CheckExact(PyTuple_GET_ITEM(prefix, b)))
            return -1;
    if (view_of(PyTuple_GET_ITEM(ctx, 19), &p->admitted) || view_of(PyTuple_GET_ITEM(ctx, 20), &p->finished)) return -1;
    PyObject *limits = PyTuple_GET_ITEM(ctx, 25);
    if (!PyTuple_CheckExact(limits) || PyTuple_GET_SIZE(limits) > MAX_LIMITS) return -1;
    p->nlimits = PyTuple_GET_SIZE(limits);
    for (Py_ssize_t i = 0; i < p->nlimits; i++) {
        PyObject *t = PyTuple_GET_ITEM(limits, i);
        Limit *l = &p->limits[i];
        if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 6) return -1;
        l->name = PyTuple_GET_ITEM(t, 0);
        long long per_tenant;
        if (!PyUnicode_CheckExact(l->name) || get_ll(PyTuple_GET_ITEM(t, 1), &l->window) ||
            get_ll(PyTuple_GET_ITEM(t, 2), &l->requests) || get_ll(PyTuple_GET_ITEM(t, 3), &l->tokens) ||
            get_ll(PyTuple_GET_ITEM(t, 4), &per_tenant) || l->window <= 0 || view_of(PyTuple_GET_ITEM(t, 5), &l->view))
            return -1;
        l->per_tenant = (int)per_tenant;
    }
    PyObject *band_of = PyTuple_GET_ITEM(ctx, 33);
    if (!PyTuple_CheckExact(band_of) || PyTuple_GET_SIZE(band_of) > MAX_ENUM) return -1;
    p->npriorities = PyTuple_GET_SIZE(band_of);
    for (Py_ssize_t i = 0; i < p->npriorities; i++) {
        long long b;
        if (get_ll(PyTuple_GET_ITEM(band_of, i), &b) || b < 0 || b >= NBANDS) return -1;
        p->band_of[i] = (long)b;
    }
    PyObject *tail = PyTuple_GET_ITEM(ctx, 34);
    long long ab, eb, dn;
    if (!PyTuple_CheckExact(tail) || PyTuple_GET_SIZE(tail) != 4 || get_ll(PyTuple_GET_ITEM(tail, 0), &ab) ||
        get_ll(PyTuple_GET_ITEM(tail, 1), &eb) || get_ll(PyTuple_GET_ITEM(tail, 3), &dn) ||
        !PyTuple_CheckExact(PyTuple_GET_ITEM(tail, 2)) || PyTuple_GET_SIZE(PyTuple_GET_ITEM(tail, 2)) != NBANDS ||
        ab < 0 || ab > 127 || eb < 0 || eb > 127 || dn < 0 || dn > 127)
        return -1;
    p->admitted_branch = (uint8_t)ab;
    p->eff_branch = (uint8_t)eb;
    p->degraded_null = (uint8_t)dn;
    for (int b = 0; b < NBANDS; b++)
        if (get_ll(PyTuple_GET_ITEM(PyTuple_GET_ITEM(tail, 2), b), &p->eff_index[b])) return -1;
    return 0;
}

/* A long, the way Python's ``/`` and ``%`` have it for a positive divisor. */
static long long floor_mod(long long a, long long m) {
    long long r = a % m;
    return r < 0 ? r + m : r;
}

/* The outcome for one record: 1 admitted, 0 left to the Python path, -1 error. */
static int varint_size(int64_t v) {
    uint64_t n = ((uint64_t)v << 1) ^ (uint64_t)(v >> 63);
    int size = 1;
    while (n > 0x7F) {
        n >>= 7;
        size++;
    }
    return size;
}

static int admit_one(PyObject *ctx, const Plan *p, PyObject *msg, PyObject *seen_new, PyObject *cancelled,
                     PyObject *values, PyObject *keys, PyObject *owners, long long *admitted, double *clock_set) {
    int result = 0;
    PyObject *value = NULL, *rid = NULL, *tenant = NULL, *tier = NULL, *now_obj = NULL, *outlook = NULL,
             *model = NULL, *out_key = NULL, *partition = NULL, *clock = NULL, *topic = NULL, *offset = NULL,
             *source = NULL, *out = NULL, *fkey = NULL, *dkey = NULL;
    PyObject *rate_keys[MAX_LIMITS] = {NULL}, *rate_used[MAX_LIMITS] = {NULL};
    long long rate_next[MAX_LIMITS][2];
    Field f[F_COUNT];

    value = PyObject_GetAttr(msg, s_value);
    if (value == NULL) goto error;
    if (!PyBytes_CheckExact(value)) goto done;
    Py_ssize_t hn = PyBytes_GET_SIZE(p->header), vn = PyBytes_GET_SIZE(value);
    const uint8_t *data = (const uint8_t *)PyBytes_AS_STRING(value);
    if (vn < hn + 3 || memcmp(data, PyBytes_AS_STRING(p->header), hn) != 0) goto done;
    /* the native decoder's bounds (a bigger record is the Python decoder's to refuse or read) */
    if (vn - hn > p->plan.quick || vn > p->plan.max_record) goto done;
    for (int k = 0; k < F_COUNT; k++) f[k].null = 1;
    if (!read_request(&p->plan, data + hn, data + vn, f)) goto done;
    /* What this code does not decide (the Python path does, and says why). */
    if (!f[F_ADMITTED_AT].null || !f[F_EFFECTIVE_PRIORITY].null || !f[F_DEGRADED_FROM].null || f[F_NOTIFY_QUEUED].v)
        goto done;
    /* read canonically, so the record ends with the three null unions, a byte each */
    if (data[vn - 3] != 2 - p->admitted_branch || data[vn - 2] != 2 - p->eff_branch || data[vn - 1] != p->degraded_null)
        goto done;
    if (f[F_PRIORITY].v >= p->npriorities) goto done;
    long rank = p->band_of[f[F_PRIORITY].v];

    now_obj = PyObject_CallNoArgs(PyTuple_GET_ITEM(ctx, 4));
    if (now_obj == NULL) goto error;
    long long now;
    if (get_ll(now_obj, &now)) goto done;
    double clock_s = (double)now / 1000.0;
    if (clock_s != *clock_set) {
        clock = PyFloat_FromDouble(clock_s);
        if (clock == NULL || PyObject_SetAttr(PyTuple_GET_ITEM(ctx, 3), s_clock, clock) < 0) goto error;
        *clock_set = clock_s;
    } else {
        clock = PyObject_GetAttr(PyTuple_GET_ITEM(ctx, 3), s_clock);
        if (clock == NULL) goto error;
    }

    /* validate_request */
    if (!tenant_ok(&f[F_TENANT_ID].s, (Py_ssize_t)p->max_tenant) || f[F_PROMPT].s.n == 0 || f[F_MAX_TOKENS].v <= 0 ||
        f[F_MAX_TOKENS].v > p->max_tokens || f[F_TIMEOUT_MS].v <= 0 || f[F_MODEL].s.n == 0 ||
        !uuid_ok(&f[F_REQUEST_ID].s) || !trace_ok(&f[F_TRACE_ID], (Py_ssize_t)p->max_trace))
        goto done;
    long long latest;
    if (__builtin_add_overflow(now, p->skew, &latest) || f[F_CREATED_AT].v > latest) goto done;
    /* the dispatched record must stay within the codec's bound too */
    if (vn - 3 + 3 + varint_size(now) + varint_size(p->eff_index[rank]) > p->plan.max_record) goto done;

    rid = PyUnicode_FromStringAndSize((const char *)f[F_REQUEST_ID].s.p, f[F_REQUEST_ID].s.n);
    if (rid == NULL) goto error;
    int has = PyDict_Contains(PyTuple_GET_ITEM(ctx, 5), rid);
    if (has) {
        if (has < 0) goto error;
        goto done; /* a duplicate, or a redelivery after a crash */
    }
    if (cancelled != Py_None) {
        has = PyDict_Contains(cancelled, rid);
        if (has) {
            if (has < 0) goto error;
            goto done;
        }
    }
    /* the deadline: created_at + min(timeout_ms, max_timeout_ms) */
    long long timeout = f[F_TIMEOUT_MS].v < p->max_timeout ? f[F_TIMEOUT_MS].v : p->max_timeout, deadline, left;
    if (__builtin_add_overflow(f[F_CREATED_AT].v, timeout, &deadline) || __builtin_sub_overflow(deadline, now, &left))
        goto done;
    if (left <= 0) goto done;

    outlook = PyObject_CallOneArg(PyTuple_GET_ITEM(ctx, 7), now_obj);
    if (outlook == NULL) goto error;
    if (!PyTuple_CheckExact(outlook) || PyTuple_GET_SIZE(outlook) != 2) goto done;
    double rate = PyFloat_AsDouble(PyTuple_GET_ITEM(outlook, 0)), load = PyFloat_AsDouble(PyTuple_GET_ITEM(outlook, 1));
    if (PyErr_Occurred()) goto error;
    PyObject *depth = PyTuple_GET_ITEM(ctx, 8);
    long long ahead = 0, here = 0;
    for (long b = 0; b <= rank; b++) {
        long long d;
        if (get_ll(PyList_GET_ITEM(depth, b), &d) || __builtin_add_overflow(ahead, d, &ahead)) goto done;
        here = d;
    }
    double eta = ahead == 0 ? 0.0 : (rate > 0 ? (double)ahead * 1000.0 / rate : INFINITY);

    /* effective_priority: any move is the Python path's (it explains it) */
    tenant = PyUnicode_FromStringAndSize((const char *)f[F_TENANT_ID].s.p, f[F_TENANT_ID].s.n);
    tier = PyUnicode_DecodeUTF8((const char *)f[F_USER_TIER].s.p, f[F_USER_TIER].s.n, "strict");
    if (tenant == NULL || tier == NULL) goto error;
    PyObject *offset_obj = PyDict_GetItemWithError(PyTuple_GET_ITEM(ctx, 11), tier);
    if (offset_obj == NULL && PyErr_Occurred()) goto error;
    if (offset_obj != NULL) {
        long long o;
        if (get_ll(offset_obj, &o) || o != 0) goto done;
    }
    double eta_for = eta < INFINITY ? eta : 0.0;
    if ((double)left < (double)p->urgent_ms || (double)left < p->urgent_factor * eta_for) goto done;
    if (rank > 0 && rank < p->highest_promoted) goto done;
    if (load >= p->high_load && rank > 0) goto done;

    /* fairness: the tenant's cap in its band */
    has = PyDict_Contains(PyTuple_GET_ITEM(ctx, 17), tenant);
    if (has) {
        if (has < 0) goto error;
        goto done;
    }
    fkey = PyUnicode_Concat(tenant, PyTuple_GET_ITEM(PyTuple_GET_ITEM(ctx, 18), rank));
    if (fkey == NULL) goto error;
    if (p->fair_caps[rank]) {
        PyObject *a = view_get(&p->admitted, fkey);
        if (a == NULL) goto error;
        PyObject *fin = view_get(&p->finished, fkey);
        if (fin == NULL) {
            Py_DECREF(a);
            goto error;
        }
        long long na, nf;
        int bad = counter_of(a, &na) || counter_of(fin, &nf);
        Py_DECREF(a);
        Py_DECREF(fin);
        if (bad) goto done;
        long long outstanding;
        if (__builtin_sub_overflow(na, nf, &outstanding)) goto done;
        if (outstanding < 0) outstanding = 0;
        if (outstanding >= p->fair_caps[rank]) goto done;
    }
    /* the band's bound, and the deadline against its ETA */
    long long qcap;
    if (get_ll(PyList_GET_ITEM(PyTuple_GET_ITEM(ctx, 9), rank), &qcap)) goto done;
    if (qcap && here >= qcap) goto done;
    if ((double)left < eta && eta < INFINITY) goto done;

    /* degradation: the Python path's */
    long long prompt_tokens = (f[F_PROMPT].s.chars + 3) / 4;
    if (prompt_tokens < 1) prompt_tokens = 1;
    PyObject *downgrade = PyTuple_GET_ITEM(ctx, 21);
    model = PyUnicode_DecodeUTF8((const char *)f[F_MODEL].s.p, f[F_MODEL].s.n, "strict");
    if (model == NULL) goto error;
    if (PyDict_GET_SIZE(downgrade) && f[F_ALLOW_DEGRADE].v && load >= p->degrade_load) {
        has = PyDict_Contains(downgrade, model);
        if (has < 0) goto error;
        if (has && prompt_tokens <= p->simple_prompt && f[F_MAX_TOKENS].v <= p->simple_max) goto done;
    }

    /* rate limits: every window has room, or the Python path answers */
    has = PyDict_Contains(PyTuple_GET_ITEM(ctx, 26), tenant);
    if (has) {
        if (has < 0) goto error;
        goto done;
    }
    long long tokens = prompt_tokens + f[F_MAX_TOKENS].v;
    for (Py_ssize_t i = 0; i < p->nlimits; i++) {
        const Limit *l = &p->limits[i];
        PyObject *who;
        if (l->per_tenant) {
            who = tenant;
            Py_INCREF(who);
        } else {
            who = PyUnicode_FromFormat("%U%U%U", tenant, s_sep, model);
            if (who == NULL) goto error;
        }
        PyObject *start = PyLong_FromLongLong(now - floor_mod(now, l->window));
        if (start == NULL) {
            Py_DECREF(who);
            goto error;
        }
        rate_keys[i] = PyTuple_Pack(3, l->name, who, start);
        Py_DECREF(who);
        Py_DECREF(start);
        if (rate_keys[i] == NULL) goto error;
        PyObject *used = view_get(&l->view, rate_keys[i]);
        if (used == NULL) goto error;
        rate_used[i] = used;
        long long r = 0, t = 0, r1, t1;
        int truth = PyObject_IsTrue(used);
        if (truth < 0) goto error;
        if (truth) {
            if (!(PyList_CheckExact(used) || PyTuple_CheckExact(used)) || PySequence_Fast_GET_SIZE(used) != 2 ||
                get_ll(PySequence_Fast_GET_ITEM(used, 0), &r) || get_ll(PySequence_Fast_GET_ITEM(used, 1), &t))
                goto done;
        }
        if (__builtin_add_overflow(r, 1, &r1) || __builtin_add_overflow(t, tokens, &t1)) goto done;
        if (l->requests && r1 > l->requests) goto done;
        if (l->tokens && t1 > l->tokens) goto done;
        rate_next[i][0] = r1;
        rate_next[i][1] = t1;
    }

    /* Admitted. The two counters it adds to are read now, so that nothing below can fail but
     * for memory: they are what the Python path reads next too. */
    partition = PyObject_GetAttr(msg, s_partition);
    if (partition == NULL) goto error;
    {
        PyObject *pstr = PyObject_Str(partition);
        if (pstr == NULL) goto error;
        dkey = PyUnicode_Concat(PyTuple_GET_ITEM(PyTuple_GET_ITEM(ctx, 32), rank), pstr);
        Py_DECREF(pstr);
        if (dkey == NULL) goto error;
    }
    long long outstanding_next, depth_next;
    {
        PyObject *a = view_get(&p->admitted, fkey);
        if (a == NULL) goto error;
        long long n;
        int bad = counter_of(a, &n) || __builtin_add_overflow(n, 1, &outstanding_next);
        Py_DECREF(a);
        if (bad) goto done;
        PyObject *d = view_get(&p->admitted, dkey);
        if (d == NULL) goto error;
        bad = counter_of(d, &n) || __builtin_add_overflow(n, 1, &depth_next);
        Py_DECREF(d);
        if (bad) goto done;
    }

    /* -- the state changes, in the Python path's order -- */
    topic = PyObject_GetAttr(msg, s_topic);
    offset = PyObject_GetAttr(msg, s_offset);
    if (topic == NULL || offset == NULL) goto error;
    source = PyUnicode_FromFormat("%S:%S:%S", topic, partition, offset);
    if (source == NULL) goto error;
    {   /* Gateway._remember */
        PyObject *entry = PyTuple_Pack(2, source, clock);
        if (entry == NULL) goto error;
        int rc = PyDict_SetItem(PyTuple_GET_ITEM(ctx, 5), rid, entry);
        Py_DECREF(entry);
        if (rc < 0) goto error;
        PyObject *order = PyTuple_Pack(2, clock, rid);
        if (order == NULL) goto error;
        PyObject *r = PyObject_CallOneArg(PyTuple_GET_ITEM(ctx, 6), order);
        Py_DECREF(order);
        if (r == NULL) goto error;
        Py_DECREF(r);
        PyObject *pe = PyDict_GetItemWithError(seen_new, partition);
        if (pe == NULL) {
            if (PyErr_Occurred()) goto error;
            PyObject *ids = PyList_New(0);
            if (ids == NULL) goto error;
            pe = PyList_New(2);
            if (pe == NULL) {
                Py_DECREF(ids);
                goto error;
            }
            Py_INCREF(msg);
            PyList_SET_ITEM(pe, 0, msg);
            PyList_SET_ITEM(pe, 1, ids);
            rc = PyDict_SetItem(seen_new, partition, pe);
            Py_DECREF(pe);
            if (rc < 0) goto error;
        }
        if (!PyList_CheckExact(pe) || PyList_GET_SIZE(pe) != 2 || !PyList_CheckExact(PyList_GET_ITEM(pe, 1))) {
            PyErr_SetString(PyExc_TypeError, "gateway lane: seen_new entries are [record, list]");
            goto error;
        }
        PyObject *pair = PyTuple_Pack(2, rid, source);
        if (pair == NULL) goto error;
        rc = PyList_Append(PyList_GET_ITEM(pe, 1), pair);
        Py_DECREF(pair);
        if (rc < 0) goto error;
    }
    for (Py_ssize_t i = 0; i < p->nlimits; i++) { /* RateLimiter.admit */
        PyObject *counts = Py_BuildValue("[LL]", rate_next[i][0], rate_next[i][1]);
        if (counts == NULL) goto error;
        int rc = view_set(&p->limits[i].view, rate_keys[i], counts, partition, clock);
        Py_DECREF(counts);
        if (rc < 0) goto error;
    }
    if (view_set_ll(&p->admitted, fkey, outstanding_next, partition, clock) < 0) goto error; /* FairnessQuotas.admitted */
    {   /* QueueModel.admitted */
        PyObject *rank_obj = PyLong_FromLong(rank);
        if (rank_obj == NULL) goto error;
        PyObject *args[2] = {rank_obj, now_obj};
        PyObject *r = PyObject_Vectorcall(PyTuple_GET_ITEM(ctx, 10), args, 2, NULL);
        Py_DECREF(rank_obj);
        if (r == NULL) goto error;
        Py_DECREF(r);
    }
    if (view_set_ll(&p->admitted, dkey, depth_next, partition, clock) < 0) goto error; /* the band's depth */
    {   /* the dispatched record: the request's bytes with admitted_at and effective_priority set */
        uint8_t local[1024];
        Writer w = {local, 0, sizeof local, local};
        int rc = reserve(&w, vn - 3 + 3);
        if (rc == 0) {
            memcpy(w.buf, data, vn - 3);
            w.len = vn - 3;
            w.buf[w.len++] = p->admitted_branch;
            rc = put_long(&w, now);
        }
        if (rc == 0 && reserve(&w, 1) == 0) {
            w.buf[w.len++] = p->eff_branch;
            rc = put_long(&w, p->eff_index[rank]);
        } else {
            rc = -1;
        }
        if (rc == 0 && reserve(&w, 1) == 0) w.buf[w.len++] = p->degraded_null;
        else rc = -1;
        out = rc == 0 ? PyBytes_FromStringAndSize((const char *)w.buf, w.len) : NULL;
        writer_free(&w);
        if (rc < 0) PyErr_NoMemory();
        if (out == NULL) goto error;
    }
    out_key = PyBytes_FromStringAndSize((const char *)f[F_TENANT_ID].s.p, f[F_TENANT_ID].s.n);
    if (out_key == NULL || PyList_Append(PyList_GET_ITEM(values, rank), out) < 0 ||
        PyList_Append(PyList_GET_ITEM(keys, rank), out_key) < 0 || PyList_Append(PyList_GET_ITEM(owners, rank), msg) < 0)
        goto error;
    admitted[rank]++;
    result = 1;
    goto done;
error:
    result = -1;
done:
    Py_XDECREF(value);
    Py_XDECREF(rid);
    Py_XDECREF(tenant);
    Py_XDECREF(tier);
    Py_XDECREF(now_obj);
    Py_XDECREF(outlook);
    Py_XDECREF(model);
    Py_XDECREF(out_key);
    Py_XDECREF(partition);
    Py_XDECREF(clock);
    Py_XDECREF(topic);
    Py_XDECREF(offset);
    Py_XDECREF(source);
    Py_XDECREF(out);
    Py_XDECREF(fkey);
    Py_XDECREF(dkey);
    for (int i = 0; i < MAX_LIMITS; i++) {
        Py_XDECREF(rate_keys[i]);
        Py_XDECREF(rate_used[i]);
    }
    return result;
}

static PyObject *admit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyList_CheckExact(args[1]) || !PyDict_CheckExact(args[3]) ||
        (args[4] != Py_None && !PyDict_Check(args[4]))) {
        PyErr_SetString(PyExc_TypeError, "admit(ctx, records: list, start: int, seen_new: dict, cancelled: dict | None)");
        return NULL;
    }
    Plan plan;
    if (plan_of(args[0], &plan) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "admit: a context this build does not read");
        else {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "admit: a context this build does not read");
        }
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    if (start == -1 && PyErr_Occurred()) return NULL;
    PyObject *records = args[1];
    PyObject *values = list_of_lists(), *keys = list_of_lists(), *owners = list_of_lists();
    if (values == NULL || keys == NULL || owners == NULL) {
        Py_XDECREF(values);
        Py_XDECREF(keys);
        Py_XDECREF(owners);
        return NULL;
    }
    long long admitted[NBANDS] = {0};
    double clock_set = NAN;
    PyObject *failure = Py_None;
    Py_INCREF(failure);
    Py_ssize_t i = start < 0 ? 0 : start, n = PyList_GET_SIZE(records);
    for (; i < n; i++) {
        int rc = admit_one(args[0], &plan, PyList_GET_ITEM(records, i), args[3], args[4], values, keys, owners,
                           admitted, &clock_set);
        if (rc < 0) {
            /* What was admitted before it is returned all the same: its state is changed. */
            PyObject *type, *exc, *tb;
            PyErr_Fetch(&type, &exc, &tb);
            PyErr_NormalizeException(&type, &exc, &tb);
            Py_XDECREF(type);
            Py_XDECREF(tb);
            if (exc != NULL) {
                Py_DECREF(failure);
                failure = exc;
            }
            break;
        }
        if (rc == 0) break;
    }
    return Py_BuildValue("(nNNN[LLLLL]N)", i, values, keys, owners, admitted[0], admitted[1], admitted[2],
                         admitted[3], admitted[4], failure);
}

static PyMethodDef methods[] = {
    {"admit", (PyCFunction)(void (*)(void))admit, METH_FASTCALL,
     "admit(ctx, records, start, seen_new, cancelled) -> (stop, values, keys, owners, admitted, failure)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pipeline.gateway._admit",
    "The gateway's admission lane for ordinary requests (see pipeline/gateway/admitlane.py).", -1, methods,
};

/* The context layout and results this file implements; admitlane.py refuses any other. */
#define ADMIT_ABI 2

PyMODINIT_FUNC PyInit__admit(void) {
    if ((s_value = PyUnicode_InternFromString("value")) == NULL ||
        (s_topic = PyUnicode_InternFromString("topic")) == NULL ||
        (s_partition = PyUnicode_InternFromString("partition")) == NULL ||
        (s_offset = PyUnicode_InternFromString("offset")) == NULL ||
        (s_clock = PyUnicode_InternFromString("_clock_s")) == NULL || (s_sep = PyUnicode_FromString("\x1f")) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "ABI", ADMIT_ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
