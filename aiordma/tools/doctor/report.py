"""The doctor's results: a :class:`Check` per finding, the :class:`Plan`
(which provider and device aiordma would use), the :class:`Report` that holds
both, and the table ``aiordma doctor`` prints."""

from __future__ import annotations

import shutil
import textwrap
from dataclasses import asdict, dataclass, field
from typing import Any

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
STATUSES = (OK, WARN, FAIL, SKIP)


@dataclass
class Check:
    """One finding: ``seen`` is what was observed, ``fix`` one line saying what
    to do (empty when nothing is to be done); ``data`` holds the same facts for
    machines (``--json``)."""

    name: str
    status: str
    seen: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, not {self.status!r}")


@dataclass
class Plan:
    """What aiordma would use: ``provider`` (soft/pyverbs), ``device`` and why."""

    provider: str
    device: str | None
    why: str
    requested: str = "auto"


@dataclass
class Report:
    plan: Plan
    checks: list[Check]

    @property
    def overall(self) -> str:
        st = {c.status for c in self.checks}
        return FAIL if FAIL in st else WARN if WARN in st else OK

    @property
    def exit_status(self) -> int:
        return 1 if self.overall == FAIL else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "overall": self.overall,
            "exit_status": self.exit_status,
            "plan": asdict(self.plan),
            "checks": [asdict(c) for c in self.checks],
        }

    def get(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}: {[c.name for c in self.checks]}")


def _mib(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n // 1024} KiB" if n >= 1024 else f"{n} B"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


_COLOURS = {OK: "\033[32m", WARN: "\033[33m", FAIL: "\033[31m", SKIP: "\033[2m"}
_RESET = "\033[0m"


def format_table(report: Report, colour: bool = False, width: int | None = None) -> str:
    width = width or shutil.get_terminal_size((110, 24)).columns
    name_w = min(max(len(c.name) for c in report.checks), 22)
    indent = 2 + 4 + 2 + name_w + 2
    body_w = max(40, width - indent)
    lines = [f"  {'':4}  {'CHECK':<{name_w}}  WHAT WAS SEEN  (→ fix)"]
    for c in report.checks:
        st = f"{c.status:<4}"
        if colour:
            st = _COLOURS[c.status] + st + _RESET
        seen = textwrap.wrap(c.seen, body_w) or [""]
        lines.append(f"  {st}  {c.name:<{name_w}}  {seen[0]}")
        lines += [" " * indent + s for s in seen[1:]]
        if (c.fix and c.status in (WARN, FAIL)) or (c.fix and c.name == "Soft-RoCE (rxe)"):
            for i, s in enumerate(textwrap.wrap("→ fix: " + c.fix, body_w)):
                lines.append(" " * indent + ("" if i == 0 else "       ") + s)
    overall = report.overall
    ov = _COLOURS[overall] + overall + _RESET if colour else overall
    plan = report.plan
    lines.append("")
    lines.append(f"aiordma will use: {plan.provider} device {plan.device or '(none)'} ({plan.why})")
    lines.append(f"overall: {ov} (exit status {report.exit_status})")
    return "\n".join(lines)
