"""The backend's settings (``distributed.comm.rdma.*``), read the ways Dask's
configuration is set, and the choice of device they lead to."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dask
import pytest

import aiordma
from aiordma.integrations.dask import Settings
from aiordma.integrations.dask.config import device_for, route_source

ROOT = Path(__file__).resolve().parents[2]


def test_defaults() -> None:
    s = Settings.from_config()
    assert s == Settings()
    assert s.batch_limit == 32 * 1024 and s.send_window == 256 << 20 and s.registration_cache == 0
    assert s.buffer_pool == 256 << 20
    assert s.close_timeout == 5.0 and s.handshake_timeout == 10.0
    # what aiordma.connect / start_server get: none of aiordma's own defaults overridden but these
    assert s.connection_options() == {
        "registration_cache": 0,
        "large_send_window": 256 << 20,
        "ack_timeout": 16,
        "retry_cnt": 7,
    }


def test_every_key_through_dask_config() -> None:
    with dask.config.set(
        {
            "distributed.comm.rdma.provider": "SOFT",
            "distributed.comm.rdma.device": "soft0",
            "distributed.comm.rdma.gid-index": "1",
            "distributed.comm.rdma.soft-address": "127.0.0.9:0",
            "distributed.comm.rdma.token": 1234,  # Dask reads DASK_..._TOKEN=1234 as an int
            "distributed.comm.rdma.insecure": "yes",
            "distributed.comm.rdma.recv-budget": "64 MiB",
            "distributed.comm.rdma.large-message-threshold": "1 MiB",
            "distributed.comm.rdma.send-window": "1 GiB",
            "distributed.comm.rdma.batch-limit": "4 KiB",
            "distributed.comm.rdma.registration-cache": 16,
            "distributed.comm.rdma.buffer-pool": "1 GiB",
            "distributed.comm.rdma.progress": "thread",
            "distributed.comm.rdma.ack-timeout": 18,
            "distributed.comm.rdma.retry-cnt": "5",
            "distributed.comm.rdma.spin-us": 0,
            "distributed.comm.rdma.handshake-timeout": "2 s",
            "distributed.comm.rdma.close-timeout": "500 ms",
        }
    ):
        s = Settings.from_config()
    assert s == Settings(
        provider="soft",
        device="soft0",
        gid_index=1,
        soft_address="127.0.0.9:0",
        token="1234",
        insecure=True,
        recv_budget=64 << 20,
        large_message_threshold=1 << 20,
        send_window=1 << 30,
        batch_limit=4096,
        registration_cache=16,
        buffer_pool=1 << 30,
        ack_timeout=18,
        retry_cnt=5,
        progress="thread",
        spin_us=0.0,
        handshake_timeout=2.0,
        close_timeout=0.5,
    )
    assert s.connection_options() == {
        "registration_cache": 16,
        "large_send_window": 1 << 30,
        "ack_timeout": 18,
        "retry_cnt": 5,
        "gid_index": 1,
        "recv_budget": 64 << 20,
        "large_message_threshold": 1 << 20,
        "progress": "thread",
        "spin_us": 0.0,
    }


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("provider", "verbs", "provider must be auto, soft or pyverbs"),
        ("gid-index", "first", "gid-index must be a GID table index"),
        ("gid-index", -1, "gid-index must be a GID table index"),
        ("recv-budget", "lots", "recv-budget must be a number of bytes"),
        ("recv-budget", "1 KiB", "recv-budget must be at least 65536 bytes"),
        ("progress", "poll", "progress must be event, thread or busy"),
        ("spin-us", "fast", "spin-us must be a number of microseconds"),
        ("ack-timeout", 0, "ack-timeout must be an integer from 1 to 31"),
        ("retry-cnt", 8, "retry-cnt must be an integer from 0 to 7"),
        ("insecure", "maybe", "insecure must be true or false"),
        ("close-timeout", "0 s", "close-timeout must be a positive duration"),
        ("handshake-timeout", "soon", "handshake-timeout must be a duration"),
        ("registration-cache", -2, "registration-cache must be an integer from 0 to 1048576, not -2"),
        ("registration-cache", "lots", "registration-cache must be an integer from 0 to 1048576, not 'lots'"),
        ("buffer-pool", "lots", "buffer-pool must be a number of bytes"),
        ("buffer-pool", -1, "buffer-pool must be at least 0 bytes"),
    ],
)
def test_bad_values_name_the_key(key: str, value: object, match: str) -> None:
    with dask.config.set({f"distributed.comm.rdma.{key}": value}), pytest.raises(ValueError, match=match):
        Settings.from_config()


def test_environment_variables_as_dask_maps_them() -> None:
    """DASK_DISTRIBUTED__COMM__RDMA__<KEY>, read by a fresh process as every
    Dask process (scheduler, worker, nanny) reads them."""
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        DASK_DISTRIBUTED__COMM__RDMA__TOKEN="s3cret",
        DASK_DISTRIBUTED__COMM__RDMA__GID_INDEX="3",
        DASK_DISTRIBUTED__COMM__RDMA__BATCH_LIMIT="8 KiB",
    )
    code = (
        "from aiordma.integrations.dask import Settings; s = Settings.from_config(); "
        "print(s.token, s.gid_index, s.batch_limit)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["s3cret", "3", "8192"]


def test_the_keys_are_in_dasks_defaults() -> None:
    """Importing the backend registers its keys (register_defaults); the test calls it
    again because distributed.utils_test's reset_config(), run by the cluster tests,
    restores the configuration from before the import. Settings never depend on it."""
    from aiordma.integrations.dask import register_defaults

    register_defaults()
    assert dask.config.get("distributed.comm.rdma.batch-limit") == "32 KiB"
    assert dask.config.get("distributed.comm.rdma.token") is None
    with dask.config.set({"distributed.comm.rdma.batch-limit": "1 KiB"}):
        register_defaults()  # a default never overrides what was set
        assert dask.config.get("distributed.comm.rdma.batch-limit") == "1 KiB"


async def test_loopback_uses_the_default_soft_device() -> None:
    dev = device_for(Settings(provider="soft"), "127.0.0.1")
    assert dev is aiordma.get_device("soft")
    assert device_for(Settings(provider="soft"), None) is dev
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert route_source("::1") is None  # the soft device's GID is an IPv4 address


async def test_an_explicit_soft_address_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = device_for(Settings(provider="soft", soft_address="127.0.0.77:0"), "10.9.9.9")
    assert dev.address[0] == "127.0.0.77" and dev.address[1] != 4791
    monkeypatch.setenv("AIORDMA_SOFT_ADDR", "127.0.0.78:0")
    assert device_for(Settings(provider="soft"), "10.9.9.9").address[0] == "127.0.0.78"
