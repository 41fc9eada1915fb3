"""The training corpus: the Python standard library's own ``.py`` sources.

The file list is sorted by relative path so every run sees the same order, and a
fixed slice of files is held out for evaluation.  A file is held out when the
SHA-256 of its relative path (POSIX separators) falls in bucket 0 of
``HELD_OUT_BUCKETS``; the slice therefore depends only on file names, never on
the order of a directory listing or on the interpreter's hash seed.

The regression-test suite (``test/``, ``tests/``, ``idle_test/``) is excluded:
it is about half of the stdlib's bytes and consists largely of fixtures and
assertion tables, while the models are meant to complete ordinary library code.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_BUCKETS = 20
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)
# Per-file cap: a handful of generated tables would otherwise dominate a tiny corpus.
MAX_FILE_BYTES = 400_000


@dataclass(frozen=True)
class SourceFile:
    """One corpus file: its path relative to the corpus root and its text."""

    relpath: str
    text: str


def stdlib_root() -> Path:
    """The directory holding this interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relpath: str) -> bool:
    """Whether ``relpath`` belongs to the fixed evaluation slice."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % HELD_OUT_BUCKETS == 0


def _is_excluded(relative: Path) -> bool:
    parts = relative.parts
    if any(part in EXCLUDED_DIRS for part in parts[:-1]):
        return True
    # Build-time configuration dumps, not hand-written code.
    return parts[0].startswith("config-") or parts[-1].startswith("_sysconfigdata")


def list_sources(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of all corpus files under ``root``, sorted."""
    base = stdlib_root() if root is None else root
    found = []
    for path in base.rglob("*.py"):
        relative = path.relative_to(base)
        if _is_excluded(relative) or not path.is_file():
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        found.append(relative.as_posix())
    return sorted(found)


def read_sources(root: Path | None = None) -> list[SourceFile]:
    """All corpus files with their text, in sorted path order.

    Files that are not valid UTF-8 are skipped rather than decoded lossily, so the
    tokenizer never learns replacement characters.
    """
    base = stdlib_root() if root is None else root
    sources = []
    for relpath in list_sources(base):
        try:
            text = (base / relpath).read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            sources.append(SourceFile(relpath, text))
    return sources


def split_sources(sources: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    """Split into (training files, held-out files), each keeping sorted order."""
    train = [s for s in sources if not is_held_out(s.relpath)]
    held_out = [s for s in sources if is_held_out(s.relpath)]
    return train, held_out


def training_texts(root: Path | None = None) -> Iterator[str]:
    """Texts of the training files, in deterministic order."""
    train, _ = split_sources(read_sources(root))
    for source in train:
        yield source.text


def held_out_texts(root: Path | None = None) -> list[str]:
    """Texts of the held-out evaluation files, in deterministic order."""
    _, held_out = split_sources(read_sources(root))
    return [source.text for source in held_out]
