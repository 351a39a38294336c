"""Atomic, resumable file output: write to a temporary file in the same folder, then rename."""

from __future__ import annotations

import contextlib
import glob
import json
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

__all__ = [
    "VERIFIER_TRAINED",
    "DISK_FULL_ERRNOS",
    "atomic_path",
    "commit_path",
    "recover_atomic_dir",
    "exclusive_lock",
    "FolderLockedError",
    "DiskFullError",
    "free_bytes",
    "format_bytes",
    "SharedWriteError",
    "OutputPathError",
    "check_output_folder",
    "safetensors_problem",
    "atomic_write_text",
    "atomic_write_json",
    "atomic_write_jsonl",
    "read_jsonl",
    "read_recorded_json",
    "append_jsonl",
    "file_digest",
    "folder_digest",
]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it onto ``path``.

    The temporary file (or folder, if the caller makes one) is removed when the block raises, so
    a crash never leaves a half-written ``path``. Works for folders too (e.g. ``save_pretrained``):
    an existing folder at ``path`` is replaced only after the new one is complete, in three renames
    (``tmp -> .<name>.new``, ``path -> .<name>.old``, ``.<name>.new -> path``) so that a kill between
    any two of them leaves a complete copy that :func:`recover_atomic_dir` puts back.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix + ".tmp", dir=path.parent)
    os.close(fd)
    os.unlink(tmp)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        commit_path(tmp_path, path)
    finally:
        if tmp_path.exists():
            if tmp_path.is_dir():
                shutil.rmtree(tmp_path, ignore_errors=True)
            else:
                tmp_path.unlink()


def commit_path(tmp_path: Path, path: Path) -> None:
    """Rename the complete ``tmp_path`` onto ``path`` (the last step of :func:`atomic_path`; for a
    temporary folder that several processes wrote, see ``oar.trainer.strategy``)."""
    if tmp_path.is_dir() and path.exists():
        new, old = _new_old(path)
        for stale in (new, old):
            if stale.exists():
                shutil.rmtree(stale)
        os.replace(tmp_path, new)  # complete from here on
        os.replace(path, old)
        os.replace(new, path)
        shutil.rmtree(old)
    else:
        os.replace(tmp_path, path)


def _new_old(path: Path) -> tuple[Path, Path]:
    return path.with_name(f".{path.name}.new"), path.with_name(f".{path.name}.old")


def recover_atomic_dir(path: str | os.PathLike) -> list[str]:
    """Finish or undo a folder swap of :func:`atomic_path` that a kill interrupted.

    Removes the incomplete temporary folders (``.<name>.*.tmp``), puts the newest complete copy at
    ``path`` (``.<name>.new`` if it exists, else ``.<name>.old`` when ``path`` is missing) and
    removes the superseded one. Call it only while no other process writes ``path`` (see
    :func:`exclusive_lock`).

    Returns:
        One line per action taken (empty when there was nothing to recover).
    """
    path = Path(path)
    new, old = _new_old(path)
    actions: list[str] = []
    for tmp in sorted(path.parent.glob(f".{glob.escape(path.name)}.*.tmp")):
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        actions.append(f"removed the incomplete {tmp.name} of an interrupted write")
    if new.is_dir():  # complete: the kill came before the swap ended
        if path.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(path, old)
        os.replace(new, path)
        actions.append(f"completed the interrupted replacement of {path.name} with its new copy")
    elif old.is_dir() and not path.exists():
        os.replace(old, path)
        actions.append(f"restored {path.name} from {old.name}")
    if old.exists():
        shutil.rmtree(old)
    return actions


class FolderLockedError(RuntimeError):
    """Another process holds the folder's lock (see :func:`exclusive_lock`); the message names it."""


#: The errnos of a full file system (no space; the user's quota reached).
#: The ``verifier`` option's value that names the step verifier a config's workflow trains (credit
#: ``step_verifier``, attribution signal ``step_verifier``), read by the workflow as well.
VERIFIER_TRAINED = "trained"

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class DiskFullError(OSError):
    """The file system filled up while writing a checkpoint or the final model; nothing half-written
    is left, and the message names the path, the space it needed and the checkpoint that is intact
    (``oar.trainer.runs.disk_full_error``)."""


class SharedWriteError(OSError):
    """Another process failed writing a folder that every process writes (its own error says why;
    ``oar.trainer.strategy.Strategy.shared_atomic_dir``)."""


class OutputPathError(OSError):
    """An output path that cannot be a folder this process writes (an existing file, a path under a
    file, a read-only or otherwise unwritable file system); the message names it and what to do
    (:func:`check_output_folder`)."""


#: Prefix of the temporary file :func:`check_output_folder` creates (and removes) to learn whether
#: a folder can be written.
_WRITE_PROBE_PREFIX = ".oar-write-probe."


def check_output_folder(path: str | os.PathLike, *, what: str = "the output folder") -> None:
    """Check, before any work and without changing anything, that ``path`` is or can become a
    folder this process writes.

    The nearest existing folder on the way to ``path`` (``path`` itself when it exists) must be a
    folder, and a file must be creatable in it: a temporary file is made there and removed at once
    (it is the only reliable test; ``os.access`` says yes to root on file systems that refuse writes).

    Args:
        path: the folder an output goes into (it need not exist yet).
        what: what ``path`` is, for the message (``"--output"``).
    Raises:
        OutputPathError: ``path`` (or a folder on the way to it) is an existing file, or the folder
            cannot be written (read-only file system, permissions); naming the path and what to do.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"{path}: exists and is not a folder, so it cannot be {what}; move the file away "
                              f"or give another folder")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise OutputPathError(f"{path}: cannot be created as {what}: {existing} is a file, not a folder; "
                              f"give a path under a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=_WRITE_PROBE_PREFIX, dir=existing)
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise OutputPathError(f"{path}: cannot write there ({existing}: {reason}), so it cannot be {what}; "
                              f"give a folder on a writable file system") from None
    os.close(fd)
    os.unlink(probe)


#: Bytes of the little-endian length that starts a ``.safetensors`` file (its JSON header follows).
_SAFETENSORS_LENGTH_BYTES = 8


def safetensors_problem(path: str | os.PathLike) -> str | None:
    """Why the ``.safetensors`` file ``path`` cannot be loaded, or None when it is whole: its header
    must read as JSON and the file must have the size the header describes. Only the header is read.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(_SAFETENSORS_LENGTH_BYTES)
        if len(head) < _SAFETENSORS_LENGTH_BYTES:
            return f"{size} bytes, shorter than a safetensors header: truncated"
        n = int.from_bytes(head, "little")
        if _SAFETENSORS_LENGTH_BYTES + n > size:
            return f"truncated: its header takes {n} bytes and the file has {size}"
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "its safetensors header is corrupt"
    expected = _SAFETENSORS_LENGTH_BYTES + n + end
    if expected != size:
        return f"{size} bytes where its header describes {expected}: {'truncated' if size < expected else 'corrupt'}"
    return None


LOCK_FILE = ".lock"


@contextlib.contextmanager
def exclusive_lock(folder: str | os.PathLike, *, purpose: str = "") -> Iterator[Path]:
    """Hold an exclusive, non-blocking lock on ``folder`` (``<folder>/.lock``) for the block.

    The lock is an ``flock`` on the file, so the operating system releases it when the holder
    exits, however it exits (a ``kill -9`` leaves no stale lock). The file records the holder
    (pid, host, start time, ``purpose``) so a second process can name it.

    Raises:
        FolderLockedError: at once when another process holds the lock, naming the holder.
    """
    import datetime
    import fcntl
    import socket

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK_FILE
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock.read_text(encoding="utf-8", errors="replace").strip() or "an unknown process"
            raise FolderLockedError(f"{folder} is in use by {holder}; wait for it to finish or use another folder") from None
        stamp = datetime.datetime.now().isoformat(timespec="seconds")
        info = f"pid {os.getpid()} on {socket.gethostname()} since {stamp}" + (f" ({purpose})" if purpose else "")
        os.ftruncate(fd, 0)
        os.pwrite(fd, info.encode(), 0)
        yield lock
    finally:
        os.close(fd)  # releases the flock


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
    """Append one JSON line and flush it to disk (for streaming logs such as metrics.jsonl).

    A write that fails (a full disk) cuts the file back to its previous end, so no half line is
    left for :func:`read_jsonl` to trip over; the error is raised.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(row, default=_json_default) + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        end = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError:
            os.ftruncate(fd, end)
            raise
    finally:
        os.close(fd)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSON-lines file; a malformed line (bad JSON, not an object, not UTF-8) raises
    ValueError naming the file and line."""
    out = []
    # surrogateescape: a byte that is not UTF-8 becomes a lone surrogate, found (with its line) below
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        for lineno, line in enumerate(f, 1):
            if not line.isascii():
                try:
                    line.encode("utf-8")
                except UnicodeEncodeError as e:
                    byte = ord(line[e.start]) - 0xDC00
                    raise ValueError(
                        f"{path}:{lineno}: not valid UTF-8 (byte {byte:#04x} at column {e.start + 1}); "
                        f"re-encode the file as UTF-8"
                    ) from None
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


def read_recorded_json(path: str | os.PathLike) -> dict | None:
    """A summary this pipeline wrote earlier (a JSON object), or None where it is missing, unreadable
    or not an object: the caller then writes it afresh (a cached evaluation, a run's summary)."""
    try:
        recorded = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded, dict) else None


_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_digest(path: str | os.PathLike) -> str:
    """``sha256`` of a file's content (hex), cached per process by (path, size, mtime)."""
    import hashlib

    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def folder_digest(folder: str | os.PathLike, patterns: Iterable[str]) -> str:
    """``sha256`` over the names and contents of the files directly in ``folder`` that match any of
    ``patterns`` (``fnmatch`` globs), in sorted order.

    Raises:
        FileNotFoundError: if no file matches.
    """
    import fnmatch
    import hashlib

    folder = Path(folder)
    pats = list(patterns)
    names = sorted(p.name for p in folder.iterdir() if p.is_file() and any(fnmatch.fnmatch(p.name, g) for g in pats))
    if not names:
        raise FileNotFoundError(f"{folder}: no file matching {pats}")
    h = hashlib.sha256()
    for name in names:
        h.update(f"{name}\0{file_digest(folder / name)}\n".encode())
    return h.hexdigest()


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


def free_bytes(path: str | Path) -> int:
    """Free bytes on the file system of ``path`` (or of its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def format_bytes(n: float) -> str:
    """``1.5 GiB``, ``320 KiB``: a size for a message."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
