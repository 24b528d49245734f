/*
 * Reading an LLMRequest body in place, and the checks of validate_request that C can make
 * alone: shared by the worker's fast lane (../worker/_lane.c) and the gateway's admission lane
 * (../gateway/_admit.c). Header-only: each extension compiles its own static copy.
 */
#ifndef LLMQ_REQUEST_H
#define LLMQ_REQUEST_H

#include "_avro.h"

#define MAX_ENUM 64

/* The request fields read, in the order of the field index a caller passes (fastlane.py's
 * READ_FIELDS, admitlane.py's likewise). */
enum {
    F_REQUEST_ID, F_TENANT_ID, F_PRIORITY, F_PROMPT, F_MODEL, F_MAX_TOKENS, F_CREATED_AT, F_TIMEOUT_MS,
    F_TRACE_ID, F_ADMITTED_AT, F_EFFECTIVE_PRIORITY, F_DEGRADED_FROM, F_USER_TIER, F_ALLOW_DEGRADE,
    F_NOTIFY_QUEUED, F_COUNT
};

/* Well-formed UTF-8 (what a strict decode accepts: no overlongs, no surrogates, nothing
 * past U+10FFFF); *chars gets the number of code points. 1 if valid. */
static int utf8_ok(const uint8_t *p, Py_ssize_t n, Py_ssize_t *chars) {
    Py_ssize_t count = 0, i = 0;
    while (i < n) {
        /* eight ASCII bytes at a time */
        while (i + 8 <= n) {
            uint64_t word;
            memcpy(&word, p + i, 8);
            if (word & 0x8080808080808080ULL) break;
            i += 8;
            count += 8;
        }
        if (i >= n) break;
        uint8_t c = p[i];
        if (c < 0x80) {
            i++;
        } else if (c >= 0xC2 && c <= 0xDF) {
            if (i + 1 >= n || (p[i + 1] & 0xC0) != 0x80) return 0;
            i += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (i + 2 >= n || (p[i + 1] & 0xC0) != 0x80 || (p[i + 2] & 0xC0) != 0x80) return 0;
            if (c == 0xE0 && p[i + 1] < 0xA0) return 0; /* overlong */
            if (c == 0xED && p[i + 1] > 0x9F) return 0; /* surrogate */
            i += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (i + 3 >= n || (p[i + 1] & 0xC0) != 0x80 || (p[i + 2] & 0xC0) != 0x80 || (p[i + 3] & 0xC0) != 0x80)
                return 0;
            if (c == 0xF0 && p[i + 1] < 0x90) return 0; /* overlong */
            if (c == 0xF4 && p[i + 1] > 0x8F) return 0; /* past U+10FFFF */
            i += 4;
        } else {
            return 0;
        }
        count++;
    }
    *chars = count;
    return 1;
}

typedef struct {
    const uint8_t *p;
    Py_ssize_t n, chars;
} Span;

/* One request field as read: null, or a span (strings) or a number (ints, enum indexes). */
typedef struct {
    int null;
    Span s;
    int64_t v;
} Field;

/* The request program, unpacked once per run(). */
typedef struct {
    Py_ssize_t nfields, quick, max_record;
    const uint8_t *ops;
    Py_ssize_t cap[MAX_FIELDS];     /* strings: byte cap, -1 none */
    Py_ssize_t members[MAX_FIELDS]; /* enums: how many symbols */
    int which[MAX_FIELDS];          /* F_* or -1 */
} RequestPlan;

static Py_ssize_t cap_of(PyObject *arg) {
    if (arg == Py_None || !PyLong_Check(arg)) return -1;
    Py_ssize_t cap = PyLong_AsSsize_t(arg);
    if (cap == -1 && PyErr_Occurred()) PyErr_Clear();
    return cap;
}

#define PROGRAM_SIZE 11

static int request_plan(RequestPlan *plan, PyObject *program, PyObject *index) {
    if (!PyTuple_CheckExact(program) || PyTuple_GET_SIZE(program) != PROGRAM_SIZE || !PyTuple_CheckExact(index) ||
        PyTuple_GET_SIZE(index) != F_COUNT)
        return -1;
    PyObject *ops = PyTuple_GET_ITEM(program, 0), *args = PyTuple_GET_ITEM(program, 1);
    if (!PyBytes_CheckExact(ops) || !PyTuple_CheckExact(args)) return -1;
    plan->nfields = PyBytes_GET_SIZE(ops);
    if (plan->nfields > MAX_FIELDS || PyTuple_GET_SIZE(args) != plan->nfields) return -1;
    plan->ops = (const uint8_t *)PyBytes_AS_STRING(ops);
    plan->quick = PyLong_AsSsize_t(PyTuple_GET_ITEM(program, 8));
    plan->max_record = PyLong_AsSsize_t(PyTuple_GET_ITEM(program, 9));
    if (PyErr_Occurred()) return -1;
    for (Py_ssize_t i = 0; i < plan->nfields; i++) {
        PyObject *arg = PyTuple_GET_ITEM(args, i);
        plan->which[i] = -1;
        plan->cap[i] = (plan->ops[i] & OP_TYPE) == OP_STRING ? cap_of(arg) : -1;
        plan->members[i] = 0;
        if ((plan->ops[i] & OP_TYPE) == OP_ENUM) {
            if (!PyTuple_CheckExact(arg) || !PyTuple_CheckExact(PyTuple_GET_ITEM(arg, 0))) return -1;
            plan->members[i] = PyTuple_GET_SIZE(PyTuple_GET_ITEM(arg, 0));
        }
    }
    for (int k = 0; k < F_COUNT; k++) {
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(index, k));
        if (i < 0 || i >= plan->nfields) {
            PyErr_Clear();
            return -1;
        }
        plan->which[i] = k;
        /* the type each is read as, and whether it may be null */
        int type = plan->ops[i] & OP_TYPE, nullable = (plan->ops[i] & (NULL_FIRST | NULL_SECOND)) != 0;
        int want_null = k == F_TRACE_ID || k == F_ADMITTED_AT || k == F_EFFECTIVE_PRIORITY || k == F_DEGRADED_FROM;
        int want = k == F_PRIORITY || k == F_EFFECTIVE_PRIORITY ? OP_ENUM
                   : k == F_MAX_TOKENS || k == F_CREATED_AT || k == F_TIMEOUT_MS || k == F_ADMITTED_AT ? -1
                   : k == F_ALLOW_DEGRADE || k == F_NOTIFY_QUEUED                                    ? OP_BOOL
                                                                                                   : OP_STRING;
        if ((want == -1 ? type != OP_INT && type != OP_LONG : type != want) || (nullable && !want_null)) return -1;
        if ((type == OP_ENUM) && plan->members[i] > MAX_ENUM) return -1;
    }
    return 0;
}

/* A varint in its shortest form only (a padded one, e.g. 80 00 for 0, decodes the same but
 * is not what a writer produces: the gateway's lane copies the request's bytes). */
static int read_int_canonical(Reader *r, int64_t *out) {
    const uint8_t *start = r->p;
    if (read_int(r, out) < 0) return -1;
    return r->p - start > 1 && r->p[-1] == 0 ? -1 : 0;
}

static int read_long_canonical(Reader *r, int64_t *out) {
    const uint8_t *start = r->p;
    if (read_long(r, out) < 0) return -1;
    return r->p - start > 1 && r->p[-1] == 0 ? -1 : 0;
}

/* Read the request body [p, end) in place into f[F_*]. 1: read completely, canonically
 * and within the caps; 0: leave the message to the Python path. */
static int read_request(const RequestPlan *plan, const uint8_t *p, const uint8_t *end, Field *f) {
    Reader r = {p, end};
    for (Py_ssize_t i = 0; i < plan->nfields; i++) {
        int op = plan->ops[i], k = plan->which[i];
        Field field = {0, {NULL, 0, 0}, 0};
        if (op & (NULL_FIRST | NULL_SECOND)) {
            int64_t branch;
            if (read_int_canonical(&r, &branch) < 0) return 0;
            int null_branch = (op & NULL_FIRST) ? 0 : 1;
            if (branch == null_branch) {
                field.null = 1;
                if (k >= 0) f[k] = field;
                continue;
            }
            if (branch != 1 - null_branch) return 0;
        }
        switch (op & OP_TYPE) {
        case OP_STRING: {
            int64_t n;
            if (read_long_canonical(&r, &n) < 0 || n < 0 || n > r.end - r.p) return 0;
            if (plan->cap[i] >= 0 && n > plan->cap[i]) return 0;
            if (!utf8_ok(r.p, (Py_ssize_t)n, &field.s.chars)) return 0;
            field.s.p = r.p;
            field.s.n = (Py_ssize_t)n;
            r.p += n;
            break;
        }
        case OP_INT:
            if (read_int_canonical(&r, &field.v) < 0) return 0;
            break;
        case OP_LONG:
            if (read_long_canonical(&r, &field.v) < 0) return 0;
            break;
        case OP_BOOL:
            if (r.p >= r.end || *r.p > 1) return 0;
            field.v = *r.p++;
            break;
        case OP_ENUM:
            if (read_int_canonical(&r, &field.v) < 0 || field.v < 0 || field.v >= plan->members[i]) return 0;
            break;
        case OP_MAP: /* only an empty one: entries are the Python path's to bound and check */
            if (read_long_canonical(&r, &field.v) < 0 || field.v != 0) return 0;
            break;
        default:
            return 0;
        }
        if (k >= 0) f[k] = field;
    }
    return r.p == r.end;
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

/* created_at + timeout_ms <= now, as Python's unbounded ints have it (a sum past int64 is
 * far in the future). */
static int expired(int64_t created_at, int64_t timeout_ms, long long now) {
    int64_t deadline;
    if (__builtin_add_overflow(created_at, timeout_ms, &deadline)) return timeout_ms < 0;
    return deadline <= now;
}

static int is_hex(uint8_t c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

/* validate_request's tenant check, for the tenants it can decide on alone: 1..max printable
 * ASCII characters, not all spaces. Anything else is left to the Python code. */
static int tenant_ok(const Span *s, Py_ssize_t max_chars) {
    if (s->n < 1 || s->n > max_chars) return 0;
    int printable = 0;
    for (Py_ssize_t i = 0; i < s->n; i++) {
        if (s->p[i] < 0x20 || s->p[i] > 0x7E) return 0;
        if (s->p[i] != 0x20) printable = 1;
    }
    return printable;
}

static int uuid_ok(const Span *s) {
    if (s->n != 36) return 0;
    for (int i = 0; i < 36; i++) {
        if (i == 8 || i == 13 || i == 18 || i == 23) {
            if (s->p[i] != '-') return 0;
        } else if (!is_hex(s->p[i])) {
            return 0;
        }
    }
    return 1;
}

static int trace_ok(const Field *f, Py_ssize_t max_chars) {
    if (f->null) return 1;
    if (f->s.n < 1 || f->s.n > max_chars) return 0;
    for (Py_ssize_t i = 0; i < f->s.n; i++) {
        uint8_t c = f->s.p[i];
        if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
              c == ':' || c == '-'))
            return 0;
    }
    return 1;
}

#endif
