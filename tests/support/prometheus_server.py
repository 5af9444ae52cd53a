"""A real Prometheus server for tests: it scrapes the targets it is given, and the
test reads the series back through Prometheus's HTTP query API.

Debian's ``prometheus`` package (``/usr/bin/prometheus``; CI installs it). Each
server gets a fresh data directory and a free port on loopback, scrapes every
``SCRAPE_INTERVAL``, and is stopped (SIGTERM, then SIGKILL) when the ``with``
block ends::

    with PrometheusServer({"service": ["127.0.0.1:9464"]}) as prom:
        value = prom.wait_for_value('aiordma_operations_total{op="write"}', 10_000)
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

#: how often it scrapes: the series a test waits for appear within about this long
SCRAPE_INTERVAL = "0s500ms"
START_TIMEOUT = 60.0

PROMETHEUS = shutil.which("prometheus")
MISSING = "Prometheus is not installed (apt-get install prometheus; CI's bootstrap installs it)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrometheusServer:
    """A Prometheus process scraping ``targets`` (job name -> ``host:port`` list, path /metrics)."""

    def __init__(self, targets: dict[str, list[str]]) -> None:
        if PROMETHEUS is None:
            raise RuntimeError(MISSING)
        self._tmp = tempfile.TemporaryDirectory(prefix="aiordma-prometheus-")
        tmp = Path(self._tmp.name)
        jobs = [
            {"job_name": job, "scrape_interval": SCRAPE_INTERVAL, "static_configs": [{"targets": hosts}]}
            for job, hosts in targets.items()
        ]
        # (JSON is YAML: no YAML writer needed)
        config = tmp / "prometheus.yml"
        config.write_text(json.dumps({"global": {"scrape_interval": SCRAPE_INTERVAL}, "scrape_configs": jobs}))
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(tmp / "prometheus.log", "w+")
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=tmp,
        )
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.proc.returncode}):\n{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"prometheus not ready after {START_TIMEOUT:g} s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """An instant query: each series' labels and value."""
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            reply: dict[str, Any] = json.loads(r.read())
        assert reply["status"] == "success", reply
        return [(item["metric"], float(item["value"][1])) for item in reply["data"]["result"]]

    def targets_up(self) -> dict[str, str]:
        """Each scraped target's health (``up``/``down``/``unknown``) and its last error."""
        with urllib.request.urlopen(self.url + "/api/v1/targets", timeout=10) as r:
            reply = json.loads(r.read())
        return {
            t["scrapeUrl"]: f"{t['health']} {t.get('lastError', '')}".strip() for t in reply["data"]["activeTargets"]
        }

    def wait_for(self, expr: str, predicate: Any, timeout: float = 30.0) -> list[tuple[dict[str, str], float]]:
        """Query ``expr`` until ``predicate(result)`` holds; the result (or an AssertionError with the last one)."""
        deadline = time.monotonic() + timeout
        result: list[tuple[dict[str, str], float]] = []
        while time.monotonic() < deadline:
            result = self.query(expr)
            if predicate(result):
                return result
            time.sleep(0.2)
        raise AssertionError(f"{expr}: {result} after {timeout:g} s (targets: {self.targets_up()})")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self._tmp.cleanup()

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
