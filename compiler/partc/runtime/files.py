"""Checkpoint files on disk: opened only when regular, read exactly, stamped to notice a later
change, and followed through symbolic links only within the checkpoint (the runtime's headers,
checkpoint and reader modules use these; nothing here parses a header).

Paths are `str` throughout the runtime, spelled as `pathlib` would spell them (`spelled`):
importing pathlib costs 5-8 ms after numpy here (it brings urllib.parse, ipaddress, fnmatch and
ntpath), a sixth of what the runtime adds to numpy's import (issue 18), and a load never needs it.
"""

from __future__ import annotations

import os
import stat
from contextlib import suppress
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

from partc.errors import CheckpointError, SourceLocation

if TYPE_CHECKING:
    from hashlib import _Hash


def sha256(data: bytes = b"") -> _Hash:
    """A sha256 hash object (hashlib's interface) for headers and tensor lists (KiB to MiB).

    CPython's builtin sha256 module, where present: hashlib loads OpenSSL when imported (~3 ms
    here, a tenth of the runtime's import cost) and every load hashes its headers. Payload
    digests, large and hashed on several threads, use hashlib itself (`partc.runtime.digests`).
    """
    if not _SHA256:
        import importlib

        for name in ("_sha256", "_sha2"):  # CPython 3.11; 3.12 and later
            try:
                _SHA256.append(importlib.import_module(name).sha256)
                break
            except (ImportError, AttributeError):
                continue
        else:
            from hashlib import sha256 as found

            _SHA256.append(found)
    made: _Hash = _SHA256[0](data)
    return made


_SHA256: list[Any] = []
"""The sha256 constructor `sha256` uses, once found."""


def spelled(path: str | os.PathLike[str]) -> str:
    """`path` as a str spelled as `str(pathlib.PurePosixPath(path))` spells it: repeated and
    trailing separators and `.` components dropped, `..` kept (unlike os.path.normpath, which
    would change what a path through a symbolic link names), `.` for the empty path."""
    lead, parts = _parts(path)
    return lead + os.sep.join(parts) or "."


def path_text(value: object) -> str | bytes | None:
    """`os.fspath(value)`: the text of a str, bytes or os.PathLike; None for anything else."""
    try:
        return os.fspath(value)  # type: ignore[call-overload, no-any-return]
    except TypeError:
        return None


def _parts(path: str | os.PathLike[str]) -> tuple[str, list[str]]:
    """pathlib's reading of a path: its root ('', the separator, or exactly two of them, which
    POSIX leaves to the system) and its components without empty and `.` ones."""
    text = path_text(path)
    if not isinstance(text, str):
        raise CheckpointError(f"a path must be a str or an os.PathLike giving one, found "
                              f"{type(path).__name__} {path!r:.80}")
    if os.altsep:
        text = text.replace(os.altsep, os.sep)
    sep = os.sep
    lead = (sep * 2 if text.startswith(sep * 2) and not text.startswith(sep * 3)
            else sep if text.startswith(sep) else "")
    return lead, [part for part in text.split(sep) if part and part != "."]


def join(folder: str, name: str) -> str:
    """`name` inside `folder` (a `spelled` path), spelled as pathlib's `folder / name`."""
    return name if folder == "." else os.path.join(folder, name)


def parent(path: str) -> str:
    """The folder holding `path` (a `spelled` path), as pathlib's `Path(path).parent`."""
    return os.path.dirname(path) or "."


def is_within(path: str, root: str) -> bool:
    """Whether `path` is `root` or lies under it, component by component, as
    `PurePosixPath(path).is_relative_to(root)` (`/a/bc` is not within `/a/b`; everything
    absolute is within `/`; a relative path is never within an absolute one)."""
    (lead, parts), (root_lead, root_parts) = _parts(path), _parts(root)
    return lead == root_lead and parts[:len(root_parts)] == root_parts


def _fail(path: str | os.PathLike[str], message: str) -> NoReturn:
    """Raise a CheckpointError located at `path`."""
    raise CheckpointError(message, location=SourceLocation(str(path)))


class FileStamp(NamedTuple):
    """What identifies a file's contents when its header was read (device, inode, size,
    modification time); a different stamp means the file changed or was replaced."""

    device: int
    """st_dev."""
    inode: int
    """st_ino."""
    size: int
    """st_size."""
    mtime_ns: int
    """st_mtime_ns."""

    @classmethod
    def of(cls, st: os.stat_result) -> FileStamp:
        """The stamp of a stat result."""
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
"""Flags for opening checkpoint files: O_NONBLOCK so that a FIFO never blocks the open (its
fstat then refuses it); no effect on regular files."""


def open_regular(path: str, what: str = "checkpoint file") -> tuple[int, os.stat_result]:
    """Open `path` read-only and fstat it; CheckpointError unless it is a regular file."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        with suppress(OSError):  # a socket cannot be opened (ENXIO): say what it is
            mode = os.stat(path).st_mode
            if not stat.S_ISREG(mode):
                _fail(path, f"{what} is not a regular file (found {file_kind(mode)})")
        _fail(path, f"cannot open {what}: {exc.strerror or exc}")
    try:
        st = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        _fail(path, f"cannot read {what}: {exc.strerror or exc}")
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        _fail(path, f"{what} is not a regular file (found {file_kind(st.st_mode)})")
    return fd, st


def no_readahead(fd: int) -> None:
    """Tell the kernel reads of `fd` are random: a cold read then fetches the pages it asks for,
    not a readahead window (8 MiB on the disks this runs on) of the neighbouring tensors (other
    ranks' columns) or, for a header, of the data behind it. Large reads still go to storage in
    large requests; only the speculative window is dropped."""
    if hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_RANDOM"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except OSError:  # advice only (e.g. a FIFO or a file system that refuses it)
            pass


def file_kind(mode: int) -> str:
    """Words for the kind of file of an st_mode."""
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISLNK, "a symbolic link"))
    return next((words for test, words in kinds if test(mode)), "an unknown kind of file")


def read_exactly(fd: int, path: str, offset: int, n: int, what: str) -> bytes:
    """`n` bytes at `offset`, or CheckpointError (a file that shrank, an I/O error)."""
    parts: list[bytes] = []
    got = 0
    try:
        while got < n:
            part = os.pread(fd, n - got, offset + got)
            if not part:
                break
            parts.append(part)
            got += len(part)
    except OSError as exc:
        _fail(path, f"cannot read {what}: {exc.strerror or exc}")
    if got != n:
        _fail(path, f"truncated file: {what} of {n} bytes but only {got} could be read "
                    "(file changed while being read?)")
    return parts[0] if len(parts) == 1 else b"".join(parts)


def stat_or_none(path: str, what: str) -> os.stat_result | None:
    """os.stat of `path` (links followed); None when nothing is there; CheckpointError when it
    cannot be examined (permission denied, a loop of links)."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        _fail(path, f"cannot examine {what}: {exc.strerror or exc}")


def present(path: str, what: str) -> bool:
    """Whether anything (a dangling link included) is at `path`; CheckpointError when that
    cannot be told (permission denied)."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        _fail(path, f"cannot examine {what}: {exc.strerror or exc}")
    return True


def trusted_roots(folder: str) -> tuple[str, ...]:
    """Where a checkpoint file's symbolic link may lead: the folder itself and, for a Hugging
    Face cache snapshot (`<repo>/snapshots/<rev>/`), that repository's `blobs/` folder (real
    paths, as str)."""
    real = os.path.realpath(folder)
    snapshots = os.path.dirname(real)
    if os.path.basename(snapshots) == "snapshots":
        return real, os.path.join(os.path.dirname(snapshots), "blobs")
    return (real,)


def checked_member(folder: str, path: str, what: str) -> str:
    """`path` (a file of the checkpoint in `folder`), checked against the symbolic-link policy.

    A link is followed only when it resolves inside `trusted_roots(folder)`; anything else
    names the link and its target. A file that is not a link is returned as it is.
    """
    try:
        if not stat.S_ISLNK(os.lstat(path).st_mode):
            return path
        target = os.readlink(path)
    except (FileNotFoundError, NotADirectoryError):
        return path
    except OSError as exc:
        _fail(path, f"cannot examine {what}: {exc.strerror or exc}")
    real = os.path.realpath(path)
    name = os.path.basename(path)
    if not present(real, what):
        _fail(path, f"{what} {name} is a symbolic link to {target}, which does not exist")
    roots = trusted_roots(folder)
    if not any(is_within(real, root) for root in roots):
        where = " or ".join(roots)
        _fail(path, f"{what} {name} is a symbolic link to {target} (resolving to {real}), "
                    f"outside {where}; partc follows links only within the checkpoint folder "
                    "and its Hugging Face cache blobs/ folder")
    return path
