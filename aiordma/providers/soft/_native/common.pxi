# Included by both native extensions: the shipped engine (_engine.pyx) and the
# test-only RC core (tests/native/_testing.pyx, which runs rc.c sans-IO for the
# differential tests). The cimports of the C declarations (includes/*.pxd), the
# Python classes the C code reads and builds, and the set-up that finds their
# slots. Its Python imports are absolute, not relative: the two modules live in
# different packages.

cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.long cimport PyLong_AsLong, PyLong_AsUnsignedLongLongMask
from cpython.ref cimport PyObject
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset, strlen, strncpy

from aiordma.providers.soft._native.includes.glue cimport *
from aiordma.providers.soft._native.includes.rc cimport *
from aiordma.providers.soft._native.includes.wire cimport *

import ipaddress as _ipaddress

from aiordma.errors import (
    InvalidWorkRequestError,
    MemoryRegistrationError,
    QueuePairStateError,
)
from aiordma.providers.base import (
    MTU,
    SGE,
    Access,
    QPAttr,
    QPState,
    RecvWR,
    SendWR,
    WCFlags,
    WCOpcode,
    WCStatus,
    WorkCompletion,
)
from aiordma.providers.soft import wire as _wire
from aiordma.providers.base import check_srq_limit as _check_srq_limit
from aiordma.providers.soft.srq import srq_busy_error as _srq_busy_error


# ------------------------------------------------------------- set-up ----

glue_init_wc(WorkCompletion, WCStatus, WCOpcode, WCFlags)

cdef const char *_SENDWR_FIELDS[9]
_SENDWR_FIELDS[:] = [b"wr_id", b"opcode", b"sg_list", b"send_flags", b"imm_data", b"remote_addr", b"rkey",
                     b"compare_add", b"swap"]
cdef const char *_RECVWR_FIELDS[2]
_RECVWR_FIELDS[:] = [b"wr_id", b"sg_list"]
cdef const char *_SGE_FIELDS[3]
_SGE_FIELDS[:] = [b"addr", b"length", b"lkey"]
cdef Py_ssize_t _sw_off[9]
cdef Py_ssize_t _rw_off[2]
cdef Py_ssize_t _sge_off[3]
glue_slot_offsets(SendWR, _SENDWR_FIELDS, 9, _sw_off)
glue_slot_offsets(RecvWR, _RECVWR_FIELDS, 2, _rw_off)
glue_slot_offsets(SGE, _SGE_FIELDS, 3, _sge_off)

_QPSTATE = tuple(QPState(i) for i in range(7))
_MTU = {m.value: m for m in MTU}
