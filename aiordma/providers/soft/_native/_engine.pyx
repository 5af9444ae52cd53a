# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, embedsignature=True
"""The native engine of the soft device: the Cython binding of the C core.

``wire.c`` (codec, ICRC, IP-ID solver), ``rc.c`` (the RC requester and
responder, a port of ``rc.py``), ``nic.c`` (the NIC thread, the UDP socket,
CQs and completion channels) and ``shm.c``/``nic_shm.c`` (shared-memory links
to soft devices of other processes of this host) do the work; this module gives Python the
engine protocol of :mod:`aiordma.providers.soft.engine` (:class:`NativeEngine`
and its PD / MR / CQ / channel / QP objects) and the codec functions the wire
tests compare with ``wire.py``.

Python sees verbs only: ``post_send`` takes the :class:`SendWR` objects of
``providers/base.py`` (read in C), ``poll`` returns real
:class:`WorkCompletion` objects (built in C, no ``__init__``). The engine lock
is only ever taken with the GIL released.

One extension module, several source files (``include``: Cython compiles them
as one module, so a call from one file to another costs what it did in one file):

* ``includes/*.pxd``: the C declarations, one file per header (``wire.pxd``,
  ``crc32.pxd``, ``rc.pxd``, ``nic.pxd``, ``glue.pxd`` for ``pyglue.h``,
  ``system.pxd`` for the POSIX socket and thread headers);
* ``common.pxi``: the cimports and Python imports, and the set-up that finds the
  slots of ``SendWR``/``RecvWR``/``SGE``/``WorkCompletion``;
* ``tables.pxi``: :func:`c_tables` and the CRC-32 functions;
* ``convert.pxi``: work requests, QP attributes, errors, flows and packets
  between Python and C;
* ``codec.pxi``: :func:`encode`, :func:`decode`, :func:`icrc_ok`, :func:`icrc_ip_id`;
* ``memory.pxi``: registered memory (the buffers a region holds);
* ``verbs.pxi``: :class:`NativeChannel`, :class:`NativeCQ`, :class:`NativeMR`,
  :class:`NativePD`, :class:`NativeQP`;
* ``cverbs.pxi``: the verbs as C calls over those QPs and CQs (``aiordma/cverbs.h``,
  exported as the capsule ``cverbs``), for the compiled core ``aiordma._core``;
* ``tracer.pxi``: the NIC thread's tracer hooks;
* ``engine.pxi``: :class:`NativeEngine`.

``common.pxi``, ``convert.pxi`` and ``memory.pxi`` are shared with the test-only
RC core (``tests/native/_testing.pyx``: ``RCCore`` and ``SansIOMemory``, rc.c
driven sans-IO for the differential tests), which is built only in place, in a
checkout, and never goes into a wheel.
"""

include "common.pxi"

# what only the engine uses (the test-only RC core has no NIC and no CRC table)
from cpython.pythread cimport PyThread_get_thread_ident
from aiordma.providers.soft._native.includes.crc32 cimport *
from aiordma.providers.soft._native.includes.nic cimport *
from aiordma.providers.soft._native.includes.system cimport *

import asyncio as _asyncio
import collections as _collections
import gc as _gc
import os as _os
import threading as _threading

from .... import settings as _settings
from ..faults import LinkFaults
from ..trace import TraceEvent

#: how long (µs) the loop polls shared-memory links after the last packet or post
cdef double DEFAULT_SHM_POLL_US = 100.0
#: the longest (s) one callback of the loop's poll waits in C for a link's packet (the
#: GIL is held meanwhile: another thread waits at most this long for it), and how often
#: it looks at the loop's selector for another event meanwhile
cdef double SHM_SPIN_MAX = 50e-6
cdef double SHM_SPIN_SELECTOR_EVERY = 5e-6


def _loop_internals(loop):
    """The loop's ready queue, timer heap and selector fd, which let the poll of the
    links wait in C while the loop has nothing else to do (NativeEngine._shm_wait):
    asyncio's, or uvloop's (its ready queue is a C attribute: found as the deque that
    holds a callback just scheduled; its timers are libuv's, unseen: the wait's own
    bound, SHM_SPIN_MAX, is far below a timer's millisecond resolution). ``(None, None,
    -1)`` on a loop that has none of them, or not from the loop's thread."""
    ready = getattr(loop, "_ready", None)
    timers = getattr(loop, "_scheduled", None)
    selector = getattr(loop, "_selector", None)
    if type(ready) is _collections.deque and type(timers) is list and selector is not None:
        try:
            return ready, timers, selector.fileno()
        except Exception:
            return None, None, -1
    backend_fd = getattr(loop, "_get_backend_id", None)
    if backend_fd is None or _asyncio._get_running_loop() is not loop:
        return None, None, -1
    marker = loop.call_soon(int)
    try:
        for obj in _gc.get_referents(loop):
            if type(obj) is _collections.deque and marker in obj:
                return obj, None, backend_fd()
    except Exception:
        pass
    finally:
        marker.cancel()
    return None, None, -1


cdef extern from "<sched.h>" nogil:
    int sched_yield()

include "tables.pxi"
include "convert.pxi"
include "codec.pxi"
include "memory.pxi"
include "verbs.pxi"
include "cverbs.pxi"
include "tracer.pxi"
include "engine.pxi"
