"""Why a backend cannot run a problem: `Reason`, and the `Unsupported` error that carries them."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reason:
    """One reason a backend rejects a problem.

    code:   a short dotted key, e.g. ``"head_dim"``, ``"feature.soft_cap"``, ``"package"``.
    detail: the value found and the values accepted, e.g. ``"head_dim_qk=96 not in {64, 128, 256}"``.
    hint:   what the user can do about it (may be empty).
    """

    code: str
    detail: str
    hint: str = ""

    def __str__(self) -> str:
        text = f"{self.code}: {self.detail}"
        return f"{text} ({self.hint})" if self.hint else text


class Unsupported(ValueError):
    """Raised when the requested backend (or every candidate) cannot run a problem.

    ``reasons`` maps a backend name to the list of `Reason` that rejected it.
    """

    def __init__(self, message: str, reasons: dict[str, list[Reason]] | None = None):
        self.reasons = dict(reasons or {})
        lines = [message]
        for backend, rs in self.reasons.items():
            for r in rs:
                lines.append(f"  {backend}: {r}")
        super().__init__("\n".join(lines))
