# Registered memory: a region holds its buffer's Py_buffer while a work request
# may still use it. Shared with the test-only RC core (tests/native/_testing.pyx).

# ------------------------------------------------------ registered memory ----

cdef struct mrbox:
    Py_buffer view
    int has_view
    PyObject *pyobj  # the NativeMR while it lives (borrowed), for the tracer


cdef mr *_make_mr(object buffer, int writable, uint64_t addr_override, int use_override, uint32_t access,
                  uint32_t lkey, uint32_t rkey) except NULL:
    cdef mrbox *box = <mrbox *>calloc(1, sizeof(mrbox))
    cdef mr *m = <mr *>calloc(1, sizeof(mr))
    if box == NULL or m == NULL:
        free(box)
        free(m)
        raise MemoryError()
    try:
        PyObject_GetBuffer(buffer, &box.view, PyBUF_WRITABLE if writable else PyBUF_SIMPLE)
    except BufferError as e:
        free(box)
        free(m)
        raise MemoryRegistrationError(
            f"cannot register a read-only {type(buffer).__name__} with write access: the device must be able to "
            "write into it (use bytearray, mmap or a writable array, or register it without IBV_ACCESS_LOCAL_WRITE, "
            "REMOTE_WRITE and REMOTE_ATOMIC as a send/read source)"
        ) from e
    except TypeError as e:
        free(box)
        free(m)
        raise MemoryRegistrationError(f"cannot register {type(buffer).__name__}: not a buffer") from e
    box.has_view = 1
    m.base = <uint8_t *>box.view.buf
    m.addr = addr_override if use_override else <uint64_t>box.view.buf
    m.length = box.view.len
    m.access = access
    m.lkey = lkey
    m.rkey = rkey
    m.owner = box
    return m


cdef void _free_mr(mr *m) noexcept:
    cdef mrbox *box = <mrbox *>m.owner
    if box != NULL:
        if box.has_view:
            PyBuffer_Release(&box.view)
        free(box)
    free(m)


cdef object _check_buffer(object buffer, bint writable, bint allow_empty=False):
    """The contiguous byte view registration needs, or MemoryRegistrationError."""
    try:
        mv = memoryview(buffer)
    except TypeError as e:
        raise MemoryRegistrationError(f"cannot register {type(buffer).__name__}: not a buffer") from e
    if mv.readonly and writable:
        raise MemoryRegistrationError(
            f"cannot register a read-only {type(buffer).__name__} with write access: the device must be able to "
            "write into it (use bytearray, mmap or a writable array, or register it without IBV_ACCESS_LOCAL_WRITE, "
            "REMOTE_WRITE and REMOTE_ATOMIC as a send/read source)"
        )
    if not mv.c_contiguous:
        raise MemoryRegistrationError("cannot register a non-contiguous buffer")
    mv = mv.cast("B")
    if mv.nbytes == 0 and not allow_empty:
        raise MemoryRegistrationError("cannot register an empty buffer")
    return mv


# =================================================================== sans-IO ====
