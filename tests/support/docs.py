"""Where the user documentation lives: the top-level ``README.md`` and the pages under ``docs/`` it links to
(``usage.md``, ``data.md``, ``checkpoints.md``, ``how-it-works.md``, ``gpu.md``, ``cpu.md``, ``benchmarks.md``,
``testing.md``, ``memory.md``, ...).
Tests that check what the documentation says read the page that now holds the text."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The checkout's root directory."""
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def doc_pages() -> list[Path]:
    """``README.md`` and every ``docs/*.md`` page, README first, the pages sorted by name."""
    return [README, *sorted(DOCS.glob("*.md"))]


def docs_text() -> str:
    """The text of every page of :func:`doc_pages`, one after the other."""
    return "\n".join(p.read_text() for p in doc_pages())
