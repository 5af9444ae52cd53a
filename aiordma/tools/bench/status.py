"""Progress of a long run, on stderr (stdout stays for the table or the JSON).

A phase (``64 MiB write_bw: aiordma: measuring, 2 iterations``) is shown
only once it has lasted ``interval`` seconds, so short runs stay quiet. On a
terminal the line is rewritten in place and erased before the table goes on;
elsewhere (a pipe, a CI log) a phase gets one line, and another every ten
intervals while it lasts.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import TextIO


def size_text(n: int) -> str:
    """``65536`` -> ``64 KiB`` (exact binary units), else bytes."""
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


class Status:
    """The current phase of a run, shown on ``stream`` once it lasts."""

    def __init__(self, prefix: str, interval: float = 1.0, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.prefix = prefix
        self.interval = interval
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.text: str | None = None
        self.since = 0.0
        self._printed_at: float | None = None  # when this phase was last shown (non-tty)
        self._on_screen = False  # a tty line to erase
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.enabled and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._tick(), name="aiordma-bench-status")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self.clear()

    def set(self, text: str | None) -> None:
        """Start a new phase (None: nothing running worth showing)."""
        self.text = text
        self.since = time.monotonic()
        self._printed_at = None

    def clear(self) -> None:
        """Erase the terminal line (before something else is printed)."""
        if self._on_screen:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._on_screen = False

    def show(self) -> None:
        """Show the phase if it has lasted long enough (the ticker calls this)."""
        if not self.enabled or self.text is None:
            return
        now = time.monotonic()
        elapsed = now - self.since
        if elapsed < self.interval:
            return
        line = f"{self.prefix}{self.text} ... {elapsed:.0f} s"
        if self.tty:
            self.stream.write("\r\033[K" + line)
            self._on_screen = True
        elif self._printed_at is None or now - self._printed_at >= 10 * self.interval:
            self.stream.write(line + "\n")
            self._printed_at = now
        else:
            return
        self.stream.flush()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.interval / 2)
            self.show()
