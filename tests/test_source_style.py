"""The repository's own style rule that no linter here enforces: source lines of at most 120 characters."""
from __future__ import annotations

from pathlib import Path

MAX_LINE = 120
ROOT = Path(__file__).resolve().parents[1]


def _sources() -> list[Path]:
    """The project's Python and shell sources: the package, tests and scripts (.ci/run keeps the README's
    install command verbatim, one line)."""
    files = []
    for folder in ("flashdispatch", "tests", "scripts"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh")]
    return sorted(p for p in files if p.is_file() and "__pycache__" not in p.parts)


def test_sources_found():
    names = {p.name for p in _sources()}
    assert {"__init__.py", "test_source_style.py", "device_run.sh"} <= names


def test_lines_at_most_120_characters():
    long = []
    for path in _sources():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if len(line) > MAX_LINE:
                long.append(f"{path.relative_to(ROOT)}:{number} ({len(line)} characters)")
    assert not long, f"lines over {MAX_LINE} characters:\n" + "\n".join(long)
