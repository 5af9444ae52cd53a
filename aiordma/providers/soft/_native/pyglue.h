/* Python glue for the binding: building WorkCompletion objects in C.
 *
 * providers/base.py's WorkCompletion is a dataclass with __slots__; its fields
 * are member descriptors at fixed offsets in the instance. The CQ's poll
 * builds real WorkCompletion instances (isinstance, repr, dataclasses.replace
 * all work) by allocating the object and storing the nine fields at those
 * offsets: no __init__ call, no attribute lookups per completion.
 */
#ifndef AIORDMA_PYGLUE_H
#define AIORDMA_PYGLUE_H

#include <Python.h>
#include "structmember.h"

#include "rc.h"

#define WC_NFIELDS 9
static const char *const wc_field_names[WC_NFIELDS] = {"wr_id",  "status", "opcode",   "byte_len",  "qp_num",
                                                       "src_qp", "imm_data", "wc_flags", "vendor_err"};
static Py_ssize_t wc_offsets[WC_NFIELDS];
static PyTypeObject *wc_type;
static PyObject *wc_status_objs[22];
static PyObject *wc_opcode_objs[5], *wc_opcode_recv, *wc_opcode_recv_imm;
static PyObject *wc_flags_none, *wc_flags_imm, *wc_zero;

/* (type, WCStatus, WCOpcode, WCFlags) from providers/base.py; 0 on success */
static int glue_init_wc(PyObject *type, PyObject *status_cls, PyObject *opcode_cls, PyObject *flags_cls)
{
    if (!PyType_Check(type)) {
        PyErr_SetString(PyExc_TypeError, "WorkCompletion must be a class");
        return -1;
    }
    PyTypeObject *t = (PyTypeObject *)type;
    for (int i = 0; i < WC_NFIELDS; i++) {
        PyObject *d = PyDict_GetItemString(t->tp_dict, wc_field_names[i]); /* borrowed */
        if (!d || !Py_IS_TYPE(d, &PyMemberDescr_Type)) {
            PyErr_Format(PyExc_TypeError, "WorkCompletion.%s is not a slot", wc_field_names[i]);
            return -1;
        }
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type != T_OBJECT_EX && m->type != T_OBJECT) {
            PyErr_Format(PyExc_TypeError, "WorkCompletion.%s is not an object slot", wc_field_names[i]);
            return -1;
        }
        wc_offsets[i] = m->offset;
    }
    Py_INCREF(type);
    wc_type = t;
    for (int s = 0; s < 22; s++) {
        wc_status_objs[s] = PyObject_CallFunction(status_cls, "i", s);
        if (!wc_status_objs[s]) return -1;
    }
    for (int o = 0; o < 5; o++) {
        wc_opcode_objs[o] = PyObject_CallFunction(opcode_cls, "i", o);
        if (!wc_opcode_objs[o]) return -1;
    }
    wc_opcode_recv = PyObject_CallFunction(opcode_cls, "i", 128);
    wc_opcode_recv_imm = PyObject_CallFunction(opcode_cls, "i", 129);
    wc_flags_none = PyObject_CallFunction(flags_cls, "i", 0);
    wc_flags_imm = PyObject_CallFunction(flags_cls, "i", 2);
    wc_zero = PyLong_FromLong(0);
    if (!wc_opcode_recv || !wc_opcode_recv_imm || !wc_flags_none || !wc_flags_imm || !wc_zero) return -1;
    return 0;
}

static inline PyObject *wc_opcode_obj(int op)
{
    if (op >= 0 && op < 5) return wc_opcode_objs[op];
    if (op == 128) return wc_opcode_recv;
    return wc_opcode_recv_imm;
}

/* a new WorkCompletion for w, or NULL with an exception set */
static PyObject *glue_make_wc(const struct rc_wc *w)
{
    PyObject *o = wc_type->tp_alloc(wc_type, 0);
    if (!o) return NULL;
    PyObject *v[WC_NFIELDS];
    v[0] = PyLong_FromUnsignedLongLong(w->wr_id);
    v[1] = w->status < 22 ? wc_status_objs[w->status] : wc_status_objs[21];
    Py_INCREF(v[1]);
    v[2] = wc_opcode_obj(w->opcode);
    Py_INCREF(v[2]);
    v[3] = PyLong_FromUnsignedLong(w->byte_len);
    v[4] = PyLong_FromUnsignedLong(w->qp_num);
    v[5] = PyLong_FromUnsignedLong(w->src_qp);
    if (w->has_imm)
        v[6] = PyLong_FromUnsignedLong(w->imm);
    else {
        v[6] = Py_None;
        Py_INCREF(Py_None);
    }
    v[7] = w->has_imm ? wc_flags_imm : wc_flags_none;
    Py_INCREF(v[7]);
    v[8] = wc_zero;
    Py_INCREF(v[8]);
    int bad = 0;
    for (int i = 0; i < WC_NFIELDS; i++) {
        if (!v[i]) bad = 1;
        *(PyObject **)((char *)o + wc_offsets[i]) = v[i]; /* the slot owns the reference */
    }
    if (bad) {
        Py_DECREF(o);
        return NULL;
    }
    return o;
}


/* ----------------------------------------------- reading slots directly ----
 * SendWR, RecvWR and SGE are slots dataclasses too: post_send reads their fields
 * at the slot offsets (borrowed references) when the object is exactly of that
 * class, and falls back to getattr otherwise. */
static int glue_slot_offsets(PyObject *type, const char *const *names, int n, Py_ssize_t *out)
{
    PyTypeObject *t = (PyTypeObject *)type;
    for (int i = 0; i < n; i++) {
        PyObject *d = PyDict_GetItemString(t->tp_dict, names[i]);
        if (!d || !Py_IS_TYPE(d, &PyMemberDescr_Type)) {
            PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", t->tp_name, names[i]);
            return -1;
        }
        out[i] = ((PyMemberDescrObject *)d)->d_member->offset;
    }
    return 0;
}

/* borrowed; NULL (no exception) when the slot is empty */
static inline PyObject *glue_slot(PyObject *o, Py_ssize_t off) { return *(PyObject **)((char *)o + off); }

/* ------------------------------------------------ released regions ---- */
struct zombie_list {
    struct mr **v;
    size_t n, cap;
};

static void zombie_release(struct pd *pd, struct mr *mr)
{
    struct zombie_list *z = (struct zombie_list *)pd->release_ctx;
    if (z->n == z->cap) {
        size_t c = z->cap ? z->cap * 2 : 16;
        struct mr **v = (struct mr **)realloc(z->v, c * sizeof *v);
        if (!v) abort();
        z->v = v;
        z->cap = c;
    }
    z->v[z->n++] = mr;
}

#endif
