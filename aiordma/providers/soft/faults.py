"""Fault injection on the soft device's transmit path (tests only), for either engine.

A :class:`LinkFaults` is a configuration plus three live counts. Install it
with ``device.faults = LinkFaults(...)`` (``None`` removes it). The Python
engine applies it itself (:meth:`LinkFaults.apply`); the native engine copies
the probabilities and the seed into its NIC thread and reports its counts
back through the same ``dropped``/``duplicated``/``reordered`` attributes, so
a test reads them the same way on both engines. The two engines draw from
different generators: the same seed gives a reproducible run on each engine,
not the same packets dropped on both.
"""

from __future__ import annotations

import random
from collections.abc import Callable

__all__ = ["LinkFaults"]


class LinkFaults:
    """Each datagram is dropped with probability ``drop``, sent twice with
    ``duplicate``, or held back and sent after the next one with ``reorder``.
    ``filter`` (datagram → bool) drops exactly the datagrams it rejects (on the
    native engine it is called with the GIL from the NIC thread: tests only)."""

    def __init__(
        self,
        drop: float = 0.0,
        duplicate: float = 0.0,
        reorder: float = 0.0,
        seed: int | None = None,
        filter: Callable[[bytes], bool] | None = None,
    ) -> None:
        for name, p in (("drop", drop), ("duplicate", duplicate), ("reorder", reorder)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"LinkFaults.{name} is a probability in [0, 1], not {p!r}")
        self.drop, self.duplicate, self.reorder = float(drop), float(duplicate), float(reorder)
        self.seed = seed
        self.filter = filter
        self._dropped = self._duplicated = self._reordered = 0
        self._rng = random.Random(seed)
        self._held: list[tuple[bytes, tuple[str, int]]] = []
        #: set by the native engine while it runs this configuration: returns its live counts
        self._live: Callable[[], tuple[int, int, int]] | None = None

    # the counts: the engine running the faults keeps them
    @property
    def dropped(self) -> int:
        return self._live()[0] if self._live is not None else self._dropped

    @property
    def duplicated(self) -> int:
        return self._live()[1] if self._live is not None else self._duplicated

    @property
    def reordered(self) -> int:
        return self._live()[2] if self._live is not None else self._reordered

    def _freeze(self, counts: tuple[int, int, int]) -> None:
        """The native engine stopped running this configuration: keep its final counts."""
        self._dropped, self._duplicated, self._reordered = counts
        self._live = None

    def __repr__(self) -> str:
        return (
            f"LinkFaults(drop={self.drop}, duplicate={self.duplicate}, reorder={self.reorder}, seed={self.seed}, "
            f"filter={self.filter!r}; dropped={self.dropped}, duplicated={self.duplicated}, reordered={self.reordered})"
        )

    # ------------------------------------------------ the Python engine ----
    def apply(self, datagram: bytes, addr: tuple[str, int]) -> list[tuple[bytes, tuple[str, int]]]:
        """The datagrams to send instead of ``datagram`` (Python engine)."""
        if self.filter is not None and not self.filter(datagram):
            self._dropped += 1
            return []
        r = self._rng.random()
        if r < self.drop:
            self._dropped += 1
            return []
        out = [(datagram, addr)]
        if self._rng.random() < self.duplicate:
            self._duplicated += 1
            out.append((datagram, addr))
        if self._rng.random() < self.reorder and not self._held:
            self._reordered += 1
            self._held = out
            return []
        if self._held:
            out.extend(self._held)
            self._held = []
        return out

    @property
    def holding(self) -> bool:
        """Whether a datagram is held back for reordering (the NIC must come back soon)."""
        return bool(self._held)

    def flush(self) -> list[tuple[bytes, tuple[str, int]]]:
        """Release a held-back datagram (Python engine)."""
        held, self._held = self._held, []
        return held
