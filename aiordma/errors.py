"""Errors raised by aiordma.

Every error names the RDMA concept that failed (the verbs status, the key, the
queue pair state), so a user can search for it in the verbs documentation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .verbs import WCStatus, WorkCompletion


class RDMAError(Exception):
    """Base class of every aiordma error.

    ``may_have_executed`` is True on the error of a Write, SEND or atomic
    that the peer may have carried out although this side saw it fail: RDMA
    reports a request done only when its acknowledgement arrives, so a lost
    acknowledgement (retries exhausted) or a connection lost while the
    request was in flight leaves it unknown. Retrying such an operation may
    apply it twice; a Read is safe to retry."""

    may_have_executed: bool = False


# --------------------------------------------------------------- devices ----
class ProviderUnavailableError(RDMAError):
    """A provider (e.g. pyverbs) cannot be used on this machine; the message says why."""


class DeviceNotFoundError(RDMAError):
    """No RDMA device matched the request (name, provider, active port)."""


class GIDError(DeviceNotFoundError, ValueError):
    """The GID index asked for cannot carry RoCEv2 traffic to a peer: an empty
    slot, a link-local GID (fe80::/10, which a routed RoCEv2 peer cannot reach),
    or a GID without an address on its network device. The message names a
    usable index."""


class MemoryRegistrationError(RDMAError):
    """ibv_reg_mr failed: buffer not writable, too large, or locked-memory limit (ulimit -l)."""


class QueuePairStateError(RDMAError):
    """A verb was used on a queue pair in a state that does not allow it
    (e.g. ibv_post_send before the QP reached IBV_QPS_RTS)."""


class InvalidWorkRequestError(RDMAError):
    """ibv_post_send/ibv_post_recv/ibv_post_srq_recv refused a work request (bad
    lkey, too many SGEs, queue full, unsupported opcode, a receive posted to a
    queue pair that takes its receives from a shared receive queue) before
    anything reached the wire."""


class ResourceBusyError(RDMAError):
    """EBUSY: a verbs object was destroyed while others still use it, e.g.
    ``ibv_destroy_srq`` of a shared receive queue (SRQ) that queue pairs still
    take their receives from. Nothing was destroyed: close the users first."""

    #: the errno the verbs return
    errno: int = 16  # EBUSY


# ----------------------------------------------------------- completions ----
class WorkCompletionError(RDMAError):
    """A work request completed with a status other than IBV_WC_SUCCESS.

    ``status`` is the verbs status (:class:`~aiordma.verbs.WCStatus`),
    ``wc`` the whole work completion.
    """

    def __init__(self, message: str, wc: WorkCompletion | None = None, status: Any = None) -> None:
        super().__init__(message)
        self.wc = wc
        self.status = status if status is not None else (wc.status if wc is not None else None)


class RemoteAccessError(WorkCompletionError):
    """IBV_WC_REM_ACCESS_ERR: the responder refused the rkey, the address range
    or the access flag (REMOTE_WRITE / REMOTE_READ / REMOTE_ATOMIC)."""


class RemoteInvalidRequestError(WorkCompletionError):
    """IBV_WC_REM_INV_REQ_ERR: the responder found the request invalid (e.g. a
    SEND longer than the posted receive buffer, or an opcode it does not allow)."""


class RemoteOperationError(WorkCompletionError):
    """IBV_WC_REM_OP_ERR: the responder could not complete the operation."""


class RetryExceededError(WorkCompletionError):
    """IBV_WC_RETRY_EXC_ERR: no acknowledgement within timeout × retry_cnt; the
    peer is gone or the path drops everything."""


class RNRRetryExceededError(WorkCompletionError):
    """IBV_WC_RNR_RETRY_EXC_ERR: the responder had no receive posted (RNR NAK)
    more times than rnr_retry allows."""


class FlushedError(WorkCompletionError):
    """IBV_WC_WR_FLUSH_ERR: the QP went to IBV_QPS_ERR and this request was
    flushed without being executed."""


class LocalLengthError(WorkCompletionError):
    """IBV_WC_LOC_LEN_ERR: an incoming message did not fit the posted receive."""


class LocalProtectionError(WorkCompletionError):
    """IBV_WC_LOC_PROT_ERR: an SGE's lkey/address range is not a valid local region."""


class LocalQPOperationError(WorkCompletionError):
    """IBV_WC_LOC_QP_OP_ERR: the local QP could not execute the request."""


# ----------------------------------------------------------- connections ----
class ConnectionLostError(RDMAError, ConnectionError):
    """The connection is gone: the peer closed it, died, or the QP went to
    the error state. ``cause`` names why (a verbs status or a rendezvous event)."""

    def __init__(self, message: str, cause: BaseException | str | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class ConnectionClosedError(ConnectionLostError):
    """The connection was closed locally (close() or abort()) before the operation."""


class RendezvousError(RDMAError, ConnectionError):
    """The TCP rendezvous that exchanges QPN/GID/PSN/MTU/buffers failed: the
    server is unreachable or refused, the peer lied or went away mid-way. A
    :class:`ConnectionError` (hence an :class:`OSError`), so ``except OSError``
    and connect-retry loops see it."""


class ProtocolVersionError(RendezvousError):
    """The peer speaks a rendezvous version this side does not."""


class AuthenticationError(RendezvousError):
    """The shared-secret (HMAC) challenge-response failed: wrong or missing token."""


class HandshakeTimeoutError(RendezvousError, TimeoutError):
    """The rendezvous did not finish in time (connect or handshake timeout)."""


class CapabilityError(RendezvousError):
    """The peer lacks a capability this side requires (e.g. a byte-stream
    client meeting a plain message server: ``stream-ring-v1``)."""


class ProtectedModeError(RDMAError):
    """A server was asked to listen on a non-loopback address without a
    token. Every host that reaches such a port could connect and act on the
    memory the server exposes, so aiordma refuses ("protected mode", as Redis
    does) until a token is set (``token=``, ``$AIORDMA_TOKEN``,
    ``$AIORDMA_TOKEN_FILE``) or the check is turned off explicitly
    (``insecure=True``, ``AIORDMA_INSECURE=1``)."""

    def __init__(self, message: str, addresses: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        #: the non-loopback addresses the server would have listened on
        self.addresses = addresses


class TokenError(RDMAError, ValueError):
    """The rendezvous token could not be had: an empty token, or a token
    file (``$AIORDMA_TOKEN_FILE``) that is missing, unreadable, empty or too
    large. The message names the file, never the secret."""


class SettingError(RDMAError, ValueError):
    """An ``AIORDMA_*`` environment variable has a value aiordma does not
    accept. The message is one line naming the variable, the value and what
    is allowed (``AIORDMA_PROVIDER='bogus': expected one of auto, soft,
    pyverbs``); :attr:`name` and :attr:`value` say the same. See
    :mod:`aiordma.settings`."""

    def __init__(self, message: str, name: str | None = None, value: str | None = None) -> None:
        super().__init__(message)
        #: the variable, e.g. ``"AIORDMA_PROVIDER"``
        self.name = name
        #: its value as the environment holds it
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:  # keep name and value across pickling (Dask)
        return type(self), (str(self), self.name, self.value)


class DescriptorError(RDMAError, ValueError):
    """A descriptor list breaks a rule (:mod:`aiordma.descriptors`): a zero length,
    a range outside the local region or the remote buffer, overlapping
    destinations. :attr:`index` is the first descriptor found at fault; nothing of
    the list was posted."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        #: the descriptor's index in the list
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.index)


class TransferError(RDMAError):
    """A descriptor-list transfer failed (:class:`aiordma.transfer.Transfer`).

    :attr:`index` is the first descriptor that failed (its index in the list),
    :attr:`completed` how many of the descriptors, in the order they were posted,
    are known complete: the transfer's first ``completed`` positions moved their
    bytes, the one at position ``completed`` (descriptor :attr:`index`) did not, and
    none after it ran to completion. :attr:`error` is the underlying error (also the
    ``__cause__``): a :class:`WorkCompletionError` naming the verbs status, or the
    connection's failure."""

    def __init__(self, message: str, index: int, completed: int, error: BaseException | None = None) -> None:
        super().__init__(message)
        self.index = index
        self.completed = completed
        self.error = error


class TransferAbortedError(TransferError, ConnectionError):
    """A transfer failed because its connection did (a :class:`ConnectionError`)."""


class RemoteBufferNotFoundError(RDMAError, KeyError):
    """The peer has not exposed a remote buffer under that name."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


#: each failed work-completion status with an exception of its own (the others: WorkCompletionError)
_STATUS_ERRORS: dict[int, type[WorkCompletionError]] = {
    WCStatus.IBV_WC_LOC_LEN_ERR: LocalLengthError,
    WCStatus.IBV_WC_LOC_QP_OP_ERR: LocalQPOperationError,
    WCStatus.IBV_WC_LOC_PROT_ERR: LocalProtectionError,
    WCStatus.IBV_WC_WR_FLUSH_ERR: FlushedError,
    WCStatus.IBV_WC_REM_INV_REQ_ERR: RemoteInvalidRequestError,
    WCStatus.IBV_WC_REM_ACCESS_ERR: RemoteAccessError,
    WCStatus.IBV_WC_REM_OP_ERR: RemoteOperationError,
    WCStatus.IBV_WC_RETRY_EXC_ERR: RetryExceededError,
    WCStatus.IBV_WC_RNR_RETRY_EXC_ERR: RNRRetryExceededError,
}


def error_for_status(status: int) -> type[WorkCompletionError]:
    """The exception class for a verbs work-completion status (a :class:`~aiordma.verbs.WCStatus`,
    or the plain ``int`` a provider reports)."""
    return _STATUS_ERRORS.get(int(status), WorkCompletionError)


def stored(exc: BaseException) -> BaseException:
    """``exc`` made fit to be kept: its traceback and those of its causes dropped.

    An object that keeps an error to raise later (a connection's
    :attr:`~aiordma.Connection.error`) must not keep frames: the frames hold
    the object, and the cycle would keep a closed connection and its buffers
    alive until the cyclic garbage collector runs."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException) and cause is not e.__cause__:
            stored(cause)
        e = e.__cause__ or e.__context__
    return exc


def raiser(exc: BaseException | None) -> Callable[[], None]:
    """A ``check_usable`` for a connection's collaborator once the connection is
    torn down: it raises a fresh copy of the connection's error (``exc``, kept as
    :func:`stored` keeps it), or that the connection is closed, and holds no
    reference to the connection (the callback it replaces did)."""

    def check_usable() -> None:
        if exc is not None:
            raise fresh(exc)
        raise ConnectionClosedError("the connection is closed")

    return check_usable


def fresh(exc: BaseException) -> BaseException:
    """A copy of a kept error, to raise or to set on a future in its place.

    Raising the kept object itself would attach the caller's frames (which
    hold the connection) to an object the connection holds: the reference
    cycle :func:`stored` avoids. The copy has the same type, message and
    attributes, and the same ``__cause__`` and ``__context__`` as the kept error."""
    cls = type(exc)
    copy = cls.__new__(cls)
    copy.args = exc.args
    copy.__dict__.update(exc.__dict__)
    copy.__cause__ = exc.__cause__
    copy.__context__ = exc.__context__
    copy.__suppress_context__ = exc.__suppress_context__
    return copy


#: what an error of a request that may have run at the peer says of it
MAY_HAVE_EXECUTED = (
    "it may have executed at the peer: the request may have arrived and only its "
    "acknowledgement been lost (retrying a Write, SEND or atomic may apply it twice)"
)


def may_have_executed(exc: BaseException) -> BaseException:
    """Mark the error of an operation that may have run at the peer (see :class:`RDMAError`)."""
    exc.may_have_executed = True  # type: ignore[attr-defined]
    exc.add_note(MAY_HAVE_EXECUTED)
    return exc
