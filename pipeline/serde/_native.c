/*
 * Native record codec: a C twin of the code pipeline/serde/fastpath.py generates.
 *
 * It is a fast path, never the judge. decode() returns the model object only for a body it
 * reads completely and canonically: anything unusual (a truncated body, bad UTF-8, a
 * non-canonical or out-of-range index, a value over a cap, trailing bytes, a type other
 * than bytes) makes it return None, and the caller runs the generated Python decoder on the
 * same bytes, which accepts or names the problem exactly as before. encode() likewise
 * returns None for any value the generated encoder would not write itself.
 *
 * A "program" describes one record, built by fastpath.native_program():
 *   (ops: bytes, args: tuple, names: tuple[str], model: type, new: callable,
 *    slots: tuple[str], sources: tuple, field_slots: tuple[int], quick: int, max_record: int,
 *    offsets: tuple[int] | None)
 * ops[i] is the type of field i (low nibble, OP_*) with NULL_FIRST/NULL_SECOND for a
 * union with null. args[i]: for a string its cap (int, or None for none); for an enum a
 * pair (members by index, {member: index}); for a map (max entries, max bytes of a key or
 * value). names[i] is the model attribute of field i. decode() fills the attributes
 * slots[j] of a new model object from sources[j]: an int is a decoded field's index, a
 * 1-tuple holds a default value, anything else is a factory called for each object.
 * field_slots[i] is the position of field i among the model's fields: encode_values()
 * takes the values of one object as a tuple in the model's field order. decode() leaves
 * a message of more than max_record bytes, or a body of more than quick bytes, to the
 * Python decoder; encode() refuses a result of more than max_record bytes. The program
 * comes first in every call, so functools.partial(decode, program) costs no Python frame.
 * offsets (from slot_offsets()) are where the model's __slots__ live inside its objects:
 * with them decode() allocates the object and fills the slots directly, and encode() of
 * an object of exactly the model's type reads them directly.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h> /* PyMemberDef (3.11) */
#include <stdint.h>
#include <string.h>

/* What a __slots__ attribute's member descriptor holds (stable since 3.0; 3.12 renamed). */
#ifndef Py_T_OBJECT_EX
#define Py_T_OBJECT_EX 16
#endif
#ifndef Py_READONLY
#define Py_READONLY 1
#endif

#include "_avro.h"

/* -- decoding ------------------------------------------------------------------------ */

/* A string of at most cap bytes (cap < 0: uncapped), strict UTF-8. New reference or NULL
 * with no exception set. */
static PyObject *read_string(Reader *r, Py_ssize_t cap) {
    int64_t n;
    if (read_long(r, &n) < 0 || n < 0 || n > r->end - r->p) return NULL;
    if (cap >= 0 && n > cap) return NULL;
    PyObject *s = PyUnicode_DecodeUTF8((const char *)r->p, (Py_ssize_t)n, "strict");
    if (s == NULL) {
        PyErr_Clear();
        return NULL;
    }
    r->p += n;
    return s;
}

static PyObject *read_map(Reader *r, PyObject *arg) {
    long max_entries = PyLong_AsLong(PyTuple_GET_ITEM(arg, 0));
    Py_ssize_t max_bytes = PyLong_AsSsize_t(PyTuple_GET_ITEM(arg, 1));
    PyObject *out = PyDict_New();
    if (out == NULL) return NULL;
    int64_t total = 0;
    for (;;) {
        int64_t count;
        if (read_long(r, &count) < 0) goto bail;
        if (count == 0) return out;
        if (count < 0) {
            int64_t ignored;
            if (count == INT64_MIN || read_long(r, &ignored) < 0) goto bail;
            count = -count;
        }
        total += count;
        if (total > max_entries) goto bail;
        for (int64_t i = 0; i < count; i++) {
            PyObject *key = read_string(r, max_bytes);
            if (key == NULL) goto bail;
            PyObject *value = read_string(r, max_bytes);
            if (value == NULL) {
                Py_DECREF(key);
                goto bail;
            }
            int failed = PyDict_SetItem(out, key, value);
            Py_DECREF(key);
            Py_DECREF(value);
            if (failed) goto bail;
        }
    }
bail:
    Py_DECREF(out);
    PyErr_Clear();
    return NULL;
}

/* One value of the type op & OP_TYPE. New reference, or NULL (no exception set). */
static PyObject *read_value(Reader *r, int op, PyObject *arg) {
    int64_t v;
    switch (op & OP_TYPE) {
    case OP_STRING:
        return read_string(r, arg == Py_None ? -1 : PyLong_AsSsize_t(arg));
    case OP_INT:
        if (read_int(r, &v) < 0) return NULL;
        return PyLong_FromLongLong(v);
    case OP_LONG:
        if (read_long(r, &v) < 0) return NULL;
        return PyLong_FromLongLong(v);
    case OP_BOOL:
        if (r->p >= r->end || *r->p > 1) return NULL;
        return PyBool_FromLong(*r->p++);
    case OP_ENUM: {
        PyObject *members = PyTuple_GET_ITEM(arg, 0);
        if (read_int(r, &v) < 0 || v < 0 || v >= PyTuple_GET_SIZE(members)) return NULL;
        PyObject *member = PyTuple_GET_ITEM(members, v);
        Py_INCREF(member);
        return member;
    }
    case OP_MAP:
        return read_map(r, arg);
    }
    return NULL;
}

#define PROGRAM_SIZE 11

/* The value of one model slot (see "sources" above): new reference, or NULL with an
 * exception set (a default factory that raised). */
static PyObject *slot_value(PyObject *source, PyObject **values) {
    PyObject *value;
    if (PyLong_CheckExact(source)) {
        value = values[PyLong_AsSsize_t(source)];
    } else if (PyTuple_CheckExact(source)) {
        value = PyTuple_GET_ITEM(source, 0);
    } else {
        return PyObject_CallNoArgs(source);
    }
    Py_INCREF(value);
    return value;
}

/* decode(program, data: bytes, pos: int) -> model object | None */
static PyObject *decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) != PROGRAM_SIZE ||
        !PyBytes_CheckExact(args[1]) || !PyLong_CheckExact(args[2]))
        Py_RETURN_NONE;
    PyObject *program = args[0];
    PyObject *data = args[1];
    PyObject *ops = PyTuple_GET_ITEM(program, 0), *fargs = PyTuple_GET_ITEM(program, 1);
    PyObject *model = PyTuple_GET_ITEM(program, 3), *new = PyTuple_GET_ITEM(program, 4);
    PyObject *slots = PyTuple_GET_ITEM(program, 5), *sources = PyTuple_GET_ITEM(program, 6);
    Py_ssize_t nfields = PyBytes_GET_SIZE(ops);
    if (nfields > MAX_FIELDS) Py_RETURN_NONE;
    const uint8_t *opcodes = (const uint8_t *)PyBytes_AS_STRING(ops);
    Py_ssize_t size = PyBytes_GET_SIZE(data);
    Py_ssize_t pos = PyLong_AsSsize_t(args[2]);
    Py_ssize_t quick = PyLong_AsSsize_t(PyTuple_GET_ITEM(program, 8));
    Py_ssize_t max_record = PyLong_AsSsize_t(PyTuple_GET_ITEM(program, 9));
    if (pos < 0 || pos > size || size - pos > quick || size > max_record) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Reader r = {(const uint8_t *)PyBytes_AS_STRING(data) + pos, (const uint8_t *)PyBytes_AS_STRING(data) + size};
    PyObject *values[MAX_FIELDS];
    Py_ssize_t done = 0;
    PyObject *obj = NULL;
    for (; done < nfields; done++) {
        int op = opcodes[done];
        PyObject *arg = PyTuple_GET_ITEM(fargs, done);
        if (op & (NULL_FIRST | NULL_SECOND)) {
            int64_t branch;
            if (read_int(&r, &branch) < 0) goto fail;
            int null_branch = (op & NULL_FIRST) ? 0 : 1;
            if (branch == null_branch) {
                Py_INCREF(Py_None);
                values[done] = Py_None;
                continue;
            }
            if (branch != 1 - null_branch) goto fail;
        }
        values[done] = read_value(&r, op, arg);
        if (values[done] == NULL) goto fail;
    }
    if (r.p != r.end) goto fail;
    PyObject *offsets = PyTuple_GET_ITEM(program, 10);
    Py_ssize_t nslots = PyTuple_GET_SIZE(slots);
    if (offsets != Py_None) {
        PyTypeObject *type = (PyTypeObject *)model;
        obj = type->tp_alloc(type, 0); /* every slot NULL */
    } else {
        obj = PyObject_CallOneArg(new, model);
    }
    if (obj == NULL) goto fail;
    for (Py_ssize_t j = 0; j < nslots; j++) {
        PyObject *value = slot_value(PyTuple_GET_ITEM(sources, j), values);
        if (value == NULL) goto fail;
        if (offsets != Py_None) {
            *(PyObject **)((char *)obj + PyLong_AsSsize_t(PyTuple_GET_ITEM(offsets, j))) = value; /* stolen */
            continue;
        }
        int failed = PyObject_SetAttr(obj, PyTuple_GET_ITEM(slots, j), value);
        Py_DECREF(value);
        if (failed) goto fail;
    }
    for (Py_ssize_t i = 0; i < done; i++) Py_DECREF(values[i]);
    return obj;
fail:
    PyErr_Clear();
    Py_XDECREF(obj);
    for (Py_ssize_t i = 0; i < done; i++) Py_DECREF(values[i]);
    Py_RETURN_NONE;
}

/* -- encoding ------------------------------------------------------------------------ */

/* An exact str of at most cap UTF-8 bytes (cap < 0: uncapped). */
static int put_string(Writer *w, PyObject *v, Py_ssize_t cap) {
    if (!PyUnicode_CheckExact(v)) return -1;
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(v, &n); /* NULL for a lone surrogate */
    if (utf8 == NULL || (cap >= 0 && n > cap)) return -1;
    return put_bytes(w, utf8, n);
}

static int put_value(Writer *w, int op, PyObject *arg, PyObject *v) {
    switch (op & OP_TYPE) {
    case OP_STRING:
        return put_string(w, v, arg == Py_None ? -1 : PyLong_AsSsize_t(arg));
    case OP_INT:
    case OP_LONG: {
        if (!PyLong_CheckExact(v)) return -1;
        int overflow;
        long long n = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || (n == -1 && PyErr_Occurred())) return -1;
        if ((op & OP_TYPE) == OP_INT && (n < INT32_MIN || n > INT32_MAX)) return -1;
        return put_long(w, n);
    }
    case OP_BOOL:
        if (v != Py_True && v != Py_False) return -1;
        if (reserve(w, 1) < 0) return -1;
        w->buf[w->len++] = v == Py_True;
        return 0;
    case OP_ENUM: {
        PyObject *members = PyTuple_GET_ITEM(arg, 0), *index = PyTuple_GET_ITEM(arg, 1);
        if (PyTuple_GET_SIZE(members) == 0 || Py_TYPE(v) != Py_TYPE(PyTuple_GET_ITEM(members, 0))) return -1;
        PyObject *i = PyDict_GetItemWithError(index, v);
        if (i == NULL) return -1;
        return put_long(w, PyLong_AsLongLong(i));
    }
    case OP_MAP: {
        if (!PyDict_CheckExact(v)) return -1;
        long max_entries = PyLong_AsLong(PyTuple_GET_ITEM(arg, 0));
        Py_ssize_t max_bytes = PyLong_AsSsize_t(PyTuple_GET_ITEM(arg, 1));
        Py_ssize_t n = PyDict_GET_SIZE(v);
        if (n == 0) return put_long(w, 0);
        if (n > max_entries || put_long(w, n) < 0) return -1;
        Py_ssize_t it = 0;
        PyObject *key, *item;
        while (PyDict_Next(v, &it, &key, &item)) {
            if (put_string(w, key, max_bytes) < 0 || put_string(w, item, max_bytes) < 0) return -1;
        }
        return put_long(w, 0);
    }
    }
    return -1;
}

/* The body of encode() and encode_values(): the field values come from obj's attributes,
 * or (values_mode) from the tuple obj in the model's field order. */
static PyObject *encode_record(PyObject *const *args, Py_ssize_t nargs, int values_mode) {
    if (nargs != 3 || !PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) != PROGRAM_SIZE ||
        !PyBytes_CheckExact(args[2]))
        Py_RETURN_NONE;
    PyObject *program = args[0], *obj = args[1], *header = args[2];
    PyObject *field_slots = PyTuple_GET_ITEM(program, 7);
    if (values_mode && (!PyTuple_CheckExact(obj) || PyTuple_GET_SIZE(obj) != PyTuple_GET_SIZE(PyTuple_GET_ITEM(program, 5))))
        Py_RETURN_NONE;
    Py_ssize_t max_record = PyLong_AsSsize_t(PyTuple_GET_ITEM(program, 9));
    if (max_record < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *ops = PyTuple_GET_ITEM(program, 0), *fargs = PyTuple_GET_ITEM(program, 1);
    PyObject *names = PyTuple_GET_ITEM(program, 2), *offsets = PyTuple_GET_ITEM(program, 10);
    int direct = !values_mode && offsets != Py_None && (PyObject *)Py_TYPE(obj) == PyTuple_GET_ITEM(program, 3);
    const uint8_t *opcodes = (const uint8_t *)PyBytes_AS_STRING(ops);
    Py_ssize_t nfields = PyBytes_GET_SIZE(ops);
    uint8_t local[2048];
    Writer w = {local, 0, sizeof local, local};
    Py_ssize_t hlen = PyBytes_GET_SIZE(header);
    if (reserve(&w, hlen) < 0) goto fail;
    memcpy(w.buf, PyBytes_AS_STRING(header), hlen);
    w.len = hlen;
    for (Py_ssize_t i = 0; i < nfields; i++) {
        int op = opcodes[i];
        PyObject *v;
        if (values_mode) {
            v = PyTuple_GET_ITEM(obj, PyLong_AsSsize_t(PyTuple_GET_ITEM(field_slots, i)));
            Py_INCREF(v);
        } else if (direct) {
            /* field i's slot: sources[field_slots[i]] is i, offsets[field_slots[i]] its place */
            v = *(PyObject **)((char *)obj +
                               PyLong_AsSsize_t(PyTuple_GET_ITEM(offsets, PyLong_AsSsize_t(PyTuple_GET_ITEM(field_slots, i)))));
            if (v == NULL) goto fail; /* never set: AttributeError on the Python path */
            Py_INCREF(v);
        } else {
            v = PyObject_GetAttr(obj, PyTuple_GET_ITEM(names, i));
            if (v == NULL) goto fail;
        }
        int failed;
        if (op & (NULL_FIRST | NULL_SECOND)) {
            int null_branch = (op & NULL_FIRST) ? 0 : 1;
            if (v == Py_None) {
                failed = put_long(&w, null_branch);
            } else {
                failed = put_long(&w, 1 - null_branch) < 0 || put_value(&w, op, PyTuple_GET_ITEM(fargs, i), v) < 0;
            }
        } else {
            failed = put_value(&w, op, PyTuple_GET_ITEM(fargs, i), v);
        }
        Py_DECREF(v);
        if (failed) goto fail;
    }
    if (w.len > max_record) goto fail;
    PyObject *out = PyBytes_FromStringAndSize((const char *)w.buf, w.len);
    writer_free(&w);
    return out;
fail:
    PyErr_Clear();
    writer_free(&w);
    Py_RETURN_NONE;
}

/* slot_offsets(cls, names) -> tuple of the byte offsets of cls's __slots__ named, or None
 * when any of them is not a plain writable object slot of cls (a property, a __dict__
 * entry, a read-only member). */
static PyObject *slot_offsets(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyType_Check(args[0]) || !PyTuple_CheckExact(args[1])) Py_RETURN_NONE;
    PyTypeObject *type = (PyTypeObject *)args[0];
    Py_ssize_t n = PyTuple_GET_SIZE(args[1]);
    PyObject *out = PyTuple_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(args[1], i);
        PyObject *descr = PyUnicode_Check(name) ? _PyType_Lookup(type, name) : NULL;
        if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) goto none;
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type != Py_T_OBJECT_EX || (member->flags & Py_READONLY) || member->offset <= 0 ||
            (size_t)member->offset + sizeof(PyObject *) > (size_t)type->tp_basicsize)
            goto none;
        PyObject *offset = PyLong_FromSsize_t(member->offset);
        if (offset == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, offset);
    }
    return out;
none:
    Py_DECREF(out);
    Py_RETURN_NONE;
}

/* encode(program, obj, header: bytes) -> bytes | None */
static PyObject *encode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return encode_record(args, nargs, 0);
}

/* encode_values(program, values: tuple, header: bytes) -> bytes | None */
static PyObject *encode_values(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return encode_record(args, nargs, 1);
}

static PyMethodDef methods[] = {
    {"decode", (PyCFunction)(void (*)(void))decode, METH_FASTCALL,
     "decode(program, data: bytes, pos: int) -> model object, or None to leave it to the Python decoder"},
    {"encode", (PyCFunction)(void (*)(void))encode, METH_FASTCALL,
     "encode(program, obj, header: bytes) -> header + body, or None to leave it to the Python encoder"},
    {"slot_offsets", (PyCFunction)(void (*)(void))slot_offsets, METH_FASTCALL,
     "slot_offsets(cls, names: tuple[str]) -> where those __slots__ live in cls's objects, or None"},
    {"encode_values", (PyCFunction)(void (*)(void))encode_values, METH_FASTCALL,
     "encode_values(program, values: tuple in the model's field order, header: bytes) -> header + body, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "pipeline.serde._native",
    "Native fast path of the schema-specialised Avro codec (see pipeline/serde/fastpath.py).", -1, methods,
};

/* The program layout and call signatures this file implements; fastpath.py refuses any
 * other (a stale build left behind by a failed rebuild, say) and uses the Python code. */
#define NATIVE_ABI 3

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "ABI", NATIVE_ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
