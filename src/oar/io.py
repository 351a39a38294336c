"""Atomic, resumable file output: write to a temporary file in the same folder, then rename."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

__all__ = ["atomic_path", "atomic_write_text", "atomic_write_json", "atomic_write_jsonl", "read_jsonl", "append_jsonl"]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it onto ``path``.

    The temporary file (or folder, if the caller makes one) is removed when the block raises, so
    a crash never leaves a half-written ``path``. Works for folders too (e.g. ``save_pretrained``):
    an existing folder at ``path`` is replaced only after the new one is complete.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix + ".tmp", dir=path.parent)
    os.close(fd)
    os.unlink(tmp)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if tmp_path.is_dir() and path.exists():
            import shutil

            old = path.with_name(f".{path.name}.old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
            os.replace(tmp_path, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            if tmp_path.is_dir():
                import shutil

                shutil.rmtree(tmp_path, ignore_errors=True)
            else:
                tmp_path.unlink()


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int = 2) -> None:
    """Write ``obj`` as JSON to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=False, default=_json_default) + "\n")


def atomic_write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> None:
    """Write one JSON object per line to ``path`` atomically."""
    atomic_write_text(path, "".join(json.dumps(r, default=_json_default) + "\n" for r in rows))


def append_jsonl(path: str | os.PathLike, row: dict) -> None:
    """Append one JSON line and flush it to disk (for streaming logs such as metrics.jsonl)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, default=_json_default) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSON-lines file; a malformed line raises ValueError naming the file and line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON line: {e.msg}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            out.append(obj)
    return out


def _json_default(o: Any) -> Any:
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
