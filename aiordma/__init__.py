"""aiordma: asyncio RDMA messaging.

``await conn.write(...)``, ``await conn.read(...)``, ``await conn.send(...)``
inside asyncio code, over real RDMA devices (pyverbs: mlx5, irdma, kernel
Soft-RoCE rxe) or, where none exists, a userspace RoCEv2 device that speaks
the real wire format over UDP.

Quick start::

    import aiordma

    async def handler(conn):
        async for msg in conn:
            await conn.send(msg)              # echo

    server = await aiordma.start_server(handler, "127.0.0.1", 18515)
    conn = await aiordma.connect("127.0.0.1", 18515)
    await conn.send(b"hello")
    assert await conn.recv() == b"hello"

A server on anything but loopback needs a token (``token=``,
``$AIORDMA_TOKEN`` or ``$AIORDMA_TOKEN_FILE``) or an explicit
``insecure=True``; exposed memory is read-only for the peer unless exposed
with more rights (``expose={"mem": region.exposed("rw")}``). See
:mod:`aiordma.security` and :mod:`aiordma.exposure`.
"""

from typing import TYPE_CHECKING, Any

from .errors import (
    AuthenticationError,
    CapabilityError,
    ConnectionClosedError,
    ConnectionLostError,
    DescriptorError,
    DeviceNotFoundError,
    FlushedError,
    GIDError,
    HandshakeTimeoutError,
    InvalidWorkRequestError,
    LocalLengthError,
    LocalProtectionError,
    LocalQPOperationError,
    MemoryRegistrationError,
    ProtectedModeError,
    ProtocolVersionError,
    ProviderUnavailableError,
    QueuePairStateError,
    RDMAError,
    RemoteAccessError,
    RemoteBufferNotFoundError,
    RemoteInvalidRequestError,
    RemoteOperationError,
    RendezvousError,
    ResourceBusyError,
    RetryExceededError,
    RNRRetryExceededError,
    SettingError,
    TokenError,
    TransferAbortedError,
    TransferError,
    WorkCompletionError,
)
from .events import ConnectionEvent, ConnectionLost, ConnectionState, ControlReceived, ImmediateReceived

# The rest is imported on first use: ``import aiordma`` (and the sans-IO core,
# ``aiordma.window``, ``aiordma.providers.soft.wire``/``rc``) stays free of
# asyncio, sockets and msgpack until a connection is wanted.
_LAZY = {
    "DEFAULT_PORT": "rendezvous",
    "Exposure": "memory",
    "Connection": "connection",
    "Immediate": "connection",
    "PathInfo": "path",
    "AddressVector": "path",
    "connect": "handshake",
    "Region": "memory",
    "RegionSlice": "memory",
    "RemoteBuffer": "memory",
    "register": "memory",
    "close_shared_devices": "providers",
    "get_device": "providers",
    "open_device": "providers",
    "Access": "verbs",
    "WCStatus": "verbs",
    "Server": "server",
    "start_server": "server",
    "RDMAStreamReader": "stream",
    "RDMAStreamWriter": "stream",
    "open_connection": "stream",
    "start_stream_server": "stream",
    "set_process_recv_budget": "window",
    "PreparedTransfer": "transfer",
    "Transfer": "transfer",
    "TransferNotification": "transfer",
    "StripedTransfer": "transfer",
    "striped_transfer": "transfer",
}

if TYPE_CHECKING:  # pragma: no cover
    from .connection import Connection, Immediate
    from .handshake import connect
    from .memory import Exposure, Region, RegionSlice, RemoteBuffer, register
    from .path import AddressVector, PathInfo
    from .providers import close_shared_devices, get_device, open_device
    from .rendezvous import DEFAULT_PORT
    from .server import Server, start_server
    from .stream import RDMAStreamReader, RDMAStreamWriter, open_connection, start_stream_server
    from .transfer import PreparedTransfer, StripedTransfer, Transfer, TransferNotification, striped_transfer
    from .verbs import Access, WCStatus
    from .window import set_process_recv_budget


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'aiordma' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


#: the version, defined here only (pyproject.toml reads it: [tool.setuptools.dynamic])
__version__ = "0.1.0"

__all__ = [
    "DEFAULT_PORT",
    "Access",
    "AddressVector",
    "AuthenticationError",
    "CapabilityError",
    "Connection",
    "ConnectionClosedError",
    "ConnectionEvent",
    "ConnectionLost",
    "ConnectionLostError",
    "ConnectionState",
    "ControlReceived",
    "DescriptorError",
    "DeviceNotFoundError",
    "Exposure",
    "FlushedError",
    "GIDError",
    "HandshakeTimeoutError",
    "Immediate",
    "ImmediateReceived",
    "InvalidWorkRequestError",
    "LocalLengthError",
    "LocalProtectionError",
    "LocalQPOperationError",
    "MemoryRegistrationError",
    "PathInfo",
    "PreparedTransfer",
    "ProtectedModeError",
    "ProtocolVersionError",
    "ProviderUnavailableError",
    "QueuePairStateError",
    "RDMAError",
    "RDMAStreamReader",
    "RDMAStreamWriter",
    "RNRRetryExceededError",
    "Region",
    "RegionSlice",
    "RemoteAccessError",
    "RemoteBuffer",
    "RemoteBufferNotFoundError",
    "RemoteInvalidRequestError",
    "RemoteOperationError",
    "RendezvousError",
    "ResourceBusyError",
    "RetryExceededError",
    "Server",
    "SettingError",
    "StripedTransfer",
    "TokenError",
    "Transfer",
    "TransferAbortedError",
    "TransferError",
    "TransferNotification",
    "WCStatus",
    "WorkCompletionError",
    "close_shared_devices",
    "connect",
    "get_device",
    "open_connection",
    "open_device",
    "register",
    "set_process_recv_budget",
    "start_server",
    "start_stream_server",
    "striped_transfer",
]
