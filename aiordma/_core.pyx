# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
"""The compiled per-operation core of a connection (typed, C fields).

What every operation touches, as extension types: the send queue's free slots
(:class:`SendQueue`), the table of work requests in flight indexed by ``wr_id``
(:class:`OperationTracker`: preallocated entries, no ``_Op``, ``SendWR``, ``SGE``
or closure built per operation), the message window (:class:`MessageWindow`),
the received-message queue (:class:`Inbox`), the future an awaited operation
resolves (:class:`OpFuture`), and the per-operation paths themselves
(:class:`FastPath`): a one-sided Write or Read from registered memory, a message
that fits one chunk, and the success half of completion handling.

Each class has the Python API of its interpreted twin (:mod:`aiordma.ops`,
:mod:`aiordma.window`, :mod:`aiordma.messages`, :mod:`aiordma.fastpath`), which
stays the reference and the fallback where nothing is compiled; the tests run the
two against each other (``AIORDMA_CORE=python`` selects the interpreted one, see
:mod:`aiordma.core`). Failures, closing, the handshake, large and control
messages stay Python: the core hands them a :class:`~aiordma.verbs.WorkCompletion`
and the connection's own completion handler does what it always did.

Where the provider drives its queue pairs from C (``QueuePair.c_verbs()``: the
soft device's native engine, :file:`aiordma/cverbs.h`), the core writes work
requests straight into its post call and polls the CQ into a C array: one
wake-up resolves every future whose completion is there, each with one call.

Why an own future: a task that awaits an :class:`OpFuture` is resumed by the
completion itself when the core's completion path finishes a successful
operation outside any task (the event loop's reader callback, the usual case):
the task's wake-up runs at once, in the task's context, instead of being queued
for the next turn of the loop (``call_soon``). That saves a loop iteration, a
``Handle`` and a selector call per awaited operation, which on asyncio is as much
work as the operation itself. Anywhere else — inside a task, a failure, anything
resolved from Python (``set_result``, ``set_exception``, ``Inbox.put``) — it is
queued as asyncio does, so a connection's failure and teardown never run a task
halfway through them. The futures a caller is given (``post_write``,
``post_read``) are plain asyncio futures.
"""

cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_GetItem
from cpython.list cimport PyList_Append, PyList_GET_SIZE
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid
from cpython.ref cimport Py_INCREF, Py_XDECREF, PyObject
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc, qsort, realloc
from libc.string cimport memcpy, memmove, memset
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from aiordma.cverbs cimport (
    CVERBS_CAPSULE,
    CVERBS_VERSION,
    cverbs_ops,
    cverbs_send_wr,
    cverbs_sge,
    cverbs_wc,
)

import asyncio as _asyncio
import collections as _collections
import contextvars as _contextvars
import logging as _logging

# (imported under private names: the module's namespace is its classes, see __all__)
from aiordma import descriptors as _descriptors
from aiordma.errors import RDMAError as _RDMAError
from aiordma.errors import fresh as _fresh
from aiordma import metrics as _metrics
from aiordma.memory import Region as _Region
from aiordma.memory import RegionSlice as _RegionSlice
from aiordma.ops import OP_CREDIT as _OP_CREDIT_PY
from aiordma.ops import OP_MESSAGE as _OP_MESSAGE_PY
from aiordma.ops import OP_OTHER as _OP_OTHER_PY
from aiordma.ops import Op as _Op
from aiordma.ops import WaitQueue as _WaitQueue
from aiordma.verbs import WCFlags as _WCFlags
from aiordma.verbs import WCOpcode as _WCOpcode
from aiordma.verbs import WCStatus as _WCStatus
from aiordma.verbs import WorkCompletion as _WorkCompletion
from aiordma.verbs import SGE as _SGE
from aiordma.verbs import SendFlags as _SendFlags
from aiordma.verbs import SendWR as _SendWR
from aiordma.verbs import WROpcode as _WROpcode
from aiordma.window import CREDIT_MASK as _CREDIT_MASK_PY
from aiordma.window import IMM_LAST as _IMM_LAST_PY
from aiordma.window import K_CONTROL as _K_CONTROL_PY
from aiordma.window import K_CREDIT as _K_CREDIT_PY
from aiordma.window import K_LAST as _K_LAST_PY
from aiordma.window import K_MORE as _K_MORE_PY
from aiordma.window import STARVED as _STARVED_PY

_log = _logging.getLogger("aiordma")

__all__ = [
    "BufferPool", "BufferTable", "FastPath", "Inbox", "MessageWindow", "OpFuture", "OperationTracker", "SendQueue",
    "metrics_counts", "metrics_layout", "metrics_set_timing", "prepare_descriptors", "prepare_indices",
]

# ------------------------------------------------------------------ values ----

#: verbs values the per-operation paths compare against, as C constants
cdef enum:
    WR_RDMA_WRITE = 0
    WR_SEND_WITH_IMM = 3
    WR_RDMA_READ = 4
    WR_ATOMIC_CMP_AND_SWP = 5
    WR_ATOMIC_FETCH_AND_ADD = 6
    SEND_SIGNALED = 2
    WC_SUCCESS = 0
    WC_RECV = 128
    WC_RECV_RDMA_WITH_IMM = 129

#: the wr_id bit of a receive work request (aiordma.messages.RECV_TAG)
cdef uint64_t RECV_TAG = (<uint64_t>1) << 62
#: a send-queue wr_id: (generation << IDX_BITS) | index into the table
cdef int IDX_BITS = 20
cdef uint64_t IDX_MASK = ((<uint64_t>1) << 20) - 1
cdef uint64_t GEN_MASK = ((<uint64_t>1) << 40) - 1

cdef int _K_MORE = _K_MORE_PY
cdef int _K_LAST = _K_LAST_PY
cdef int _K_CREDIT = _K_CREDIT_PY
cdef int _K_CONTROL = _K_CONTROL_PY
cdef uint32_t _IMM_LAST = _IMM_LAST_PY
cdef uint32_t _CREDIT_MASK = _CREDIT_MASK_PY
cdef uint32_t _STARVED = _STARVED_PY
cdef int _OP_MESSAGE = _OP_MESSAGE_PY
cdef int _OP_OTHER = _OP_OTHER_PY
cdef int _OP_CREDIT = _OP_CREDIT_PY

# the enum members a _WorkCompletion carries, by value (no enum call per completion)
cdef dict _STATUS = {int(s): s for s in _WCStatus}
cdef dict _OPCODE = {int(o): o for o in _WCOpcode}
cdef object _FLAGS_NONE = _WCFlags(0)
cdef object _FLAGS_IMM = _WCFlags.IBV_WC_WITH_IMM
_WROPCODE = {int(o): o for o in _WROpcode}

import _asyncio as _c_asyncio

# the task running on a loop: the C accelerator's own table where it has one (3.11 has
# no C current_task; 3.12 and 3.13 do, and keep the same table)
cdef object _current_tasks = getattr(_c_asyncio, "_current_tasks", None)
if type(_current_tasks) is not dict:
    _current_tasks = None
cdef object _current_task_py = _asyncio.current_task

# ---------------------------------------------------------------- metrics ----
# What this process's operations did (aiordma.metrics explains the series and keeps
# the interpreted core's twin): C arrays, bumped as completions are reaped, read by
# metrics_counts(). The sizes are aiordma.metrics's (a test compares metrics_layout()).

cdef extern from *:
    int __builtin_clzll(unsigned long long) nogil

cdef enum:
    M_KINDS = 6          # 0 (not counted), write, read, send, atomic, receive
    M_RECEIVE = 5
    M_BUCKETS = 22       # latency: <= 1 us * 2**k for k = 0..20, then +Inf
    M_STATUSES = 32
    M_OPCODES = 8

# the kind of a work request by opcode (aiordma.metrics.KIND_OF_OPCODE)
cdef uint8_t[M_OPCODES] _m_kind_of = [1, 1, 3, 3, 2, 4, 4, 0]
cdef uint64_t[M_KINDS] _m_ops
cdef uint64_t[M_KINDS] _m_wrs
cdef uint64_t[M_KINDS] _m_bytes
cdef uint64_t[M_KINDS] _m_sum_ns
cdef uint64_t[M_KINDS][M_BUCKETS] _m_hist
cdef uint64_t[M_KINDS][M_STATUSES] _m_failed
memset(_m_ops, 0, sizeof(_m_ops))
memset(_m_wrs, 0, sizeof(_m_wrs))
memset(_m_bytes, 0, sizeof(_m_bytes))
memset(_m_sum_ns, 0, sizeof(_m_sum_ns))
memset(_m_hist, 0, sizeof(_m_hist))
memset(_m_failed, 0, sizeof(_m_failed))
cdef bint _m_timing = _metrics.latency_timing()


cdef inline uint64_t _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <uint64_t>ts.tv_sec * 1000000000 + <uint64_t>ts.tv_nsec


cdef inline uint64_t _m_stamp() noexcept nogil:
    """A post's timestamp (0: not timed)."""
    return _now_ns() if _m_timing else 0


cdef inline uint8_t _m_kind(int opcode, int op_kind) noexcept nogil:
    """What a work request counts as (0: nothing, a credit update)."""
    if op_kind == _OP_CREDIT or opcode < 0 or opcode >= M_OPCODES:
        return 0
    return _m_kind_of[opcode]


cdef inline void _m_done(uint8_t kind, uint64_t posted_ns) noexcept nogil:
    """An operation of ``kind`` completed successfully: count it, and time it if it was stamped."""
    cdef uint64_t ns, us
    cdef int b
    _m_ops[kind] += 1
    if posted_ns:
        ns = _now_ns() - posted_ns
        _m_sum_ns[kind] += ns
        us = (ns + 999) // 1000
        if us <= 1:
            b = 0
        else:
            b = 64 - __builtin_clzll(us - 1)
            if b > M_BUCKETS - 1:
                b = M_BUCKETS - 1
        _m_hist[kind][b] += 1


def metrics_counts():
    """Every kind's counts, by index (aiordma.metrics.KINDS): ``(operations, work
    requests, bytes, {status: failed work requests}, latency buckets, latency sum in ns)``."""
    cdef int k, s
    out = []
    for k in range(M_KINDS):
        failed = {s: _m_failed[k][s] for s in range(M_STATUSES) if _m_failed[k][s]}
        out.append((_m_ops[k], _m_wrs[k], _m_bytes[k], failed, [_m_hist[k][s] for s in range(M_BUCKETS)],
                    _m_sum_ns[k]))
    return out


def metrics_layout():
    """(kinds, latency buckets, statuses, the kind of each opcode): what aiordma.metrics checks."""
    return M_KINDS, M_BUCKETS, M_STATUSES, tuple(_m_kind_of[i] for i in range(M_OPCODES))


def metrics_set_timing(bint on):
    """Stamp operations for the latency histograms from now on (or stop)."""
    global _m_timing
    _m_timing = on


_metrics.add_compiled(metrics_counts, metrics_layout(), metrics_set_timing)


cdef inline bint _task_running(object loop):
    """Whether a task is running on ``loop`` now."""
    cdef PyObject *t
    if _current_tasks is not None:
        t = PyDict_GetItem(_current_tasks, loop)
        return t != NULL and <object>t is not None
    return _current_task_py(loop) is not None
# asyncio.Task (the C one where there is one) first, in a fixed order: a set's order
# would follow the types' addresses, and a miss on the first type costs an attribute
# lookup whose price moves with the process's memory layout
cdef tuple _TASK_TYPES = tuple(dict.fromkeys(t for t in (_asyncio.Task, getattr(_asyncio.tasks, "_CTask", None),
                                                        getattr(_asyncio.tasks, "_PyTask", None))
                                             if isinstance(t, type)))
cdef object _TASK = _asyncio.Task
cdef object _problem = _descriptors.problem
cdef object _index_problem = _descriptors.index_problem
cdef object _indices_reference = _descriptors.indices_reference
cdef int _ZERO_LENGTH = _descriptors.ZERO_LENGTH
cdef int _TOO_LONG = _descriptors.TOO_LONG
cdef int _LOCAL_RANGE = _descriptors.LOCAL_RANGE
cdef int _REMOTE_RANGE = _descriptors.REMOTE_RANGE
cdef int _OVERLAP = _descriptors.OVERLAP
cdef uint64_t _MAX_LENGTH = _descriptors.MAX_LENGTH
cdef object _InvalidStateError = _asyncio.InvalidStateError
cdef object _CancelledError = _asyncio.CancelledError
cdef object _copy_context = _contextvars.copy_context
cdef object _deque = _collections.deque


# _WorkCompletion is a dataclass with __slots__: its fields are member descriptors at
# fixed offsets, which _make_wc fills in directly (no __init__ call per completion).
cdef extern from "Python.h":
    ctypedef struct PyMemberDef:
        const char *name
        int type
        Py_ssize_t offset
    ctypedef struct PyMemberDescrObject:
        PyMemberDef *d_member
    ctypedef struct PyTypeObject:
        PyObject *(*tp_alloc)(PyTypeObject *, Py_ssize_t) except NULL

cdef tuple _WC_FIELDS = ("wr_id", "status", "opcode", "byte_len", "qp_num", "src_qp", "imm_data", "wc_flags",
                         "vendor_err")
cdef Py_ssize_t _wc_off[9]


cdef int _wc_offsets() except -1:
    cdef int i
    for i in range(9):
        d = _WorkCompletion.__dict__[_WC_FIELDS[i]]
        if type(d).__name__ != "member_descriptor":
            raise ImportError(f"_WorkCompletion.{_WC_FIELDS[i]} is not a slot")
        _wc_off[i] = (<PyMemberDescrObject *>d).d_member.offset
    return 0


_wc_offsets()


cdef inline void _set_slot(PyObject *o, int i, object v) noexcept:
    Py_INCREF(v)
    (<PyObject **>((<char *>o) + _wc_off[i]))[0] = <PyObject *>v


cdef object _make_wc(const cverbs_wc *w):
    """The _WorkCompletion of ``w`` (what the slow paths and post_* futures get)."""
    cdef PyObject *o = (<PyTypeObject *>_WorkCompletion).tp_alloc(<PyTypeObject *>_WorkCompletion, 0)
    obj = <object>o
    Py_XDECREF(o)  # (obj holds it now)
    _set_slot(o, 0, w.wr_id)
    _set_slot(o, 1, _STATUS.get(w.status, w.status))
    _set_slot(o, 2, _OPCODE.get(w.opcode, w.opcode))
    _set_slot(o, 3, w.byte_len)
    _set_slot(o, 4, w.qp_num)
    _set_slot(o, 5, w.src_qp)
    if w.has_imm:
        _set_slot(o, 6, w.imm_data)
        _set_slot(o, 7, _FLAGS_IMM)
    else:
        _set_slot(o, 6, None)
        _set_slot(o, 7, _FLAGS_NONE)
    _set_slot(o, 8, w.vendor_err)
    return obj


# --------------------------------------------------------------- futures ----

cdef enum:
    POOL_NONE = 0
    POOL_SEND = 1
    POOL_SCRATCH = 2

cdef enum:
    PENDING = 0
    FINISHED = 1
    CANCELLED = 2


cdef inline bint _is_task_wakeup(object fn):
    """Whether ``fn`` is an asyncio Task's wake-up (what a task awaiting a future registers)."""
    owner = getattr(fn, "__self__", None)
    # the common case, asyncio's own Task, by identity: no attribute lookup
    return type(owner) is _TASK or isinstance(owner, _TASK_TYPES)


@cython.freelist(32)
cdef class OpFuture:
    """The future of one awaited operation: asyncio's future protocol (a Task
    awaits it, ``asyncio.isfuture`` says yes, callbacks run in their context), with
    one difference: the wake-up of a task awaiting it runs at once when it is
    resolved outside any task (see the module's docstring)."""

    cdef object _loop
    cdef int _state
    cdef object _result
    cdef object _exception
    cdef object _cancel_message
    cdef object _cb0
    cdef object _ctx0
    cdef bint _cb0_task
    cdef list _more
    cdef public bint _asyncio_future_blocking

    def __cinit__(self, loop):
        self._loop = loop

    def get_loop(self):
        return self._loop

    def done(self):
        return self._state != PENDING

    def cancelled(self):
        return self._state == CANCELLED

    def result(self):
        if self._state == CANCELLED:
            raise self._cancelled_error()
        if self._state == PENDING:
            raise _InvalidStateError("Result is not ready.")
        if self._exception is not None:
            raise self._exception
        return self._result

    def exception(self):
        if self._state == CANCELLED:
            raise self._cancelled_error()
        if self._state == PENDING:
            raise _InvalidStateError("Exception is not set.")
        return self._exception

    cdef object _cancelled_error(self):
        if self._cancel_message is None:
            return _CancelledError()
        return _CancelledError(self._cancel_message)

    def add_done_callback(self, fn, *, context=None):
        if context is None:
            context = _copy_context()
        if self._state != PENDING:
            self._loop.call_soon(fn, self, context=context)
            return
        if self._cb0 is None and self._more is None:
            self._cb0 = fn
            self._ctx0 = context
            self._cb0_task = _is_task_wakeup(fn)
        else:
            if self._more is None:
                self._more = []
            self._more.append((fn, context))

    def remove_done_callback(self, fn):
        cdef int removed = 0
        if self._cb0 is not None and self._cb0 == fn:
            self._cb0 = None
            self._ctx0 = None
            removed += 1
        if self._more:
            keep = [(f, c) for f, c in self._more if f != fn]
            removed += len(self._more) - len(keep)
            self._more = keep or None
        return removed

    def cancel(self, msg=None):
        if self._state != PENDING:
            return False
        self._state = CANCELLED
        self._cancel_message = msg
        self._schedule(False)
        return True

    def set_result(self, result):
        if self._state != PENDING:
            raise _InvalidStateError(f"{self._state_name()}: {self!r}")
        self._result = result
        self._state = FINISHED
        self._schedule(False)

    def resolve_now(self, result):
        """Set the result as the core's completion paths do: outside any task, the
        task awaiting this future resumes now, inside this call (see the module's
        docstring); inside a task, or for other callbacks, as :meth:`set_result`."""
        if self._state != PENDING:
            raise _InvalidStateError(f"{self._state_name()}: {self!r}")
        self._resolve(result)

    def set_exception(self, exception):
        if self._state != PENDING:
            raise _InvalidStateError(f"{self._state_name()}: {self!r}")
        if isinstance(exception, type):
            exception = exception()
        if isinstance(exception, StopIteration):
            raise TypeError("StopIteration interacts badly with generators and cannot be raised into a Future")
        self._exception = exception
        self._state = FINISHED
        self._schedule(False)

    cdef inline int _resolve(self, object result) except -1:
        """resolve_now for the core's own paths (the future is known to be pending)."""
        self._result = result
        self._state = FINISHED
        return self._schedule(True)

    cdef str _state_name(self):
        return ("PENDING", "FINISHED", "CANCELLED")[self._state]

    cdef int _schedule(self, bint eager) except -1:
        cb = self._cb0
        more = self._more
        if cb is None and more is None:
            return 0
        ctx = self._ctx0
        self._cb0 = None
        self._ctx0 = None
        self._more = None
        if cb is not None:
            if eager and self._cb0_task and more is None and not _task_running(self._loop):
                # the awaiting task resumes now, in its own context (see the module's docstring)
                ctx.run(cb, self)
                return 0
            self._loop.call_soon(cb, self, context=ctx)
        if more is not None:
            for fn, c in more:
                self._loop.call_soon(fn, self, context=c)
        return 0

    def __await__(self):
        return _OpFutureIter(self)

    __iter__ = __await__

    def __repr__(self):
        return f"<OpFuture {self._state_name().lower()}>"


@cython.freelist(32)
cdef class _OpFutureIter:
    """What ``await`` iterates: yields the future until it is done, then returns its result."""

    cdef OpFuture fut

    def __cinit__(self, OpFuture fut):
        self.fut = fut

    def __iter__(self):
        return self

    def __next__(self):
        fut = self.fut
        if fut is None:
            raise StopIteration
        if fut._state == PENDING:
            fut._asyncio_future_blocking = True
            return fut
        self.fut = None
        if fut._state == FINISHED and fut._exception is None:
            res = fut._result
            if res is None:
                # (Cython returns NULL with no exception set: the await's value is None,
                # without a StopIteration object made and caught per operation)
                raise StopIteration
            raise StopIteration(res)
        fut.result()  # raises the exception, or CancelledError

    def send(self, value):
        return self.__next__()


# ------------------------------------------------------------- send queue ----

cdef class SendQueue:
    """The free slots of a queue pair's send queue (``max_send_wr``): the
    compiled twin of :class:`aiordma.ops.SendQueue`."""

    cdef public int depth
    cdef public int free
    cdef public object waiters
    cdef object _failed

    def __init__(self, int depth, loop):
        self.depth = depth
        self.free = depth
        self.waiters = _WaitQueue(loop)
        self._failed = None

    async def acquire(self, int n=1):
        """Take ``n`` slots at once (a chain must not hold some and wait for the rest)."""
        if self._failed is not None:
            raise _fresh(self._failed)
        if self.free >= n and not self.waiters:
            self.free -= n
            return
        if n > self.depth:
            raise ValueError(f"{n} work requests exceed the send queue depth ({self.depth})")
        await self.waiters.wait(n, lambda _: self.release(n), self._hand_over)

    def release(self, int n=1):
        """``n`` completions were reaped: their slots are free."""
        self.free += n
        if self.waiters:
            self._hand_over()

    def _hand_over(self):
        waiters = self.waiters
        while True:
            need = waiters.first_need()
            if need is None or self.free < need:
                return
            self.free -= need
            waiters.resolve_first(None)

    def fail(self, exc):
        """The queue pair is gone: every waiter (and every later acquire) raises ``exc``."""
        self._failed = exc
        self.waiters.fail_all(exc)

    cdef inline int _give_back(self, int n) except -1:
        self.free += n
        if self.waiters:
            self._hand_over()
        return 0


# --------------------------------------------------------- buffer pools ----

cdef class BufferPool:
    """Fixed-size registered buffers (slots) carved out of one region: the compiled
    twin of :class:`aiordma.memory.BufferPool` (a connection's send buffers, its
    atomics' result words). The free slots are a C stack (the most recently freed
    is taken first); coroutines waiting for one are served in order."""

    cdef public object region
    cdef public Py_ssize_t size
    cdef public Py_ssize_t count
    cdef int *stack
    cdef int nfree
    #: coroutines waiting for a slot, first come first served
    cdef public object waiters

    def __init__(self, region, Py_ssize_t size):
        cdef Py_ssize_t i
        self.region = region
        self.size = size
        self.count = region.length // size
        self.stack = <int *>malloc(max(self.count, 1) * sizeof(int))
        if self.stack == NULL:
            raise MemoryError()
        for i in range(self.count):  # taken from the end: slot 0 first
            self.stack[i] = <int>(self.count - 1 - i)
        self.nfree = <int>self.count
        self.waiters = _WaitQueue()

    def __dealloc__(self):
        free(self.stack)
        self.stack = NULL

    @property
    def free(self):
        """The free slots, the next to be taken last (a copy, as the interpreted pool's list reads)."""
        return [self.stack[i] for i in range(self.nfree)]

    cdef inline int _pop(self) noexcept:
        self.nfree -= 1
        return self.stack[self.nfree]

    cdef inline void _push(self, int index) noexcept:
        self.stack[self.nfree] = index
        self.nfree += 1

    def try_acquire(self):
        """A free slot now, or None (also when coroutines are already waiting: no overtaking)."""
        if self.nfree and not self.waiters:
            return self._pop()
        return None

    async def acquire(self):
        if self.nfree and not self.waiters:
            return self._pop()
        slot = await self.waiters.wait(1, self.release, self._hand_over)
        return slot

    def release(self, int index):
        cdef int i
        if index < 0 or index >= self.count or self.nfree >= self.count:
            raise ValueError(f"slot {index} is not a taken slot of this pool")
        for i in range(self.nfree):
            if self.stack[i] == index:
                raise ValueError(f"slot {index} is not a taken slot of this pool")
        self._push(index)
        if self.waiters:
            self._hand_over()

    def _hand_over(self):
        waiters = self.waiters
        while waiters and self.nfree and waiters.first_need() is not None:
            waiters.resolve_first(self._pop())

    @property
    def waiting(self):
        """Coroutines waiting for a slot."""
        return len(self.waiters)

    def view(self, Py_ssize_t index, length=None):
        cdef Py_ssize_t off = index * self.size
        return self.region.view[off : off + (self.size if length is None else length)]

    def sge(self, Py_ssize_t index, length=None):
        return self.region.sge(index * self.size, self.size if length is None else length)

    def close(self):
        self.region.close()


# ----------------------------------------------------------- operations ----

cdef struct Entry:
    uint64_t wr_id      # 0: free
    PyObject *op        # a Python _Op (posted through post/post_chain), owned; or NULL
    PyObject *fut       # the fast entry's future, owned; or NULL
    PyObject *remote    # the fast one-sided entry's RemoteBuffer (its description), owned; or NULL
    uint32_t nbytes
    int32_t slot        # a buffer of `pool` released by the completion (-1: none)
    int32_t next_free
    uint8_t opcode
    uint8_t kind
    uint8_t wants_wc    # the future's result is the _WorkCompletion (post_write, post_read)
    uint8_t pool        # what `slot` is in: POOL_SEND (a message's send buffer), POOL_SCRATCH (an atomic's result)
    uint8_t metric      # what it counts as (aiordma.metrics.KINDS; 0: nothing)
    uint64_t posted_ns  # when it was posted (0: not timed)


cdef class OperationTracker:
    """The work requests a queue pair has in flight, by ``wr_id``: the compiled
    twin of :class:`aiordma.ops.OperationTracker`, a table of preallocated entries
    (it doubles when full) whose index is in the ``wr_id``. An entry either holds a
    Python :class:`~aiordma.ops.Op` (the general paths post one) or, for the fast
    paths, just its future, size and opcode in C fields; :meth:`ops` and
    :meth:`complete` give the latter a Python ``_Op`` when a slow path needs one."""

    cdef Entry *t
    cdef int cap
    cdef int free_head
    cdef int count
    cdef uint64_t gen
    cdef object _qp
    cdef SendQueue _sq
    #: called after each post (the completion dispatcher's poll window)
    cdef public object expect
    #: what releases a fast entry's buffer: a send buffer, an atomic's scratch word
    #: (BufferPool.release of each; set by FastPath)
    cdef object _release_slot
    cdef object _release_scratch
    #: where the atomics' scratch words are (their results are read there)
    cdef uint64_t _scratch_addr

    def __init__(self, qp, SendQueue sq, expect):
        self._qp = qp
        self._sq = sq
        self.expect = expect
        self.gen = 1
        self.free_head = -1
        self._grow(16)

    def __dealloc__(self):
        cdef int i
        if self.t != NULL:
            for i in range(self.cap):
                self._clear(i)
            free(self.t)
            self.t = NULL

    cdef int _grow(self, int cap) except -1:
        cdef Entry *t
        cdef int i
        if cap > <int>(IDX_MASK + 1):
            raise _RDMAError(f"more than {IDX_MASK + 1} work requests in flight on one queue pair")
        t = <Entry *>realloc(self.t, cap * sizeof(Entry))
        if t == NULL:
            raise MemoryError()
        memset(t + self.cap, 0, (cap - self.cap) * sizeof(Entry))
        for i in range(cap - 1, self.cap - 1, -1):
            t[i].next_free = self.free_head
            t[i].slot = -1
            self.free_head = i
        self.t = t
        self.cap = cap
        return 0

    cdef inline int _alloc(self) except -1:
        """A free entry's index, its wr_id set."""
        cdef int i
        if self.free_head < 0:
            self._grow(self.cap * 2)
        i = self.free_head
        self.free_head = self.t[i].next_free
        self.gen = (self.gen + 1) & GEN_MASK
        if self.gen == 0:
            self.gen = 1
        self.t[i].wr_id = (self.gen << IDX_BITS) | <uint64_t>i
        self.t[i].metric = 0
        self.t[i].posted_ns = 0
        self.count += 1
        return i

    cdef inline void _m_retired(self, int i) noexcept:
        """Entry ``i``'s work request completed successfully: count it (before it is freed)."""
        cdef Entry *e = &self.t[i]
        if e.metric:
            _m_wrs[e.metric] += 1
            _m_bytes[e.metric] += e.nbytes

    cdef inline int _m_posted(self, int i, object wr, object op) except -1:
        """Entry ``i`` holds ``wr`` of the general path's ``op``: what it counts as, its bytes, its post time."""
        cdef Entry *e = &self.t[i]
        e.metric = _m_kind(int(op.opcode), op.kind)
        if e.metric:
            e.nbytes = wr.length
            e.posted_ns = _m_stamp()
        return 0

    cdef inline void _clear(self, int i) noexcept:
        cdef Entry *e = &self.t[i]
        Py_XDECREF(e.op)
        Py_XDECREF(e.fut)
        Py_XDECREF(e.remote)
        e.op = NULL
        e.fut = NULL
        e.remote = NULL

    cdef inline void _free(self, int i) noexcept:
        """Retire entry ``i`` (its references are dropped)."""
        cdef Entry *e = &self.t[i]
        if e.wr_id == 0:
            return
        self._clear(i)
        e.wr_id = 0
        e.slot = -1
        e.wants_wc = 0
        e.pool = POOL_NONE
        e.next_free = self.free_head
        self.free_head = i
        self.count -= 1

    cdef inline int _find(self, uint64_t wr_id) noexcept:
        """The index of the entry of ``wr_id``, or -1."""
        cdef uint64_t i = wr_id & IDX_MASK
        if wr_id == 0 or i >= <uint64_t>self.cap or self.t[i].wr_id != wr_id:
            return -1
        return <int>i

    cdef inline object _releaser(self, int i):
        """What frees entry ``i``'s buffer (None: nothing)."""
        cdef Entry *e = &self.t[i]
        if e.slot < 0:
            return None
        if e.pool == POOL_SEND and self._release_slot is not None:
            return _SlotRelease(self._release_slot, e.slot)
        if e.pool == POOL_SCRATCH and self._release_scratch is not None:
            return _SlotRelease(self._release_scratch, e.slot)
        return None

    cdef int _add_fast(self, object fut, object remote, uint32_t nbytes, int opcode, int kind, int slot,
                       bint wants_wc) except -1:
        cdef int i = self._alloc()
        cdef Entry *e = &self.t[i]
        if fut is not None:
            Py_INCREF(fut)
            e.fut = <PyObject *>fut
        if remote is not None:
            Py_INCREF(remote)
            e.remote = <PyObject *>remote
        e.nbytes = nbytes
        e.opcode = opcode
        e.kind = kind
        e.slot = slot
        e.wants_wc = wants_wc
        e.pool = POOL_SEND if slot >= 0 else POOL_NONE
        e.metric = _m_kind(opcode, kind)
        e.posted_ns = _m_stamp()
        return i

    cdef object _materialize(self, int i):
        """The Python _Op of entry ``i`` (made for a fast entry, without changing it)."""
        cdef Entry *e = &self.t[i]
        if e.op != NULL:
            return <object>e.op
        fut = <object>e.fut if e.fut != NULL else None
        release = self._releaser(i)
        if e.remote != NULL:
            describe = _Describe(e.opcode, e.nbytes, <object>e.remote)  # (formatted when an error needs it)
        else:
            describe = None  # a one-chunk send: _Op.description() says "SEND of a n-byte message"
        op = _Op(fut, release, describe, _WROPCODE.get(e.opcode, e.opcode), e.kind)
        op.nbytes = e.nbytes
        return op

    # ---------------------------------------------------- the Python API ----
    def __len__(self):
        return self.count

    def post(self, wr, op):
        """Post ``wr`` as ``op``'s work request (a send-queue slot must be held).
        If the device refuses it, the slot and ``op``'s buffer are given back."""
        cdef int i = self._alloc()
        Py_INCREF(op)
        self.t[i].op = <PyObject *>op
        wr.wr_id = self.t[i].wr_id
        self._m_posted(i, wr, op)
        try:
            self._qp.post_send(wr)
            self.expect()
        except BaseException:
            self._free(i)
            op.fut = None
            self._sq._give_back(1)
            if op.release is not None:
                op.release()
            raise

    def post_chain(self, wrs, op):
        """Post linked work requests with one doorbell; only the last is
        signaled. ``len(wrs)`` send-queue slots must be held."""
        cdef int i
        members = set()
        idx = []
        for wr in wrs:
            i = self._alloc()
            Py_INCREF(op)
            self.t[i].op = <PyObject *>op
            wr.wr_id = self.t[i].wr_id
            self._m_posted(i, wr, op)
            members.add(wr.wr_id)
            idx.append(i)
        op.members = members
        try:
            self._qp.post_send(wrs)
            self.expect()
        except BaseException:
            for i in idx:
                self._free(i)
            self._sq._give_back(len(wrs))
            if op.release is not None:
                op.release()
            raise

    def complete(self, wc):
        """A send-queue completion: retire its work request (and, for a chain,
        the members it implies). Returns the op it completes, or None for an
        unknown ``wr_id`` (see :meth:`aiordma.ops.OperationTracker.complete`)."""
        cdef uint64_t wr_id = wc.wr_id
        cdef int i = self._find(wr_id)
        cdef int j
        cdef uint64_t m
        cdef Entry *e
        cdef uint8_t metric
        cdef uint64_t posted_ns
        cdef int status
        if i < 0:
            return None
        op = self._materialize(i)
        e = &self.t[i]
        metric = e.metric
        posted_ns = e.posted_ns
        status = wc.status
        if status == WC_SUCCESS:
            self._m_retired(i)
        elif metric:
            _m_failed[metric][status if 0 <= status < M_STATUSES else M_STATUSES - 1] += 1
        if (e.op == NULL and e.pool == POOL_SCRATCH and e.slot >= 0 and wc.status == WC_SUCCESS
                and type(op.fut) is OpFuture and (<OpFuture>op.fut)._state == PENDING):
            # a fast atomic completed through the general path (held completions, a provider
            # without C verbs): its result is the word the NIC wrote, not the completion
            (<OpFuture>op.fut)._result = _le64(self._scratch_addr + <uint64_t>e.slot * 8)
            (<OpFuture>op.fut)._state = FINISHED
            (<OpFuture>op.fut)._schedule(False)
        self._free(i)
        self._sq._give_back(1)
        members = op.members
        if members is None:
            if metric and status == WC_SUCCESS:
                _m_done(metric, posted_ns)
            return op
        members.discard(wr_id)
        if status == WC_SUCCESS:
            # the signaled last of a chain: every write before it is done
            for m in members:
                j = self._find(m)
                if j >= 0:
                    self._m_retired(j)
                    self._free(j)
                    self._sq._give_back(1)
            members.clear()
            if metric:
                _m_done(metric, posted_ns)
            return op
        # the queue pair ran the chain in order: the members before the one that failed completed
        for m in [m for m in members if m < wr_id]:
            members.discard(m)
            j = self._find(m)
            if j >= 0:
                self._free(j)
                self._sq._give_back(1)
        return op

    def ops(self):
        """The operations in flight (each once; a chain's members share one)."""
        cdef int i
        out = []
        seen = set()
        for i in range(self.cap):
            if self.t[i].wr_id == 0:
                continue
            if self.t[i].op != NULL:
                if id(<object>self.t[i].op) in seen:
                    continue
                seen.add(id(<object>self.t[i].op))
            out.append(self._materialize(i))
        return out

    def oldest_posted_ns(self):
        """When the oldest work request still in flight was posted (time.monotonic_ns),
        or 0: none in flight, or none timed (AIORDMA_METRICS_LATENCY=0)."""
        cdef int i
        cdef uint64_t oldest = 0
        for i in range(self.cap):
            if self.t[i].wr_id != 0 and self.t[i].posted_ns and (oldest == 0 or self.t[i].posted_ns < oldest):
                oldest = self.t[i].posted_ns
        return oldest

    def outstanding(self, int kind):
        """How many ops of ``kind`` are in flight (chains count once)."""
        cdef int i, n = 0
        seen = set()
        for i in range(self.cap):
            if self.t[i].wr_id == 0:
                continue
            if self.t[i].op != NULL:
                op = <object>self.t[i].op
                if op.kind == kind and id(op) not in seen:
                    seen.add(id(op))
                    n += 1
            elif self.t[i].kind == kind:
                n += 1
        return n

    def release_all(self):
        """The queue pair is destroyed: nothing can touch the buffers any more."""
        cdef int i
        released = set()
        releases = []
        for i in range(self.cap):
            if self.t[i].wr_id == 0:
                continue
            if self.t[i].op != NULL:
                op = <object>self.t[i].op
                if op.release is not None and id(op) not in released:
                    released.add(id(op))
                    releases.append(op.release)
            else:
                release = self._releaser(i)
                if release is not None:
                    releases.append(release)
            self._free(i)
        for release in releases:
            try:
                release()
            except Exception:  # pragma: no cover
                pass


@cython.final
cdef class _Describe:
    """What a fast one-sided operation is, in words, for its error message (made only
    when a failure asks: ``Op.description()`` calls it)."""

    cdef int opcode
    cdef uint32_t nbytes
    cdef object remote

    def __cinit__(self, int opcode, uint32_t nbytes, remote):
        self.opcode = opcode
        self.nbytes = nbytes
        self.remote = remote

    def __call__(self):
        if self.opcode == WR_ATOMIC_CMP_AND_SWP:
            return f"ATOMIC_CMP_AND_SWP on {self.remote!r}"
        if self.opcode == WR_ATOMIC_FETCH_AND_ADD:
            return f"ATOMIC_FETCH_AND_ADD on {self.remote!r}"
        if self.opcode == WR_RDMA_READ:
            return f"RDMA_READ of {self.nbytes} bytes from {self.remote!r}"
        return f"RDMA_WRITE of {self.nbytes} bytes to {self.remote!r}"


@cython.final
cdef class _SlotRelease:
    """``pool.release(slot)`` as a callable (what a fast send's _Op releases)."""

    cdef object release
    cdef int slot

    def __cinit__(self, release, int slot):
        self.release = release
        self.slot = slot

    def __call__(self):
        self.release(self.slot)


# -------------------------------------------------------- message window ----

cdef class MessageWindow:
    """Credit and reassembly state of one connection (both directions): the
    compiled twin of :class:`aiordma.window.MessageWindow` (its docstring has the
    rules)."""

    cdef public long long credits
    cdef public long long grant
    cdef public long long grant_max
    cdef public bint signal
    cdef public long long owed
    cdef public long long held
    cdef public long long threshold
    cdef public long long chunk_size
    cdef public long long budget
    cdef public long long buffered
    cdef public long long queued
    cdef public bint credit_update_inflight
    cdef public long long starved_marks
    cdef public long long grants_grown
    cdef public list _parts
    cdef public long long _parts_bytes
    cdef public object shared

    def __init__(self, int recv_slots, budget=32 << 20, shared=None, int initial=0):
        if recv_slots < 4:
            raise ValueError(
                "recv_buffers must be at least 4: the peer keeps its last credit for credit updates, and "
                "credits are returned in batches of recv_buffers // 2 (at least 2)"
            )
        if budget < 0:
            raise ValueError(f"the receive budget must not be negative, got {budget}")
        if initial and not 4 <= initial <= recv_slots:
            raise ValueError(f"the initial grant of credits must be 4 .. recv_buffers ({recv_slots}), got {initial}")
        self.credits = 0
        self.owed = 0
        self.held = 0
        self.grant_max = recv_slots
        self.grant = initial or recv_slots
        self.threshold = max(2, self.grant // 2)
        self.signal = False
        self.starved_marks = 0
        self.grants_grown = 0
        self.chunk_size = 0
        self.budget = budget
        self.buffered = 0
        self.queued = 0
        self.credit_update_inflight = False
        self._parts = []
        self._parts_bytes = 0
        self.shared = shared

    def start(self, long long peer_slots, long long chunk_size, bint signal=False):
        self.credits = peer_slots
        self.chunk_size = chunk_size
        self.signal = signal

    def can_send_chunk(self):
        return self.credits >= 2

    def spend(self):
        self.credits -= 1

    def give_back(self):
        self.credits += 1

    def take_owed(self):
        return self._take_owed()

    cdef inline uint32_t _take_owed(self) noexcept:
        cdef long long n = self.owed
        if n > _CREDIT_MASK:
            n = _CREDIT_MASK
        self.owed -= n
        if self.signal and self.credits < 2:
            self.starved_marks += 1
            return <uint32_t>n | _STARVED
        return <uint32_t>n

    def grow(self):
        self._grow()

    cdef inline void _grow(self) noexcept:
        cdef long long extra = self.grant_max - self.grant
        if extra > self.grant:
            extra = self.grant
        self.grant += extra
        self.owed += extra
        self.threshold = max(2, self.grant // 2)
        if extra:
            self.grants_grown += 1

    def credit_update_due(self):
        return self.owed >= self.threshold and not self.credit_update_inflight and self.credits >= 1

    def on_chunk(self, imm, data):
        return self._on_chunk(<uint32_t>(imm & 0xFFFFFFFF), data)

    cdef tuple _on_chunk(self, uint32_t imm, bytes data):
        cdef int kind = imm >> 30
        cdef uint32_t returned = imm & _CREDIT_MASK
        cdef Py_ssize_t n
        if returned:
            self.credits += returned
        if kind == _K_LAST or kind == _K_MORE:
            n = PyBytes_GET_SIZE(data)
            self.buffered += n
            shared = self.shared
            if shared is not None:
                shared.buffered += n
            if self.queued and (self.buffered > self.budget or (shared is not None and shared.buffered > shared.limit)):
                self.held += 1
            else:
                self.owed += 1
                if imm & _STARVED and self.grant < self.grant_max and not self.held:
                    self._grow()
            if kind == _K_MORE:
                self._parts.append(data)
                self._parts_bytes += n
                return (_K_MORE, None)
            self.queued += 1
            parts = self._parts
            if parts:
                parts.append(data)
                self._parts = []
                self._parts_bytes = 0
                return (_K_LAST, parts)
            return (_K_LAST, data)
        self.owed += 1
        if kind == _K_CONTROL:
            if imm & _STARVED and self.grant < self.grant_max and not self.held:
                self._grow()
            parts = self._parts
            if parts:
                # the chunks before were counted as message bytes: they were a control message
                self.buffered -= self._parts_bytes
                if self.shared is not None:
                    self.shared.buffered -= self._parts_bytes
                parts.append(data)
                data = b"".join(parts)
                self._parts = []
                self._parts_bytes = 0
            return (_K_CONTROL, data)
        return (kind, None)

    def consumed(self, long long nbytes):
        self._consumed(nbytes)

    cdef int _consumed(self, long long nbytes) except -1:
        self.buffered -= nbytes
        self.queued -= 1
        shared = self.shared
        if shared is not None:
            shared.buffered -= nbytes
        if self.held and (
            not self.queued or (self.buffered <= self.budget and (shared is None or shared.buffered <= shared.limit))
        ):
            self.owed += self.held
            self.held = 0
        return 0

    def leave_shared(self):
        shared, self.shared = self.shared, None
        if shared is not None:
            shared.buffered -= self.buffered

    def stats(self):
        return {
            "send_credits": self.credits,
            "recv_grant": self.grant,
            "recv_grant_grown": self.grants_grown,
            "send_starved_marks": self.starved_marks,
            "credits_owed": self.owed,
            "credits_held": self.held,
            "recv_buffered_bytes": self.buffered,
            "recv_queued_messages": self.queued,
            "recv_budget": self.budget,
            "process_recv_buffered_bytes": self.shared.buffered if self.shared is not None else 0,
        }


# ----------------------------------------------------------------- inbox ----

cdef class Inbox:
    """Received items waiting for ``recv()``: the compiled twin of
    :class:`aiordma.messages.Inbox` (same semantics: ``put`` never blocks, a
    waiter is woken with the item left in the queue, in order); its waiters are
    :class:`OpFuture` s, so a receiver is resumed by the completion that brought
    its message."""

    cdef public object items
    cdef public list waiters
    cdef public object loop

    def __init__(self, loop):
        self.items = _deque()
        self.waiters = []
        self.loop = loop

    def put(self, item):
        self.items.append(item)
        if self.waiters:
            self._wake_next(False)

    cdef inline int _put_now(self, object item) except -1:
        """put, from the core's receive path: a waiting task resumes at once (OpFuture.resolve_now)."""
        self.items.append(item)
        if self.waiters:
            self._wake_next(True)
        return 0

    def put_back(self, item):
        self.items.appendleft(item)
        if self.waiters:
            self._wake_next(False)

    def wake_next(self):
        self._wake_next(False)

    cdef int _wake_next(self, bint now) except -1:
        cdef list waiters = self.waiters
        while waiters:
            waiter = waiters.pop(0)
            if type(waiter) is OpFuture:
                if (<OpFuture>waiter)._state == PENDING:
                    if now:
                        (<OpFuture>waiter)._resolve(None)
                    else:
                        waiter.set_result(None)
                    break
            elif not waiter.done():
                waiter.set_result(None)
                break
        return 0

    async def get(self):
        items = self.items
        while not items:
            waiter = OpFuture(self.loop)
            self.waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                waiter.cancel()  # in case it is not done yet
                try:
                    self.waiters.remove(waiter)
                except ValueError:  # put() had already taken it off
                    pass
                if items and not waiter.cancelled():
                    # woken by put() but cancelled before taking the item: pass it on
                    self._wake_next(False)
                raise
        return items.popleft()


# ---------------------------------------------------------- buffer table ----

cdef class BufferTable:
    """Registered buffers of one size, by slot: the compiled twin of
    :class:`aiordma.memory.BufferTable` (C arrays of addresses and lkeys, which the
    receive and send paths read without a Python call: with a shared receive queue a
    receive completion's ``wr_id`` names a buffer of the device, not of the
    connection the completion landed on)."""

    cdef uint64_t *_addrs
    cdef uint32_t *_lkeys
    cdef int n
    cdef int cap
    cdef public long long size
    #: slots below this are in service (those above are being retired)
    cdef public int active

    def __init__(self, long long size):
        if size <= 0:
            raise ValueError(f"a buffer size must be positive, got {size}")
        self.size = size

    def __dealloc__(self):
        free(self._addrs)
        free(self._lkeys)

    def add(self, uint64_t addr, uint32_t lkey, int n):
        cdef int i, cap
        cdef uint64_t *a
        cdef uint32_t *k
        if n <= 0:
            raise ValueError(f"add at least one buffer, not {n}")
        if self.n + n > self.cap:
            cap = max(self.n + n, 2 * self.cap, 16)
            a = <uint64_t *>realloc(self._addrs, cap * sizeof(uint64_t))
            if a == NULL:
                raise MemoryError()
            self._addrs = a
            k = <uint32_t *>realloc(self._lkeys, cap * sizeof(uint32_t))
            if k == NULL:
                raise MemoryError()
            self._lkeys = k
            self.cap = cap
        first = self.n
        for i in range(n):
            self._addrs[first + i] = addr + <uint64_t>i * <uint64_t>self.size
            self._lkeys[first + i] = lkey
        self.n += n
        self.active = self.n
        return first

    def truncate(self, int n):
        if not 0 <= n <= self.n:
            raise ValueError(f"cannot truncate {self.n} slots to {n}")
        self.n = n
        if self.active > n:
            self.active = n

    def addr(self, Py_ssize_t slot):
        if not 0 <= slot < self.n:
            raise IndexError("list index out of range")
        return self._addrs[slot]

    def lkey(self, Py_ssize_t slot):
        if not 0 <= slot < self.n:
            raise IndexError("list index out of range")
        return self._lkeys[slot]

    def __len__(self):
        return self.n


# ------------------------------------------------------------- fast path ----

cdef enum:
    BACKLOG = 64


cdef bint _atomic_word(object value, uint64_t *word) except -1:
    """``value`` as the 64-bit word an atomic carries (work_requests.atomic_operand's
    rule: -2**63 <= value < 2**64, negatives as two's complement); False for
    anything else, which the general path then refuses with the reason."""
    if type(value) is not int:
        return False
    if value >= 0:
        if value > 0xFFFFFFFFFFFFFFFF:
            return False
        word[0] = <uint64_t>value
    else:
        if value < -0x8000000000000000:
            return False
        word[0] = <uint64_t>(<int64_t>value)
    return True


cdef class FastPath:
    """A connection's per-operation paths (the compiled twin of
    :class:`aiordma.fastpath.FastPath`): each returns None where the general path
    (Python) must run instead.

    ``on_completion(wc)`` is the connection's own completion handler, which gets
    every completion this core does not finish itself (failures, chains, large and
    control messages, Write-with-immediate notifications, held completions)."""

    cdef object loop
    #: the connection accepts operations (not failed, closing or closed)
    cdef public bint usable
    #: completions are held back (a remote error waits for the peer's reason): all go slow
    cdef public bint hold
    cdef OperationTracker ops
    cdef SendQueue sq
    cdef object window_obj
    cdef MessageWindow window
    cdef object on_completion
    cdef object qp
    #: the dispatcher's expect() (work completed: traffic is coming)
    cdef public object expect_py
    #: open the device's expect window from C after a post (set by the dispatcher
    #: when that is all its expect() does)
    cdef public bint expect_in_c
    # the provider's C verbs (None/NULL: post through the Python QP, poll through the dispatcher)
    cdef cverbs_ops *cv
    cdef object cv_qp_obj
    cdef object cv_capsule
    cdef object cv_cq_obj
    cdef void *cv_qp
    cdef void *cv_cq
    # the send side (bind_outbox)
    cdef object outbox
    cdef object pool
    cdef list pool_free
    cdef object pool_waiters
    cdef BufferTable pool_table
    # the atomics' 8-byte result buffers (bind_scratch)
    cdef BufferPool scratch
    cdef uint64_t scratch_addr
    cdef uint32_t scratch_lkey
    # the receive side (bind_inbound)
    cdef object inbound
    cdef Inbox messages
    cdef object control
    cdef BufferTable recv_table
    # the shared receive queue the buffers go back to (C verbs), and its pool (None: the QP's own)
    cdef void *cv_srq
    cdef object cv_srq_obj
    cdef object recv_shared
    # draining
    cdef bint draining
    cdef bint closed
    #: completions polled but not delivered (allocated the first time one is needed:
    #: a SystemExit out of a resumed task is rare, and an idle connection stays small)
    cdef cverbs_wc *backlog
    cdef int nbacklog
    #: (a provider without C verbs) its CQ, and completions polled but not delivered
    cdef object cq_obj
    cdef object py_backlog
    #: completions this core finished itself / handed to on_completion (for tests and stats)
    cdef public unsigned long long fast_completions
    cdef public unsigned long long slow_completions

    def __init__(self, loop, OperationTracker ops, SendQueue sq, window, qp, cq, on_completion, expect):
        self.loop = loop
        self.ops = ops
        self.sq = sq
        self.window_obj = window
        self.window = window if isinstance(window, MessageWindow) else None
        self.qp = qp
        self.on_completion = on_completion
        self.expect_py = expect
        self.usable = True
        self.cq_obj = cq
        self._bind_verbs(qp, cq)

    cdef int _bind_verbs(self, qp, cq) except -1:
        cdef cverbs_ops *ops_qp
        cdef cverbs_ops *ops_cq
        qv = _c_verbs_of(qp)
        cv = _c_verbs_of(cq)
        if qv is None or cv is None or qv[0] is not cv[0]:
            return 0
        ops_qp = <cverbs_ops *>PyCapsule_GetPointer(qv[0], CVERBS_CAPSULE)
        if ops_qp == NULL or ops_qp.version != CVERBS_VERSION:
            return 0
        self.cv = ops_qp
        self.cv_capsule = qv[0]
        self.cv_qp_obj = qv[1]
        self.cv_cq_obj = cv[1]
        self.cv_qp = <void *>qv[1]
        self.cv_cq = <void *>cv[1]
        return 0

    @property
    def posts_in_c(self):
        """Whether work requests are posted and completions polled through the provider's C verbs."""
        return self.cv != NULL

    @property
    def can_drain(self):
        """Whether :meth:`drain` polls the CQ itself (the dispatcher hands its event-mode
        wake-ups here): through the provider's C verbs where it has them, else through
        the CQ's Python methods."""
        return self.window is not None

    def __dealloc__(self):
        free(self.backlog)
        self.backlog = NULL

    def bind_outbox(self, outbox):
        """The send side is connected (``Outbox.start`` registered the send buffers)."""
        pool = outbox.pool
        if not isinstance(pool.table, BufferTable):
            return  # (an interpreted table: messages take the general path)
        self.outbox = outbox
        self.pool = pool
        self.pool_free = pool.free
        self.pool_waiters = pool.waiters
        self.pool_table = pool.table if isinstance(pool.table, BufferTable) else None
        if self.pool_table is None:  # (an interpreted table: the general path sends)
            self.pool_free = None
        self.ops._release_slot = pool.release

    def bind_scratch(self, pool):
        """The atomics' result buffers (8-byte slots of a registered BufferPool)."""
        if not isinstance(pool, BufferPool):
            return  # (an interpreted pool: atomics take the general path)
        self.scratch = pool
        self.scratch_addr = pool.region.addr
        self.scratch_lkey = pool.region.lkey
        self.ops._release_scratch = pool.release
        self.ops._scratch_addr = self.scratch_addr

    def bind_inbound(self, inbound):
        """The receive side: its buffers (posted), its message queue, its control path."""
        self.inbound = inbound
        self.messages = inbound.messages if isinstance(inbound.messages, Inbox) else None
        table = inbound.table
        self.recv_table = table if isinstance(table, BufferTable) else None
        self.recv_shared = inbound.shared
        if inbound.srq is not None:
            v = _c_verbs_of(inbound.srq)
            if v is not None and self.cv != NULL and v[0] is self.cv_capsule and self.cv.post_srq_recv != NULL:
                self.cv_srq_obj = v[1]
                self.cv_srq = <void *>v[1]
            else:  # (no C verbs for the SRQ: its receives take the general path)
                self.recv_table = None

    def close(self):
        """The connection is torn down: nothing more is drained, its collaborators let go."""
        self.closed = True
        self.usable = False
        self.on_completion = None
        self.outbox = None
        self.pool = None
        self.pool_free = None
        self.pool_waiters = None
        self.inbound = None
        self.messages = None
        self.recv_table = None
        self.recv_shared = None
        self.cv_srq = NULL
        self.cv_srq_obj = None
        self.pool_table = None
        self.scratch = None
        self.ops._release_slot = None
        self.ops._release_scratch = None
        self.cv = NULL
        self.cv_qp = NULL
        self.cv_cq = NULL
        self.cv_qp_obj = None
        self.cv_cq_obj = None
        self.cv_capsule = None
        self.nbacklog = 0
        self.cq_obj = None
        self.py_backlog = None

    # -------------------------------------------------------- posting ----
    cdef inline int _expect(self) except -1:
        if self.expect_in_c and self.cv != NULL and self.cv.expect != NULL:
            self.cv.expect(self.cv_cq)
        else:
            self.expect_py()
        return 0

    cdef int _post_one(self, int i, cverbs_send_wr *wr) except -1:
        """Post entry ``i``'s request; on failure the entry, its send-queue slot and
        its buffer are given back and the error raised (as OperationTracker.post)."""
        wr.wr_id = self.ops.t[i].wr_id
        try:
            if self.cv != NULL:
                self.cv.post_send(self.cv_qp, wr, 1)
            else:
                self.qp.post_send(_send_wr_object(wr))
        except BaseException:
            release = self.ops._releaser(i)
            self.ops._free(i)
            self.sq._give_back(1)
            if release is not None:
                release()
            raise
        self._expect()
        return 0

    def one_sided(self, int opcode, mem, remote, bint awaited):
        """An RDMA Write from, or Read into, registered memory ``mem``, posted before
        any suspension when a send-queue slot is free and nobody queues for one.
        Returns its future (an :class:`OpFuture` when ``awaited``: the caller awaits
        it; else an asyncio future whose result is the work completion), or None
        when the general path must run."""
        cdef uint64_t addr, raddr
        cdef uint64_t n, rlen
        cdef uint32_t lkey, rkey
        cdef cverbs_send_wr wr
        cdef int i
        mem_type = type(mem)
        if not ((mem_type is _RegionSlice or mem_type is _Region) and self.usable and self.sq.free > 0
                and not self.sq.waiters):
            return None
        rlen = remote.length
        if mem_type is _Region:
            mr = (<object>mem).mr
            addr = mr.addr
            n = mr.length
        else:
            mr = mem.region.mr
            addr = mr.addr + <uint64_t>mem.offset
            n = mem.length
        lkey = mr.lkey
        if opcode == WR_RDMA_READ:
            if n < rlen:
                raise ValueError(f"read of {rlen} bytes does not fit the {n}-byte destination")
            n = rlen
        elif n > rlen:
            raise ValueError(f"write of {n} bytes does not fit the remote buffer of {rlen} bytes")
        raddr = remote.addr
        rkey = remote.rkey
        self.sq.free -= 1
        fut = OpFuture(self.loop) if awaited else self.loop.create_future()
        i = self.ops._add_fast(fut, remote, <uint32_t>n, opcode, _OP_OTHER, -1, not awaited)
        wr.opcode = opcode
        wr.send_flags = SEND_SIGNALED
        wr.has_imm = 0
        wr.imm_data = 0
        wr.remote_addr = raddr
        wr.rkey = rkey
        wr.compare_add = 0
        wr.swap = 0
        if n:
            wr.num_sge = 1
            wr.sg_list[0].addr = addr
            wr.sg_list[0].length = <uint32_t>n
            wr.sg_list[0].lkey = lkey
        else:
            wr.num_sge = 0
        self._post_one(i, &wr)
        return fut

    def send_small(self, data, bint wait_ack):
        """A message that fits one chunk, posted at once when a credit, a send
        buffer and a send-queue slot are free and no message queues before it.
        ``data``: bytes, any contiguous buffer, or registered memory. Returns False
        when the general path must run; else the future of its acknowledgement
        (``wait_ack``) or True."""
        cdef Py_buffer view
        cdef const char *src
        cdef Py_ssize_t n
        cdef int slot, i
        cdef MessageWindow w = self.window
        cdef cverbs_send_wr wr
        cdef uint64_t dst
        if w is None or not self.usable or self.pool_free is None:
            return False
        outbox = self.outbox
        if not (w.credits >= 2 and self.sq.free > 0 and not outbox.busy and not self.sq.waiters
                and outbox.tail is None and PyList_GET_SIZE(self.pool_free) and not self.pool_waiters):
            return False
        data_type = type(data)
        if data_type is _Region or data_type is _RegionSlice:
            data = data.view
        elif data_type is not bytes and data_type is not memoryview and data_type is not bytearray:
            return False  # (anything else: the general path says what it takes)
        if type(data) is bytes:
            n = PyBytes_GET_SIZE(data)
            if n > w.chunk_size:
                return False
            src = PyBytes_AS_STRING(data)
            slot = self.pool_free.pop()
            dst = self.pool_table._addrs[slot]
            if n:
                memcpy(<void *>dst, src, n)
        else:
            if PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0:  # (not contiguous: the general path)
                return False
            try:
                n = view.len
                if n > w.chunk_size:
                    return False
                slot = self.pool_free.pop()
                dst = self.pool_table._addrs[slot]
                if n:
                    memcpy(<void *>dst, view.buf, n)
            finally:
                PyBuffer_Release(&view)
        # fast path: one chunk and everything it needs is free now, so it is posted before
        # the caller yields (atomic w.r.t. other messages); the completion releases the slot
        w.credits -= 1
        self.sq.free -= 1
        fut = OpFuture(self.loop) if wait_ack else None
        i = self.ops._add_fast(fut, None, <uint32_t>n, WR_SEND_WITH_IMM, _OP_MESSAGE, slot, False)
        wr.opcode = WR_SEND_WITH_IMM
        wr.send_flags = SEND_SIGNALED
        wr.has_imm = 1
        wr.imm_data = _IMM_LAST | w._take_owed()
        wr.remote_addr = 0
        wr.rkey = 0
        wr.compare_add = 0
        wr.swap = 0
        if n:
            wr.num_sge = 1
            wr.sg_list[0].addr = dst
            wr.sg_list[0].length = <uint32_t>n
            wr.sg_list[0].lkey = self.pool_table._lkeys[slot]
        else:
            wr.num_sge = 0
        self._post_one(i, &wr)
        return fut if fut is not None else True

    def atomic(self, int opcode, remote, compare_add, swap):
        """An atomic (``IBV_WR_ATOMIC_CMP_AND_SWP`` or ``_FETCH_AND_ADD``) on the peer's
        8-byte word at ``remote``, posted at once when a send-queue slot and a result
        buffer are free and both operands are ints that fit 64 bits (negatives as
        two's complement). Returns an :class:`OpFuture` of the word's original value,
        or None (the general path, which also says what is wrong with an operand)."""
        cdef cverbs_send_wr wr
        cdef int slot, i
        cdef uint64_t raddr, word_compare_add, word_swap
        cdef BufferPool scratch = self.scratch
        if not (self.usable and self.sq.free > 0 and not self.sq.waiters and scratch is not None
                and scratch.nfree and not scratch.waiters):
            return None
        if not (_atomic_word(compare_add, &word_compare_add) and _atomic_word(swap, &word_swap)):
            return None
        if remote.length < 8:
            name = "ATOMIC_CMP_AND_SWP" if opcode == WR_ATOMIC_CMP_AND_SWP else "ATOMIC_FETCH_AND_ADD"
            raise ValueError(f"{name} needs an 8-byte remote buffer, got {remote.length}")
        raddr = remote.addr
        if raddr & 7:
            _log.debug("atomic at unaligned address 0x%x: the peer will refuse it", raddr)
        slot = scratch._pop()
        self.sq.free -= 1
        fut = OpFuture(self.loop)
        i = self.ops._add_fast(fut, remote, 8, opcode, _OP_OTHER, slot, False)
        self.ops.t[i].pool = POOL_SCRATCH
        wr.opcode = opcode
        wr.send_flags = SEND_SIGNALED
        wr.has_imm = 0
        wr.imm_data = 0
        wr.remote_addr = raddr
        wr.rkey = remote.rkey
        wr.compare_add = word_compare_add
        wr.swap = word_swap
        wr.num_sge = 1
        wr.sg_list[0].addr = self.scratch_addr + <uint64_t>slot * 8
        wr.sg_list[0].length = 8
        wr.sg_list[0].lkey = self.scratch_lkey
        self._post_one(i, &wr)
        return fut

    def batch(self, int opcode, pairs):
        """RDMA Writes (``(local, remote)`` pairs) or Reads (``(remote, into)``) between
        registered memory and the peer's, linked and posted with one doorbell, only
        the last signaled, when that many send-queue slots are free now. Returns an
        :class:`OpFuture` that completes with the last one, or None (the general path:
        a plain buffer, slots to wait for)."""
        cdef Py_ssize_t k = len(pairs)
        cdef Py_ssize_t j
        cdef cverbs_send_wr local_wrs[16]
        cdef cverbs_send_wr *wrs = local_wrs
        cdef uint64_t addr, n, rlen, total = 0
        cdef int i
        cdef uint64_t posted_ns
        cdef bint is_read = opcode == WR_RDMA_READ
        if k == 0 or not (self.usable and self.sq.free >= k and not self.sq.waiters):
            return None
        for pair in pairs:
            mem = pair[1] if is_read else pair[0]
            if not (type(mem) is _Region or type(mem) is _RegionSlice):
                return None
        if k > 16:
            wrs = <cverbs_send_wr *>malloc(k * sizeof(cverbs_send_wr))
            if wrs == NULL:
                raise MemoryError()
        try:
            for j in range(k):
                if is_read:
                    remote, mem = pairs[j]
                else:
                    mem, remote = pairs[j]
                rlen = remote.length
                if type(mem) is _Region:
                    mr = (<object>mem).mr
                    addr = mr.addr
                    n = mr.length
                else:
                    mr = mem.region.mr
                    addr = mr.addr + <uint64_t>mem.offset
                    n = mem.length
                if is_read:
                    if n < rlen:
                        raise ValueError(f"read of {rlen} bytes does not fit the {n}-byte destination")
                    n = rlen
                elif n > rlen:
                    raise ValueError(
                        f"write {j} of the batch: {n} bytes do not fit the remote buffer of {rlen} bytes"
                    )
                total += n
                wrs[j].opcode = opcode
                wrs[j].send_flags = SEND_SIGNALED if j == k - 1 else 0
                wrs[j].has_imm = 0
                wrs[j].imm_data = 0
                wrs[j].remote_addr = remote.addr
                wrs[j].rkey = remote.rkey
                wrs[j].compare_add = 0
                wrs[j].swap = 0
                if n:
                    wrs[j].num_sge = 1
                    wrs[j].sg_list[0].addr = addr
                    wrs[j].sg_list[0].length = <uint32_t>n
                    wrs[j].sg_list[0].lkey = mr.lkey
                else:
                    wrs[j].num_sge = 0
            fut = OpFuture(self.loop)
            name = "RDMA_READ" if is_read else "RDMA_WRITE"
            op = _Op(fut, None, f"batch of {k} {name}s ({total} bytes)", _WROPCODE[opcode])
            members = set()
            posted_ns = _m_stamp()
            for j in range(k):
                i = self.ops._alloc()
                Py_INCREF(op)
                self.ops.t[i].op = <PyObject *>op
                self.ops.t[i].metric = _m_kind(opcode, _OP_OTHER)
                self.ops.t[i].nbytes = wrs[j].sg_list[0].length if wrs[j].num_sge else 0
                self.ops.t[i].posted_ns = posted_ns
                wrs[j].wr_id = self.ops.t[i].wr_id
                members.add(wrs[j].wr_id)
            op.members = members
            self.sq.free -= k
            try:
                if self.cv != NULL:
                    self.cv.post_send(self.cv_qp, wrs, <int>k)
                else:
                    self.qp.post_send([_send_wr_object(&wrs[j]) for j in range(k)])
            except BaseException:
                for j in range(k):
                    i = self.ops._find(wrs[j].wr_id)
                    if i >= 0:
                        self.ops._free(i)
                self.sq._give_back(<int>k)
                raise
            self._expect()
            return fut
        finally:
            if wrs != local_wrs:
                free(wrs)

    cdef bint _post_rdma_table(self, int opcode, uint32_t rkey, uint32_t lkey, cverbs_send_wr *wrs, Py_ssize_t k) except -1:
        """A provider without the C verbs (pyverbs) that can post a chain of RDMA Reads or
        Writes from a flat table (``post_rdma_table``: wr_id, remote address, local
        address, length each) gets one, and no SendWR per request: True if it posted."""
        post = getattr(self.qp, "post_rdma_table", None)
        if post is None:
            return False
        fields = PyBytes_FromStringAndSize(NULL, k * 32)
        cdef uint64_t *f = <uint64_t *>PyBytes_AS_STRING(fields)
        cdef Py_ssize_t j
        for j in range(k):
            f[4 * j] = wrs[j].wr_id
            f[4 * j + 1] = wrs[j].remote_addr
            f[4 * j + 2] = wrs[j].sg_list[0].addr
            f[4 * j + 3] = wrs[j].sg_list[0].length
        return bool(post(opcode, rkey, lkey, memoryview(fields).cast("Q")))

    def post_descriptors(self, int opcode, const uint64_t[::1] table, order, Py_ssize_t start, Py_ssize_t k,
                         uint32_t lkey, uint32_t rkey, fut, describe):
        """Post the descriptors at positions ``start .. start + k - 1`` of a prepared
        transfer (``table``: local address, remote address, length per descriptor;
        ``order``: the positions' descriptor indices, 32-bit, or None for the list's
        own order) as one chain with one doorbell, only the last signaled; ``fut``
        gets the chain's outcome. ``k`` send-queue slots must be held (given back if
        the device refuses the chain). Returns the chain's wr_ids (a memoryview of
        ``k`` unsigned 64-bit integers): no Python object per descriptor."""
        cdef const uint32_t[::1] idx
        cdef bint ordered = order is not None
        cdef Py_ssize_t j, d
        cdef int i
        cdef uint64_t posted_ns
        cdef uint8_t metric
        cdef cverbs_send_wr *wrs
        cdef uint64_t *ids
        if k <= 0:
            raise ValueError("a chain of no work requests")
        if ordered:
            idx = order
            if start + k > idx.shape[0]:
                raise IndexError("positions past the end of the order")
        elif (start + k) * 3 > table.shape[0]:
            raise IndexError("positions past the end of the list")
        wrs = <cverbs_send_wr *>malloc(k * sizeof(cverbs_send_wr))
        if wrs == NULL:
            raise MemoryError()
        try:
            wr_ids = PyBytes_FromStringAndSize(NULL, k * 8)
            ids = <uint64_t *>PyBytes_AS_STRING(wr_ids)
            op = _Op(fut, None, describe, _WROPCODE[opcode])
            members = set()
            metric = _m_kind(opcode, _OP_OTHER)
            posted_ns = _m_stamp()
            for j in range(k):
                d = idx[start + j] if ordered else start + j
                if d * 3 + 2 >= table.shape[0]:
                    raise IndexError(f"descriptor {d} is not in the list")
                wrs[j].opcode = opcode
                wrs[j].send_flags = SEND_SIGNALED if j == k - 1 else 0
                wrs[j].has_imm = 0
                wrs[j].imm_data = 0
                wrs[j].remote_addr = table[d * 3 + 1]
                wrs[j].rkey = rkey
                wrs[j].compare_add = 0
                wrs[j].swap = 0
                wrs[j].num_sge = 1
                wrs[j].sg_list[0].addr = table[d * 3]
                wrs[j].sg_list[0].length = <uint32_t>table[d * 3 + 2]
                wrs[j].sg_list[0].lkey = lkey
            for j in range(k):
                i = self.ops._alloc()
                Py_INCREF(op)
                self.ops.t[i].op = <PyObject *>op
                self.ops.t[i].metric = metric
                self.ops.t[i].nbytes = wrs[j].sg_list[0].length
                self.ops.t[i].posted_ns = posted_ns
                wrs[j].wr_id = self.ops.t[i].wr_id
                ids[j] = wrs[j].wr_id
                members.add(wrs[j].wr_id)
            op.members = members
            try:
                if self.cv != NULL:
                    self.cv.post_send(self.cv_qp, wrs, <int>k)
                elif not self._post_rdma_table(opcode, rkey, lkey, wrs, k):
                    self.qp.post_send([_send_wr_object(&wrs[j]) for j in range(k)])
            except BaseException:
                for j in range(k):
                    i = self.ops._find(wrs[j].wr_id)
                    if i >= 0:
                        self.ops._free(i)
                self.sq._give_back(<int>k)
                raise
            self._expect()
            return memoryview(wr_ids).cast("Q")
        finally:
            free(wrs)

    # -------------------------------------------------------- receiving ----
    def recv_message(self):
        """The next message when it is a plain message queued now: its bytes, taken
        off the queue and consumed from the window (credits due go back). None when
        nothing is queued or the next item needs the general path (a message in
        parts, a large message, the connection's end)."""
        cdef Inbox box = self.messages
        cdef MessageWindow w = self.window
        if box is None or w is None:
            return None
        items = box.items
        if not items:
            return None
        item = items[0]
        if type(item) is not bytes:
            return None
        items.popleft()
        w._consumed(PyBytes_GET_SIZE(item))
        if w.owed >= w.threshold and self.outbox is not None:
            self.outbox.return_credits()
        return item

    def recv_waiter(self):
        """An :class:`OpFuture` queued for the next message (resolved, with the message
        left queued, when one comes): what ``recv()`` awaits when nothing is queued.
        None where the general path must wait instead."""
        cdef Inbox box = self.messages
        if box is None or box.items or not self.usable:
            return None
        waiter = OpFuture(self.loop)
        box.waiters.append(waiter)
        return waiter

    def recv_cancelled(self, OpFuture waiter):
        """The caller awaiting ``waiter`` was cancelled: it leaves the queue, and a
        wake-up it had been handed goes to the next waiter (nothing is lost)."""
        cdef Inbox box = self.messages
        waiter.cancel()
        if box is None:
            return
        try:
            box.waiters.remove(waiter)
        except ValueError:  # put() had already taken it off
            pass
        if box.items and not waiter.cancelled():
            box._wake_next(False)

    # ----------------------------------------------------- completions ----
    def drain(self):
        """Poll the CQ until empty, re-arm, poll again (the drain-after-arm rule),
        finishing what this core can and handing the rest to ``on_completion``.
        Returns how many completions were handled. Not re-entered (see
        ``CompletionDispatcher._drain``)."""
        cdef cverbs_wc wcs[64]
        cdef int n, k, i
        cdef long delivered = 0
        if self.draining or self.closed:
            return 0
        self.draining = True
        try:
            if self.cv == NULL:
                delivered = self._drain_py()
                return delivered
            if self.nbacklog:
                delivered += self._deliver(self.backlog, self.nbacklog, True)
                if self.closed:
                    return delivered
            n = self.cv.poll_cq(self.cv_cq, wcs, 64)
            while True:
                if n:
                    delivered += self._deliver(wcs, n, False)
                    if self.closed:  # a handler tore the connection down: the CQ is gone
                        break
                    if n == 64:  # maybe more: poll before arming
                        n = self.cv.poll_cq(self.cv_cq, wcs, 64)
                        continue
                self.cv.req_notify_cq(self.cv_cq)
                n = self.cv.poll_cq(self.cv_cq, wcs, 64)
                if n == 0:
                    break
        finally:
            self.draining = False
        if delivered and not self.closed:
            # completions came: the device should expect traffic (a reply, the next request)
            if self.expect_in_c and self.cv != NULL and self.cv.expect != NULL:
                self.cv.expect(self.cv_cq)
            elif self.expect_py is not None:
                self.expect_py()
        return delivered

    cdef long _drain_py(self) except -1:
        """drain() for a provider without C verbs: the CQ polled through its Python
        methods (WorkCompletion objects), the success half of send-queue completions
        finished here (completed()), the rest handed to ``on_completion``."""
        cdef long delivered = 0
        cdef Py_ssize_t n, idx
        cq = self.cq_obj
        poll = cq.poll
        if self.py_backlog:
            wcs, self.py_backlog = self.py_backlog, None
        else:
            wcs = poll(64)
        while True:
            if wcs:
                n = len(wcs)
                delivered += n
                for idx in range(n):
                    wc = wcs[idx]
                    try:
                        if self.hold or not self.completed(wc):
                            self.slow_completions += 1
                            cb = self.on_completion
                            if cb is not None:
                                try:
                                    cb(wc)
                                except Exception:
                                    _log.exception("completion handler failed for %r", wc)
                    except BaseException:
                        # (as in _deliver: the rest is delivered by the next turn of the loop)
                        rest = wcs[idx + 1 :]
                        if rest and not self.closed:
                            self.py_backlog = list(rest)
                            self.loop.call_soon(self.drain)
                        raise
                    if self.closed:
                        return delivered
                if n == 64:  # maybe more: poll before arming
                    wcs = poll(64)
                    continue
            cq.req_notify()
            wcs = poll(64)
            if not wcs:
                break
        return delivered

    cdef long _deliver(self, cverbs_wc *wcs, int n, bint from_backlog) except -1:
        """Handle ``wcs`` in CQ order. A BaseException escaping a handler (a task
        resumed here raised KeyboardInterrupt) leaves the rest in the backlog for
        the next drain, then propagates."""
        cdef int i = 0
        cdef int rest
        try:
            while i < n:
                if self.closed:
                    break
                self._one(&wcs[i])
                i += 1
        except BaseException:
            i += 1
            rest = n - i
            if rest > BACKLOG:  # (poll_cq returns at most 64)
                rest = BACKLOG
            if rest > 0 and self.backlog == NULL:
                self.backlog = <cverbs_wc *>malloc(BACKLOG * sizeof(cverbs_wc))
                if self.backlog == NULL:  # (then they are lost, as the dispatcher would lose them)
                    rest = 0
            if rest > 0:
                # (memmove: a backlog delivered from itself moves its own tail to the front)
                memmove(self.backlog, &wcs[i], rest * sizeof(cverbs_wc))
            self.nbacklog = rest
            if self.nbacklog and not self.closed:
                # no event may come for them: the next turn of the loop delivers them
                self.loop.call_soon(self.drain)
            raise
        if from_backlog:
            self.nbacklog = 0
        return n

    cdef int _one(self, cverbs_wc *w) except -1:
        cdef uint64_t wr_id = w.wr_id
        if self.hold:
            return self._slow(w)
        if wr_id & RECV_TAG:
            if w.status == WC_SUCCESS and w.opcode == WC_RECV and self.messages is not None:
                return self._recv(w, <uint32_t>(wr_id ^ RECV_TAG))
            return self._slow(w)
        return self._sent(w)

    cdef int _slow(self, cverbs_wc *w) except -1:
        self.slow_completions += 1
        cb = self.on_completion
        if cb is None:
            return 0
        try:
            cb(_make_wc(w))
        except Exception:
            _log.exception("completion handler failed for wr_id %d", w.wr_id)
        return 0

    def completed(self, wc):
        """The success half of a send-queue completion that came another way (through
        the completion dispatcher: a provider without C verbs): True when it was
        finished here (its future resolved, its slot and buffer freed); False when the
        connection's completion handler must take it (a failure, a receive, an
        unknown wr_id)."""
        cdef cverbs_wc w
        cdef int i
        cdef uint64_t wr_id = wc.wr_id
        if self.closed or self.hold or wr_id & RECV_TAG or wc.status != WC_SUCCESS:
            return False
        i = self.ops._find(wr_id)
        if i < 0:
            return False
        w.wr_id = wr_id
        w.status = WC_SUCCESS
        w.opcode = wc.opcode
        w.byte_len = wc.byte_len
        w.qp_num = wc.qp_num
        w.src_qp = wc.src_qp
        imm = wc.imm_data
        w.has_imm = imm is not None
        w.imm_data = imm if imm is not None else 0
        w.vendor_err = wc.vendor_err
        self._sent_ok(i, &w)
        return True

    cdef int _sent(self, cverbs_wc *w) except -1:
        """A send-queue completion: the success half, here; anything else, slow."""
        cdef int i = self.ops._find(w.wr_id)
        if i < 0:
            return 0  # (complete() ignores an unknown wr_id too)
        if w.status != WC_SUCCESS:
            return self._slow(w)
        return self._sent_ok(i, w)

    cdef int _sent_ok(self, int i, cverbs_wc *w) except -1:
        """Entry ``i``'s work request completed successfully."""
        cdef OperationTracker ops = self.ops
        cdef Entry *e = &ops.t[i]
        cdef PyObject *opp = e.op
        cdef int slot, kind, j
        cdef uint8_t pool
        cdef bint wants_wc
        cdef uint64_t m
        cdef uint8_t metric = e.metric
        cdef uint64_t posted_ns = e.posted_ns
        self.fast_completions += 1
        # retire it first: its send-queue slot is free, its future and op are ours now
        ops._m_retired(i)
        slot = e.slot
        pool = e.pool
        wants_wc = e.wants_wc
        result = None
        if opp != NULL:
            op = <object>opp
            fut = op.fut
            release = op.release
            kind = op.kind
            members = op.members
            if members is not None:
                # the signaled last of a chain: every request before it is done too
                (<set>members).discard(w.wr_id)
                for m in members:
                    j = ops._find(m)
                    if j >= 0:
                        ops._m_retired(j)
                        ops._free(j)
                        self.sq.free += 1
                (<set>members).clear()
        else:
            fut = <object>e.fut if e.fut != NULL else None
            release = None
            kind = e.kind
            if pool == POOL_SCRATCH and slot >= 0:
                # an atomic's original value, as the NIC wrote it into the scratch word (little-endian)
                result = _le64(self.scratch_addr + <uint64_t>slot * 8)
        ops._free(i)
        if metric:
            _m_done(metric, posted_ns)
        self.sq.free += 1
        if self.sq.waiters:
            self.sq._hand_over()
        if kind == _OP_MESSAGE and self.outbox is not None and self.outbox.drain_waiters:
            self.outbox.wake_drain_waiters()
        if slot >= 0 and pool == POOL_SEND:
            if self.pool_free is not None:
                if self.pool_waiters or slot >= self.pool_table.active:
                    self.pool.release(slot)
                else:
                    PyList_Append(self.pool_free, slot)
        elif slot >= 0 and pool == POOL_SCRATCH:
            if self.scratch is not None:
                if self.scratch.waiters:
                    self.scratch.release(slot)
                else:
                    self.scratch._push(slot)
        elif release is not None:
            try:
                release()
            except Exception:  # pragma: no cover
                _log.exception("releasing a buffer failed")
        if fut is not None:
            if type(fut) is OpFuture:
                if (<OpFuture>fut)._state == PENDING:
                    if pool == POOL_SCRATCH:
                        (<OpFuture>fut)._resolve(result)
                    elif opp == NULL and not wants_wc:
                        (<OpFuture>fut)._resolve(None)
                    else:
                        (<OpFuture>fut)._resolve(_make_wc(w))
            elif not fut.done():
                fut.set_result(_make_wc(w))
        w_ = self.window
        if w_ is not None and w_.owed >= w_.threshold and self.outbox is not None:
            # credits that came due while a credit update was in flight are returned now
            self.outbox.return_credits()
        return 0

    cdef int _recv(self, cverbs_wc *w, uint32_t slot) except -1:
        """A message chunk arrived in receive buffer ``slot`` (Inbound.on_recv's data path):
        the connection's own buffer, or the device's when the QP takes its receives from
        a shared receive queue (the table is the device's then, and the buffer goes back
        to the SRQ whatever becomes of this connection)."""
        cdef MessageWindow win = self.window
        cdef BufferTable table = self.recv_table
        cdef uint32_t nbytes = w.byte_len
        cdef uint32_t imm = w.imm_data if w.has_imm else 0
        cdef uint64_t addr
        cdef cverbs_sge sge
        cdef long long before
        inbound = self.inbound
        if win is None or inbound is None or table is None or slot >= <uint32_t>table.n:
            return self._slow(w)
        self.fast_completions += 1
        addr = table._addrs[slot]
        data = PyBytes_FromStringAndSize(<const char *>addr, nbytes) if nbytes else b""
        # repost the buffer at once (the bytes are copied out)
        sge.addr = addr
        sge.length = <uint32_t>table.size
        sge.lkey = table._lkeys[slot]
        if self.cv_srq != NULL:
            if not self.recv_shared.closed:
                try:
                    self.cv.post_srq_recv(self.cv_srq, w.wr_id, &sge, 1)
                except _RDMAError as e:
                    self.recv_shared.lost()
                    _log.debug("repost to the shared receive queue failed: %s", e)
        elif not inbound.closed and inbound.error is None:
            try:
                self.cv.post_recv(self.cv_qp, w.wr_id, &sge, 1)
            except _RDMAError as e:
                _log.debug("repost failed: %s", e)
        before = win.credits
        kind, item = win._on_chunk(imm, data)
        outbox = self.outbox
        if win.credits != before and outbox is not None and outbox.credit_waiters:
            outbox.wake_credit_waiters()
        if kind == _K_LAST:
            _m_ops[M_RECEIVE] += 1
            _m_wrs[M_RECEIVE] += 1
            _m_bytes[M_RECEIVE] += nbytes
            self.messages._put_now(item)
        elif kind == _K_CONTROL:
            inbound.deliver_control(item)
        elif kind == _K_MORE:
            _m_wrs[M_RECEIVE] += 1
            _m_bytes[M_RECEIVE] += nbytes
        if win.owed >= win.threshold and outbox is not None:
            outbox.return_credits()
        return 0


cdef inline object _le64(uint64_t addr):
    """The little-endian 64-bit word at ``addr``."""
    cdef const uint8_t *p = <const uint8_t *>addr
    cdef uint64_t v = 0
    cdef int b
    for b in range(7, -1, -1):
        v = (v << 8) | p[b]
    return v


cdef object _c_verbs_of(obj):
    """``obj.c_verbs()``: (capsule, handle) when the provider drives ``obj`` from C."""
    get = getattr(obj, "c_verbs", None)
    if get is None:
        return None
    v = get()
    if v is None:
        return None
    capsule, handle = v
    if not PyCapsule_IsValid(capsule, CVERBS_CAPSULE):
        return None
    return v


cdef object _send_wr_object(const cverbs_send_wr *w):
    """The SendWR of ``w``, for a QP posted through its Python method (no C verbs)."""
    sges = [_SGE(w.sg_list[i].addr, w.sg_list[i].length, w.sg_list[i].lkey) for i in range(w.num_sge)]
    return _SendWR(w.wr_id, _WROPCODE.get(w.opcode, w.opcode), sges, _SendFlags(w.send_flags),
                   w.imm_data if w.has_imm else None, w.remote_addr, w.rkey, w.compare_add, w.swap)


# --------------------------------------------------- descriptor lists ----
# (the rules and the interpreted reference: aiordma.descriptors; errors through its problem())

cdef struct _DestRange:
    uint64_t start
    uint64_t length
    Py_ssize_t index


cdef int _by_start(const void *a, const void *b) noexcept nogil:
    cdef const _DestRange *x = <const _DestRange *>a
    cdef const _DestRange *y = <const _DestRange *>b
    if x.start != y.start:
        return -1 if x.start < y.start else 1
    return -1 if x.index < y.index else (1 if x.index > y.index else 0)


def prepare_descriptors(const uint64_t[::1] table, uint64_t local_addr, uint64_t local_len, uint64_t remote_addr,
                        uint64_t remote_len, bint dest_is_local):
    """The compiled twin of :func:`aiordma.descriptors.prepare_reference`: the rules
    checked, ``(addresses, total bytes)`` made, in C."""
    cdef Py_ssize_t n = table.shape[0] // 3
    cdef Py_ssize_t i, j, holder = -1
    cdef uint64_t lo, ro, ln, total = 0, reach = 0, start
    cdef uint64_t *out
    cdef int column = 0 if dest_is_local else 1
    cdef bint is_sorted = True
    cdef _DestRange *ranges
    result = bytearray(24 * n)
    out = <uint64_t *>(<char *>result) if n else NULL
    for i in range(n):
        lo = table[3 * i]
        ro = table[3 * i + 1]
        ln = table[3 * i + 2]
        if ln == 0:
            raise _problem(_ZERO_LENGTH, i)
        if ln > _MAX_LENGTH:
            raise _problem(_TOO_LONG, i, 0, ln)
        if lo > local_len or ln > local_len - lo:
            raise _problem(_LOCAL_RANGE, i, lo, ln, local_len)
        if ro > remote_len or ln > remote_len - ro:
            raise _problem(_REMOTE_RANGE, i, ro, ln, remote_len)
        out[3 * i] = local_addr + lo
        out[3 * i + 1] = remote_addr + ro
        out[3 * i + 2] = ln
        total += ln
        if i and table[3 * i + column] < table[3 * (i - 1) + column]:
            is_sorted = False
    if is_sorted:
        for i in range(n):
            start = table[3 * i + column]
            if holder >= 0 and start < reach:
                raise _problem(_OVERLAP, max(i, holder), min(i, holder), dest_is_local=dest_is_local)
            if start + table[3 * i + 2] > reach:
                reach = start + table[3 * i + 2]
                holder = i
    else:
        ranges = <_DestRange *>malloc(n * sizeof(_DestRange))
        if ranges == NULL:
            raise MemoryError()
        try:
            for i in range(n):
                ranges[i].start = table[3 * i + column]
                ranges[i].length = table[3 * i + 2]
                ranges[i].index = i
            qsort(ranges, n, sizeof(_DestRange), _by_start)
            for j in range(n):
                i = ranges[j].index
                start = ranges[j].start
                if holder >= 0 and start < reach:
                    raise _problem(_OVERLAP, max(i, holder), min(i, holder), dest_is_local=dest_is_local)
                if start + ranges[j].length > reach:
                    reach = start + ranges[j].length
                    holder = i
        finally:
            free(ranges)
    return memoryview(result).cast("Q"), total


def prepare_indices(indices, Py_ssize_t n):
    """The compiled twin of :func:`aiordma.descriptors.indices_reference`."""
    cdef Py_ssize_t pos, count
    cdef int64_t v
    cdef uint32_t *out
    view = memoryview(indices)
    fmt = view.format.lstrip("<=@")
    if fmt not in ("q", "l", "Q", "L"):
        return _indices_reference(view, n)  # (narrower integers: rare, and checked all the same)
    cdef const int64_t[::1] values = view.cast("B").cast("q")
    count = values.shape[0]
    result = bytearray(4 * count)
    out = <uint32_t *>(<char *>result) if count else NULL
    for pos in range(count):
        v = values[pos]
        if v < 0 or v >= n:
            raise _index_problem(pos, v if fmt in ("q", "l") else <uint64_t>v, n)
        out[pos] = <uint32_t>v
    return memoryview(result).cast("I")
