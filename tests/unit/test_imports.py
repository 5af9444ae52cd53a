"""``import aiordma`` stays light: the sans-IO core imports without asyncio or sockets."""

from __future__ import annotations

import subprocess
import sys

import pytest

import aiordma

pytestmark = pytest.mark.engine_neutral  # the same on every engine and core: CI's reference run leaves it out


def test_sans_io_core_imports_without_asyncio_or_sockets() -> None:
    code = (
        "import sys\n"
        "import aiordma, aiordma.window, aiordma.events, aiordma.errors\n"
        "import aiordma.providers.soft.wire, aiordma.providers.soft.rc\n"
        "heavy = [m for m in ('asyncio', 'socket', 'selectors', 'msgpack', 'uvloop') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "", f"the sans-IO core pulled in: {out.stdout.strip()}"


def test_every_public_name_resolves() -> None:
    for name in aiordma.__all__:
        assert getattr(aiordma, name) is not None, name
    assert set(aiordma.__all__) <= set(dir(aiordma))


def test_every_error_aiordma_raises_is_exported() -> None:
    """Each exception class of aiordma.errors can be caught as ``aiordma.X``."""
    import inspect

    from aiordma import errors

    defined = {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__
    }
    assert defined - set(aiordma.__all__) == set()
    for name in defined:
        assert getattr(aiordma, name) is getattr(errors, name)


def test_one_immediate_data_type() -> None:
    """``recv_immediate()``'s result and the event a handler gets are one type."""
    assert aiordma.Immediate is aiordma.ImmediateReceived
    imm = aiordma.Immediate(7, 64)
    assert (imm.value, imm.length) == (7, 64)


def test_the_large_message_module_says_what_it_is() -> None:
    import importlib

    module = importlib.import_module("aiordma.large_messages")
    assert module.LargeMessages is not None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("aiordma.rndv")
