"""Atomic file and directory writes: a crash leaves the old version or the new one, never a torn one.

Owns: the one way this project replaces a file (``atomic_write_bytes`` / ``atomic_write_text``: a
temp file in the same directory, fsync, ``os.replace``, fsync of the directory) and a directory
(``staging_dir``: fill a temp directory next to the final one, fsync its files, rename it into
place). Must not touch: what is written (formats belong to their modules), locking between
writers (the rename is the only arbiter), the network.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename inside `directory` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, fsync: bool = True) -> None:
    """Replace `path` with `data` atomically; with `fsync` (default) the new file and the rename are
    on disk when this returns. The temp file is unique per writer and removed on any error."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; readers on a shared volume must read it
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str, *, fsync: bool = True, encoding: str = "utf-8") -> None:
    """atomic_write_bytes of `text` encoded (UTF-8 by default)."""
    atomic_write_bytes(path, text.encode(encoding), fsync=fsync)


@contextmanager
def staging_dir(final: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temp dir next to `final`; on success it becomes `final` by os.replace (atomic rename).

    Files are fsynced first, then the parent directory after the rename. Without `overwrite`, an
    existing `final` raises FileExistsError, before the body runs or, when another writer created
    it meanwhile, at the rename. With `overwrite`, an existing `final` is swapped out and deleted
    (put back if the swap fails). On any error the temp dir is removed and `final` is left as it was.
    """
    final = Path(final)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final} exists; versions are immutable (overwrite=True replaces it)")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes 0700; servers on a shared registry must read it
    try:
        yield tmp
        for p in tmp.rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        if final.exists() and overwrite:  # move the old one aside, swap in the new one, then delete the old
            old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
            os.replace(final, old)
            try:
                os.replace(tmp, final)
            except OSError:
                os.replace(old, final)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            if final.exists():  # another writer won the race while the body ran
                raise FileExistsError(f"{final} appeared while writing; versions are immutable")
            try:
                os.replace(tmp, final)
            except OSError as e:  # created between the check and the rename (a non-empty directory)
                raise FileExistsError(f"{final} appeared while writing; versions are immutable") from e
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


__all__ = ["atomic_write_bytes", "atomic_write_text", "fsync_dir", "staging_dir"]
