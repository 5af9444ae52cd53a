# pyglue.h: building WorkCompletion objects and reading SendWR/RecvWR/SGE slots
# in C, and the list where a protection domain without a NIC parks released regions.
from cpython.ref cimport PyObject

from .rc cimport mr, pd, rc_wc


cdef extern from "pyglue.h":
    int glue_init_wc(object t, object s, object o, object f) except -1
    object glue_make_wc(const rc_wc *w)
    int glue_slot_offsets(object t, const char **names, int n, Py_ssize_t *out) except -1
    PyObject *glue_slot(object o, Py_ssize_t off)
    struct zombie_list:
        mr **v
        size_t n
    void zombie_release(pd *p, mr *m) nogil
