/*
 * Avro binary primitives shared by the native codec (_native.c) and the worker's fast lane
 * (../worker/_lane.c): the field-type opcodes of a native program, zig-zag varints, and a
 * byte writer that starts on the caller's stack. Header-only: each extension compiles its
 * own static copy.
 */
#ifndef LLMQ_AVRO_H
#define LLMQ_AVRO_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { OP_STRING = 1, OP_INT = 2, OP_LONG = 3, OP_BOOL = 4, OP_ENUM = 5, OP_MAP = 6 };
#define OP_TYPE 0x0F
#define NULL_FIRST 0x10
#define NULL_SECOND 0x20

#define MAX_FIELDS 64

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} Reader;

/* An unsigned varint of at most max_bytes bytes (10: 64 bits; 5: 32 bits). 0 or -1. */
static int read_uvarint(Reader *r, uint64_t *out, int max_bytes) {
    uint64_t value = 0;
    int shift = 0;
    for (int i = 0; i < max_bytes; i++) {
        if (r->p >= r->end) return -1;
        uint8_t b = *r->p++;
        if (i == 9 && b > 1) return -1; /* beyond 64 bits */
        value |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) {
            *out = value;
            return 0;
        }
        shift += 7;
    }
    return -1;
}

static int read_long(Reader *r, int64_t *out) {
    uint64_t u;
    if (read_uvarint(r, &u, 10) < 0) return -1;
    *out = (int64_t)(u >> 1) ^ -(int64_t)(u & 1);
    return 0;
}

/* An Avro int: at most 5 bytes and within 32 bits. */
static int read_int(Reader *r, int64_t *out) {
    uint64_t u;
    if (read_uvarint(r, &u, 5) < 0) return -1;
    int64_t v = (int64_t)(u >> 1) ^ -(int64_t)(u & 1);
    if (v < INT32_MIN || v > INT32_MAX) return -1;
    *out = v;
    return 0;
}

/* Writes into `local` (on the caller's stack) until it is full, then into a heap buffer:
 * most records fit, and need no allocation but their bytes object. */
typedef struct {
    uint8_t *buf;
    Py_ssize_t len, cap;
    uint8_t *local;
} Writer;

static int reserve(Writer *w, Py_ssize_t more) {
    if (w->len + more <= w->cap) return 0;
    Py_ssize_t cap = w->cap * 2;
    while (cap < w->len + more) cap *= 2;
    uint8_t *buf;
    if (w->buf == w->local) {
        buf = PyMem_Malloc(cap);
        if (buf != NULL) memcpy(buf, w->buf, w->len);
    } else {
        buf = PyMem_Realloc(w->buf, cap);
    }
    if (buf == NULL) return -1;
    w->buf = buf;
    w->cap = cap;
    return 0;
}

static void writer_free(Writer *w) {
    if (w->buf != w->local) PyMem_Free(w->buf);
}

static int put_long(Writer *w, int64_t value) {
    if (reserve(w, 10) < 0) return -1;
    uint64_t n = ((uint64_t)value << 1) ^ (uint64_t)(value >> 63);
    while (n > 0x7F) {
        w->buf[w->len++] = (uint8_t)((n & 0x7F) | 0x80);
        n >>= 7;
    }
    w->buf[w->len++] = (uint8_t)n;
    return 0;
}

static int put_bytes(Writer *w, const char *data, Py_ssize_t n) {
    if (put_long(w, n) < 0 || reserve(w, n) < 0) return -1;
    memcpy(w->buf + w->len, data, n);
    w->len += n;
    return 0;
}

#endif /* LLMQ_AVRO_H */
