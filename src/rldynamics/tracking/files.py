"""Writing the files of a run directory: never through a symbolic link, whole files atomically.

A run directory may hold links its writers did not make (left by a copy tool, by mistake, or by someone else on
a shared machine). `open(path, "w")` follows a link and overwrites whatever it points to, outside the run. Every
writer of a run directory (the lock, the JSONL logs, `config.yaml`, the analysis artefacts and gradient dumps,
the checkpoints, the figures and the report) therefore writes through this module:

- a link where a file is to be written is refused before anything is written: `LinkRefused`, an OSError whose
  one line names the link, where it points and what to do;
- whole files (`write_file`, `replacing`) are written to a temporary sibling created exclusively (`O_EXCL`: never
  an existing file or link) and renamed over the target, so a kill leaves the old file or the new one;
- appends (`append_file`) and the lock (`open_file`) are opened with `O_NOFOLLOW`;
- `remove` deletes a link itself, never what it points to.

The rule is about files: the directories on the way may be links (a run directory, or its `checkpoints/`, on
another disk). A failed write names its file (a full disk is `[Errno 28] No space left on device: '<file>'`).
This module imports nothing of the project (plots and sweeps use it too).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO


class LinkRefused(OSError):
    """A symbolic link stands where a run file is to be written."""


def refuse_link(path: str | Path) -> None:
    """Raise LinkRefused if `path` is a symbolic link (dangling or not)."""
    if os.path.islink(path):
        raise LinkRefused(f"{path} is a symbolic link (to {os.readlink(path)}); rldynamics never writes through a "
                          "link: remove it (or replace it with the file itself) and run again")


def open_file(path: str | Path, flags: int, mode: int = 0o644) -> int:
    """`os.open` that never follows a link at `path` (LinkRefused instead); returns the descriptor."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(path):
            refuse_link(path)
        raise


def append_file(path: str | Path, data: bytes) -> None:
    """Append `data` to `path` (created if absent) in one write; never through a link."""
    fd = open_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    except OSError as e:
        raise _named(e, path) from None
    finally:
        os.close(fd)


@contextmanager
def replacing(path: str | Path, mode: str = "wb", sync: bool = False) -> Iterator[IO]:
    """A file object whose content replaces `path` when the block ends without an error (nothing changes otherwise).

    It writes to `.<name>.tmp` beside `path`, created exclusively (a leftover of a kill, or a link, is removed
    first), then renames it over `path`; `sync` flushes it to disk before the rename. A link at `path` is refused
    before anything is written."""
    path = Path(path)
    refuse_link(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with open(fd, mode, **({} if "b" in mode else {"encoding": "utf-8", "newline": ""})) as f:
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise _named(e, path) from None
        raise


def write_file(path: str | Path, data: bytes | str) -> Path:
    """Replace `path` with `data` (text is UTF-8) atomically, never through a link; returns the path."""
    with replacing(path, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


def remove(path: str | Path) -> None:
    """Delete `path`: a link (to anything) or a file is unlinked, a directory removed with its content."""
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
    else:
        shutil.rmtree(path)


def _named(error: OSError, path: str | Path) -> OSError:
    """`error` with the file it concerns in its message (a failed write often names none)."""
    if error.filename is not None or error.errno is None or isinstance(error, LinkRefused):
        return error
    return OSError(error.errno, error.strerror, str(path))


def sha256_file(path: str | Path) -> str:
    """The hex SHA-256 of a file's bytes, read in blocks (checkpoint manifests, model cache keys)."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
