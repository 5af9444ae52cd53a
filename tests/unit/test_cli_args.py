"""The command-line rules of :mod:`aiordma.tools`, in process: argument types,
``aiordma bench``'s cross-checks, one-line parser errors, and how
:func:`aiordma.tools.invoke` turns each kind of failure into an exit status.

(The same rules, met as a user meets them, through real processes:
``tests/integration/test_cli_errors.py``.)"""

from __future__ import annotations

import argparse

import pytest

from aiordma.errors import DeviceNotFoundError
from aiordma.tools import (
    MAX_MESSAGE,
    ToolError,
    ToolParser,
    UsageError,
    bench,
    host_port,
    int_type,
    invoke,
    parse_size,
    port_number,
    seconds,
    size_type,
)
from aiordma.tools.bench import Status

pytestmark = pytest.mark.engine_neutral  # the same on every engine and core: CI's reference run leaves it out

# ------------------------------------------------------------ argument types ----


@pytest.mark.parametrize(
    "text, value",
    [("65536", 65536), ("64K", 65536), ("64KiB", 65536), ("8M", 8 << 20), ("1G", 1 << 30), ("1.5K", 1536), ("0", 0)],
)
def test_sizes(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["1Q", "", "K", "inf", "-inf", "nan", "1e400", "1e400K", "1.5", "0.1K"])
def test_bad_sizes_are_argument_errors(text: str) -> None:
    # today: 'inf' and '1e400' end in OverflowError, '1.5' is silently 1 byte
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_size_range() -> None:
    big = size_type(1, MAX_MESSAGE, "the largest RDMA message")
    assert big("2G") == MAX_MESSAGE
    with pytest.raises(argparse.ArgumentTypeError, match="more than 2G .*largest RDMA message"):
        big("3G")
    with pytest.raises(argparse.ArgumentTypeError, match="less than 1 byte"):
        big("0")
    with pytest.raises(argparse.ArgumentTypeError, match="less than 1 byte"):
        big("-5")


def test_integers_ports_and_durations() -> None:
    n = int_type(1, 100, "why")
    assert n("1") == 1 and n("100") == 100
    for bad, msg in (
        ("0", "less than 1"),
        ("101", "more than 100: why"),
        ("1.5", "not a whole number"),
        ("x", "not a whole number"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=msg):
            n(bad)
    assert port_number("0") == 0 and port_number("65535") == 65535
    for bad in ("65536", "70000", "-1", "http"):
        with pytest.raises(argparse.ArgumentTypeError):
            port_number(bad)
    assert seconds("0.5") == 0.5
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(argparse.ArgumentTypeError):
            seconds(bad)
    assert host_port("10.0.0.2:18515") == ("10.0.0.2", 18515)
    assert host_port("[::1]:1") == ("::1", 1)
    for bad in ("nocolon", ":18515", "h:0", "h:99999", "h:x"):
        with pytest.raises(argparse.ArgumentTypeError):
            host_port(bad)


# ------------------------------------------------------ one-line parser errors ----


def test_parser_errors_are_one_line_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    p = ToolParser(prog="aiordma thing")
    p.add_argument("--port", type=port_number)
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--port", "70000"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("aiordma thing: error: argument --port: 70000 is not a port")


def _bench_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="aiordma bench")
    bench.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize(
    "argv, match",
    [
        (["write_bw", "--server", "--client", "h"], "--server and --client"),
        (["send_lat", "-l", "4"], "--post-list applies to write_bw only"),
        (["write_bw", "-l", "32", "-t", "16"], "--post-list 32 is more than --tx-depth 16"),
        (["atomic_lat", "-s", "64"], "one 8-byte word"),
        (["atomic_lat", "-a"], "one 8-byte word"),
        (["write_bw", "-a", "-s", "4K"], "give one of them"),
        (["write_bw", "--client", "h", "-p", "0"], "--port 0 means any free port"),
        (["write_bw", "--client", "h", "-p", "65535"], "--port \\+ 1 = 65536"),
        (["write_bw", "--server", "-p", "65535"], "--port \\+ 1 = 65536"),
        (["write_bw", "-D", "100000"], "more than a day"),
    ],
)
def test_bench_cross_checks(argv: list[str], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        bench.validate(_bench_args(*argv))


@pytest.mark.parametrize(
    "argv",
    [
        ["write_bw", "--server", "-p", "65535", "--tcp-port", "1"],
        ["write_bw", "--server", "-p", "65535", "--baseline", "none"],
        ["write_bw", "--client", "h", "-p", "65534"],
        ["write_bw", "-l", "16"],
        ["atomic_lat", "-n", "10"],
    ],
)
def test_bench_cross_checks_accept(argv: list[str]) -> None:
    bench.validate(_bench_args(*argv))


@pytest.mark.parametrize(
    "argv",
    [
        ["write_bw", "-n", "0"],  # today: silently 1 iteration
        ["write_bw", "-n", "-3"],
        ["write_bw", "-n", str(bench.MAX_ITERS + 1)],
        ["write_bw", "-s", "3G"],
        ["write_bw", "-t", "0"],
        ["write_bw", "-t", str(bench.MAX_DEPTH + 1)],
        ["write_bw", "--warmup", "-1"],
        ["write_bw", "-D", "0"],
        ["write_bw", "-p", "70000"],
        ["write_bw", "--tcp-port", "-1"],
        ["write_bw", "--max-size", "1"],
    ],
)
def test_bench_out_of_range_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _bench_args(*argv)
    assert e.value.code == 2
    assert "error: argument" in capsys.readouterr().err


def test_warm_up_never_moves_more_than_the_default_budget() -> None:
    args = _bench_args("write_bw", "-s", "1G", "-n", "2")
    assert bench.warmup_for(args, 2, 1 << 30) == 2  # was 16 x 1 GiB
    small = _bench_args("write_bw", "-s", "64K", "-n", "200")
    assert bench.warmup_for(small, 200, 65536) == bench.warmup_for(small, 200) == 20  # unchanged for usual sizes
    assert bench.warmup_for(_bench_args("write_bw", "--warmup", "50"), 10, 1 << 30) == 50  # an explicit one stays


# --------------------------------------------------------------------- invoke ----


def _parser() -> argparse.ArgumentParser:
    return ToolParser(prog="aiordma x")


def test_invoke_maps_failures_to_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIORDMA_TRACEBACK", raising=False)
    ns = argparse.Namespace()

    def raiser(exc: BaseException):
        def run(args: argparse.Namespace) -> int:
            raise exc

        return run

    assert invoke(lambda a: 0, ns, _parser()) == 0
    assert invoke(lambda a: 3, ns, _parser()) == 3
    for exc, code, text in (
        (ToolError("cannot reach the peer"), 1, "aiordma x: cannot reach the peer\n"),
        (DeviceNotFoundError("no soft0"), 1, "aiordma x: DeviceNotFoundError: no soft0\n"),
        (KeyboardInterrupt(), 130, "aiordma x: interrupted\n"),
    ):
        assert invoke(raiser(exc), ns, _parser()) == code
        assert capsys.readouterr().err == text
    assert invoke(raiser(ZeroDivisionError("boom")), ns, _parser()) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ZeroDivisionError: boom" in err and "AIORDMA_TRACEBACK=1" in err
    with pytest.raises(SystemExit) as e:
        invoke(raiser(UsageError("--a and --b exclude each other")), ns, _parser())
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("aiordma x: error: --a and --b exclude each other")
    monkeypatch.setenv("AIORDMA_TRACEBACK", "1")
    with pytest.raises(ZeroDivisionError):
        invoke(raiser(ZeroDivisionError("boom")), ns, _parser())


# --------------------------------------------------------------------- status ----


class _Stream:
    def __init__(self, tty: bool) -> None:
        self.tty = tty
        self.text = ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass


def test_status_shows_only_phases_that_last() -> None:
    out = _Stream(tty=False)
    st = Status("bench: ", interval=0.05, stream=out)  # type: ignore[arg-type]
    st.set("short phase")
    st.show()
    assert out.text == ""  # not yet lasted the interval
    st.since -= 1.0
    st.show()
    st.show()  # once per phase (and again after ten intervals)
    assert out.text == "bench: short phase ... 1 s\n"
    st.since -= 1.0
    st._printed_at = (st._printed_at or 0) - 1.0
    st.show()
    assert out.text.count("\n") == 2
    tty = _Stream(tty=True)
    st = Status("bench: ", interval=0.05, stream=tty)  # type: ignore[arg-type]
    st.set("long phase")
    st.since -= 2.0
    st.show()
    assert tty.text == "\r\033[Kbench: long phase ... 2 s"
    st.clear()
    assert tty.text.endswith("\r\033[K") and not st._on_screen
    quiet = _Stream(tty=False)
    st = Status("bench: ", stream=quiet, enabled=False)  # type: ignore[arg-type]
    st.set("x")
    st.since -= 5
    st.show()
    assert quiet.text == ""
