"""Every filesystem write of a build or a shard set: checked, marked, and atomic.

partc replaces its output folder whole, so before anything is written it checks that the
folder is one it may replace: absent, empty, or a folder partc wrote, which carries a marker
file (`.partc-build.json`) listing every path partc put there and holds nothing else (but the
bytecode Python writes for those modules, `_is_bytecode`). The output may never be `/`, a
mount point, the working directory or one of its ancestors, a symbolic link (unless `force`,
see `destination`), or an input of the run (the checkpoint, the config, the family file, the
build being sharded) or a folder holding one. A refusal happens before any write.

The new folder is written beside the old one under a hidden scratch name, then swapped in with
one `renameat2(RENAME_EXCHANGE)`; where that call is missing, the old folder is first renamed
to a backup, the new one renamed into place, and the backup removed, so that a build or its
backup exists at every instant. A later write sweeps scratch folders of dead processes,
restoring a backup when the output itself is missing instead of deleting the only copy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import glob
import hashlib
import json
import os
import socket
import stat
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, BinaryIO

from partc import __version__
from partc.errors import MACHINE_ERRNOS, EmitError, MachineError
from partc.plan.ir import canonical_json

__all__ = ["MARKER", "OUTPUT_KINDS", "Marker", "check_output", "destination", "fitting_name",
           "read_marker", "sweep_abandoned", "write_atomically"]

MARKER = ".partc-build.json"
"""Name of the marker file partc writes into every build and shard set."""
OUTPUT_KINDS = {"build": "build", "shard": "shard set", "checkpoint": "merged checkpoint"}
"""Marker kinds and how messages name them."""
MAX_MARKER_BYTES = 4 << 20
"""Largest marker file partc reads (a 4096-rank build lists about 4100 paths)."""
_SHOWN = 5
"""How many offending names a refusal lists."""


@dataclass(frozen=True, slots=True)
class Marker:
    """The content of a `.partc-build.json`: what partc wrote into a folder."""

    kind: str
    """`build` or `shard`."""
    partc_version: str
    """Version of partc that wrote the folder."""
    files: tuple[str, ...]
    """Relative paths (with `/`) of every file partc wrote, sorted; the marker excluded."""

    def __post_init__(self) -> None:
        if self.kind not in OUTPUT_KINDS:
            raise ValueError(f"kind must be one of {sorted(OUTPUT_KINDS)}, found {self.kind!r}")
        for path in self.files:
            if not _plain_relative(path) or path == MARKER:
                raise ValueError(f"{path!r} is not a plain relative path inside the folder")
        if list(self.files) != sorted(set(self.files)):
            raise ValueError("files must be sorted and unique")

    def text(self) -> str:
        """The marker's canonical JSON text."""
        return canonical_json({"files": list(self.files), "kind": self.kind,
                               "partc_version": self.partc_version})


def _plain_relative(path: str) -> bool:
    """Whether `path` is a relative `/`-separated path with no empty, `.` or `..` part."""
    parts = path.split("/")
    return bool(path) and "\\" not in path and "\0" not in path and all(
        part not in ("", ".", "..") for part in parts)


def read_marker(folder: Path) -> Marker | str | None:
    """The marker of `folder`; a reason string when it is unreadable; None when it has none."""
    path = folder / MARKER
    try:
        info = path.lstat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot read it: {exc.strerror or exc}"
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_size > MAX_MARKER_BYTES:
        return f"it is {info.st_size} bytes, more than {MAX_MARKER_BYTES}"
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        return f"it is not valid JSON: {exc}"
    if not isinstance(data, dict) or set(data) != {"files", "kind", "partc_version"}:
        return "it must be an object with exactly files, kind and partc_version"
    files, kind, version = data["files"], data["kind"], data["partc_version"]
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files) \
            or not isinstance(kind, str) or not isinstance(version, str):
        return "files must be a list of strings, kind and partc_version strings"
    try:
        return Marker(kind=kind, partc_version=version, files=tuple(files))
    except ValueError as exc:
        return str(exc)


def _foreign_entries(folder: Path, marker: Marker | None) -> list[str]:
    """Entries of `folder` partc did not write: not in the marker (and not Python's bytecode
    cache). A foreign folder is listed once, as `name/`, and not entered."""
    files = {MARKER, *(marker.files if marker else ())}
    folders = {"/".join(f.split("/")[:i]) for f in files for i in range(1, f.count("/") + 1)}
    found: list[str] = []

    def walk(path: Path, prefix: str) -> None:
        with os.scandir(path) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                relative = prefix + entry.name
                if entry.is_symlink():
                    found.append(relative)
                elif entry.is_dir(follow_symlinks=False):
                    if relative in folders:
                        walk(Path(entry.path), relative + "/")
                    elif not (entry.name == "__pycache__"
                              and _bytecode_only(entry.path, prefix, files)):
                        found.append(relative + "/")
                elif not (entry.is_file(follow_symlinks=False) and relative in files):
                    found.append(relative)

    walk(folder, "")
    return found


def _bytecode_only(folder: str, prefix: str, files: set[str] | frozenset[str]) -> bool:
    """Whether the `__pycache__` folder at `folder` (beside the marked files under `prefix`)
    holds only what Python writes on import: the bytecode of those files (`_is_bytecode`)."""
    with os.scandir(folder) as entries:
        return all(_is_bytecode(e, prefix, files) for e in entries)


def _is_bytecode(entry: os.DirEntry[str], prefix: str, files: set[str] | frozenset[str]) -> bool:
    """Whether `entry` of a `__pycache__` folder is the bytecode Python wrote for a module partc
    wrote beside that folder: a regular file named `<module>.<tag>[.opt-N].pyc` for a marked
    `<prefix><module>.py`, starting with a bytecode magic number (two bytes and `\\r\\n`).
    Anything else there (a `.pyc` of no module partc wrote, or one that is not bytecode) is
    the user's, and a rewrite refuses to remove it."""
    if entry.is_symlink() or not entry.is_file(follow_symlinks=False):
        return False
    module, _, rest = entry.name.partition(".")
    if not rest.endswith(".pyc") or f"{prefix}{module}.py" not in files:
        return False
    try:
        with open(entry.path, "rb") as handle:
            magic = handle.read(4)
    except OSError:
        return False
    return len(magic) == 4 and magic[2:] == b"\r\n"


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")
    return f"{len(names)} {'entry' if len(names) == 1 else 'entries'} ({shown})"


def _refuse(given: Path, message: str) -> EmitError:
    """The refusal of output `given` (the message names it, as every output error does)."""
    return EmitError(message)


_REPLACES = "partc replaces its output folder whole"
_ONLY = "partc replaces only a new or empty folder, or one it wrote"


def destination(out: str | os.PathLike[str], *, kind: str,
                inputs: Sequence[tuple[str, str | os.PathLike[str]]] = (),
                force: bool = False) -> Path:
    """Where a write of `kind` to `out` goes (absolute, real parent), or EmitError.

    Refused: `/`, a mount point, the working directory or an ancestor of it, an input of the
    run or a folder holding one (`inputs`: (what, path) pairs), a path that is not a folder, and
    a symbolic link. With `force`, a link to an existing folder is written through: the
    link's target is replaced (when it is empty or a partc folder) and the link kept. Nothing
    is written by this check.
    """
    given = Path(out)
    text = os.fspath(out) or "."
    if "\0" in text:
        raise _refuse(given, "the output path contains a NUL character")
    stripped = text.rstrip("/") or "/"
    name = os.path.basename(stripped)
    if os.path.islink(stripped):
        target = Path(os.path.realpath(stripped))
        written = os.readlink(stripped)  # as the user wrote it: messages stay short
        if not force:
            raise _refuse(given, f"the output folder {given} is a symbolic link (to {written});"
                          " partc does not replace a link: name the folder itself, or pass "
                          "--force to write into the link's target and keep the link")
        if not target.is_dir():
            raise _refuse(given, f"the output folder {given} is a symbolic link to {written}, "
                          "which is not an existing folder; --force writes only into an "
                          "existing folder")
        where = target
    elif name in ("", ".", ".."):
        where = Path(os.path.realpath(stripped))
    else:
        where = Path(os.path.realpath(os.path.dirname(stripped) or ".")) / name
    if where == Path(where.anchor):
        raise _refuse(given, f"refusing to use the root folder {where} as the output folder: "
                      f"{_REPLACES}")
    cwd = Path(os.path.realpath(os.getcwd()))
    if where == cwd or where in cwd.parents:
        what = "is the working directory" if where == cwd else f"holds the working directory {cwd}"
        raise _refuse(given, f"the output folder {given} {what}; {_REPLACES}: name a new "
                      f"folder such as {given / 'build'}")
    for label, path in inputs:
        real = Path(os.path.realpath(path))
        if where == real or where in real.parents:
            what = "is" if where == real else "holds"
            raise _refuse(given, f"the output folder {given} {what} the {label} {path}; "
                          f"{_REPLACES}: name a new folder")
    if os.path.lexists(where):
        if not where.is_dir():
            raise _refuse(given, f"output path {given} exists and is not a folder")
        if os.path.ismount(where):
            raise _refuse(given, f"the output folder {given} is a mount point; {_REPLACES}: "
                          "name a folder inside it")
    return where


def _check_replaceable(where: Path, given: Path, kind: str, force: bool) -> bool:
    """Whether `where` exists (and may be replaced); EmitError when it may not."""
    if not os.path.lexists(where):
        return False
    linked = os.path.islink(os.fspath(given).rstrip("/") or "/")
    shown = f"{given} (-> {where})" if linked else str(given)
    marker = read_marker(where)
    try:
        foreign = _foreign_entries(where, marker if isinstance(marker, Marker) else None)
    except OSError as exc:
        raise _refuse(given, f"cannot list the output folder {shown}: "
                      f"{exc.strerror or exc}") from None
    if isinstance(marker, str):
        raise _refuse(given, f"the output folder {shown} has an invalid {MARKER} ({marker}); "
                      f"{_ONLY}: remove the folder yourself or name another")
    if marker is None and foreign:
        raise _refuse(given, f"the output folder {shown} is not empty and was not written by "
                      f"partc (no {MARKER}): it holds {_listing(foreign)}; {_ONLY}: name a new "
                      "folder, or empty this one yourself (a build of an older partc has no "
                      "marker: remove it by hand)")
    if foreign:
        raise _refuse(given, f"the output folder {shown} holds {_listing(foreign)} that partc "
                      f"did not write (they are not in its {MARKER}); partc never deletes "
                      "them: move them elsewhere or name another folder")
    if marker is not None and marker.kind != kind and not force:
        raise _refuse(given, f"the output folder {shown} holds a partc "
                      f"{OUTPUT_KINDS[marker.kind]}, not a {OUTPUT_KINDS[kind]}; name another "
                      f"folder, or pass --force to replace it")
    return True


def check_output(out: str | os.PathLike[str], *, kind: str,
                 inputs: Sequence[tuple[str, str | os.PathLike[str]]] = (),
                 force: bool = False) -> Path:
    """Refuse early (before long work) an output `write_atomically` would refuse; writes
    nothing. Returns where the write would go."""
    where = destination(out, kind=kind, inputs=inputs, force=force)
    _check_replaceable(where, Path(out), kind, force)
    return where


# ---------------------------------------------------------------- atomic replacement


@cache
def _renameat2() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError, TypeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                         ctypes.c_uint]
    return function


_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False if unsupported,
    OSError if the swap failed otherwise."""
    function = _renameat2()
    if function is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    result = function(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        return False
    raise OSError(code, os.strerror(code))


NAME_MAX = 255
"""Longest file name (bytes) on the file systems partc writes to (Linux's NAME_MAX)."""
_SCRATCH_SUFFIX = 8 + len("-new")
"""What follows a scratch prefix: mkdtemp's random letters, then `-new` when a swap is undone."""


def fitting_name(name: str, extra: int) -> str:
    """`name` when `extra` more bytes still fit in a file name; else the longest start of it
    that does, followed by `~` and 16 hex digits of its sha256 (so two long names that share
    their start still differ)."""
    encoded = os.fsencode(name)
    if len(encoded) + extra <= NAME_MAX:
        return name
    tag = "~" + hashlib.sha256(encoded).hexdigest()[:16]
    room = NAME_MAX - extra - len(tag)
    cut = name
    while cut and len(os.fsencode(cut)) > room:
        cut = cut[:-1]
    return cut + tag


def _scratch_prefix(out: Path, kind: str) -> str:
    """Name prefix of a scratch folder beside `out`: hidden, and naming the host and process
    that made it, so a later write can tell an abandoned one (its process is gone). A long
    output name is shortened (`fitting_name`) so that the scratch name stays a valid file
    name; the same output always gets the same prefix, which the sweep relies on."""
    host = "".join(c if c.isalnum() else "_" for c in socket.gethostname()) or "host"
    if len(host) > 64:  # a host name is at most 64 bytes on Linux; keep it short elsewhere too
        host = host[:47] + "_" + hashlib.sha256(host.encode()).hexdigest()[:16]
    # The room left for the name counts a pid of 10 digits (the most a 32-bit pid has): every
    # process must shorten a name the same way, or one could not find another's folders.
    room = len(f"..{kind}-{host}--") + 10 + _SCRATCH_SUFFIX
    return f".{fitting_name(out.name, room)}.{kind}-{host}-{os.getpid()}-"


def _abandoned(out: Path, kind: str) -> list[Path]:
    """Scratch folders of `kind` beside `out` whose process (on this host) is gone."""
    mine = _scratch_prefix(out, kind).rsplit("-", 2)[0] + "-"  # without pid
    found = []
    for entry in sorted(out.parent.glob(glob.escape(mine) + "*")):
        pid = entry.name[len(mine):].split("-", 1)[0]
        if pid.isdigit() and not entry.is_symlink() and entry.is_dir() and not _alive(int(pid)):
            found.append(entry)
    return found


def _only_partc(folder: Path) -> bool:
    """Whether `folder` holds nothing partc did not write: empty, or marked and holding only
    the marker's files."""
    marker = read_marker(folder)
    try:
        return not isinstance(marker, str) and not _foreign_entries(folder, marker)
    except OSError:
        return False


def _torn_marker_only(folder: Path) -> bool:
    """Whether `folder` holds its marker and nothing else, the marker unreadable: a write killed
    while it wrote the marker, its first file."""
    try:
        with os.scandir(folder) as entries:
            names = [(e.name, e.is_file(follow_symlinks=False)) for e in entries]
        return names == [(MARKER, True)] and isinstance(read_marker(folder), str)
    except OSError:
        return False


class _Foreign(Exception):
    """An entry the marker does not list: the removal stops there."""


def _remove_written(folder: Path) -> bool:
    """Remove a folder partc wrote, its marker last; returns whether the folder is gone.

    Only what the marker lists is removed (with Python's bytecode cache and the folders on the
    marker's paths); at anything else, or any error, the removal stops and keeps the marker. So
    a removal that is interrupted (a kill) or stopped leaves a folder that is still provably
    partc's: its marker and a part of its files, or nothing at all, which the next
    `sweep_abandoned` recognises and finishes. (shutil.rmtree removes entries in the folder's
    order and may take the marker first, leaving unmarked files no sweep may touch.)
    """
    marker = read_marker(folder)
    torn = isinstance(marker, str)
    files = set(marker.files) if isinstance(marker, Marker) else set()
    folders = {"/".join(f.split("/")[:i]) for f in files for i in range(1, f.count("/") + 1)}

    def clear(path: str, prefix: str) -> None:
        with os.scandir(path) as found:
            entries = sorted(found, key=lambda e: e.name)
        for entry in entries:
            relative = prefix + entry.name
            if relative == MARKER:
                continue
            if entry.is_dir(follow_symlinks=False):
                if relative in folders:
                    clear(entry.path, relative + "/")
                elif entry.name == "__pycache__":
                    clear_bytecode(entry.path, prefix)
                else:
                    raise _Foreign(relative)
                os.rmdir(entry.path)
            elif entry.is_file(follow_symlinks=False) and relative in files and not torn:
                os.unlink(entry.path)
            else:
                raise _Foreign(relative)

    def clear_bytecode(path: str, prefix: str) -> None:
        with os.scandir(path) as found:
            entries = sorted(found, key=lambda e: e.name)
        for entry in entries:
            if torn or not _is_bytecode(entry, prefix, files):
                raise _Foreign(f"{prefix}__pycache__/{entry.name}")
            os.unlink(entry.path)

    try:
        clear(os.fspath(folder), "")
        if marker is not None:
            os.unlink(folder / MARKER)
        os.rmdir(folder)
    except (OSError, _Foreign):
        return False
    return True


def sweep_abandoned(out: Path) -> None:
    """Clean up after writes to `out` that were killed: scratch folders of dead processes.

    When `out` is missing and a dead process left a backup of it (killed between the two
    renames of the fallback swap), the newest backup is renamed back to `out`. Other
    abandoned folders are removed only when they hold nothing partc did not write (what is
    left of a removal that was itself killed included, see `_remove_written`); folders of
    live processes or other hosts are never touched.
    """
    backups = [p for p in _abandoned(out, "old") if _only_partc(p)]
    if backups and not os.path.lexists(out):
        newest = max(backups, key=lambda p: p.stat().st_mtime_ns)
        os.rename(newest, out)
        _fsync_folder(out.parent)
        backups.remove(newest)
    for entry in backups + _abandoned(out, "partc"):
        if _only_partc(entry) or _torn_marker_only(entry):
            _remove_written(entry)


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (on this host)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's process, or not a pid we can ask about: keep its folder
    return True


def _fsync_folder(folder: Path) -> None:
    """Flush a folder's entries (the renames in it) to disk, where the platform allows."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _write_file(path: Path, content: str | Callable[[BinaryIO], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        if callable(content):
            content(handle)
        else:
            handle.write(content.encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())


def _swap_in(staging: Path, where: Path, parent: Path) -> Path:
    """Put `staging` at `where`, whose old folder is returned under a scratch name.

    Without RENAME_EXCHANGE: old -> backup, staging -> where; the old folder is renamed back
    if the second rename fails. A kill between the two leaves the backup for the next
    `sweep_abandoned`.
    """
    if _exchange(staging, where):
        return staging
    backup = Path(tempfile.mkdtemp(prefix=_scratch_prefix(where, "old"), dir=parent))
    backup.rmdir()
    os.rename(where, backup)
    try:
        os.rename(staging, where)
    except BaseException:
        os.rename(backup, where)
        raise
    return backup


def _remove_folders(created: Sequence[Path]) -> None:
    """Remove the missing parents a failed write created (innermost first), each only while
    it is empty: a folder something else has put an entry into meanwhile stays."""
    for folder in created:
        try:
            os.rmdir(folder)
        except FileNotFoundError:
            continue  # never made: the mkdir failed below it
        except OSError:
            return


def write_atomically(out: str | os.PathLike[str],
                     files: Mapping[str, str | Callable[[BinaryIO], None]], *, kind: str,
                     inputs: Sequence[tuple[str, str | os.PathLike[str]]] = (),
                     force: bool = False) -> Path:
    """Write `files` and a marker into a fresh folder, then replace `out` with it in one step.

    A value is the text of the file, or a function that streams its bytes into the open file;
    files are written in the mapping's order (the marker first). `out` is checked first (see
    `destination`): a refusal writes nothing. Missing parent folders of `out` are created (as
    `mkdir -p` does) and removed again if the write fails. A crash at any point leaves the
    previous folder or the new one, never a mixture; returns the folder written (a link's
    target with `force`).
    """
    given = Path(out)
    where = destination(given, kind=kind, inputs=inputs, force=force)
    parent = where.parent
    try:
        if parent.is_dir():
            sweep_abandoned(where)
    except OSError as exc:
        raise _refuse(given, f"cannot clean up an earlier write beside {given}: "
                      f"{exc.strerror or exc}") from None
    existed = _check_replaceable(where, given, kind, force)
    marker = Marker(kind=kind, partc_version=__version__, files=tuple(sorted(files)))
    created = [p for p in (parent, *parent.parents) if not os.path.lexists(p)]
    try:
        parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=_scratch_prefix(where, "partc"), dir=parent))
    except OSError as exc:
        _remove_folders(created)
        up = given.parent
        blocking = next((p for p in (up, *up.parents) if p.exists() and not p.is_dir()), None)
        reason = (f"{blocking} exists and is not a folder" if blocking is not None
                  else exc.strerror or str(exc))
        # an existing output is replaced by a new folder written beside it, in its parent
        what = (f"cannot write the {OUTPUT_KINDS[kind]} to {given} (partc writes the new "
                f"folder beside it, in {parent})" if existed else
                f"cannot create the output folder {given}")
        error = MachineError if blocking is None and exc.errno in MACHINE_ERRNOS else EmitError
        raise error(f"{what}: {reason}") from None
    try:
        _write_file(staging / MARKER, marker.text())  # first: a partial staging is partc's
        for relative, content in files.items():
            _write_file(staging / relative, content)
        os.chmod(staging, 0o755)
        if not existed:
            try:
                os.rename(staging, where)
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not os.path.lexists(where):
                    raise
                raise _refuse(given, f"the output folder {given} was created by another writer "
                              "(another partc run?) while partc wrote; that writer won, its "
                              "folder was left as it is and nothing of this run was kept; run "
                              "again to replace it") from None
            _fsync_folder(parent)
            return where
        old = _swap_in(staging, where, parent)
        _fsync_folder(parent)
        staging = old
        if not _only_partc(old):
            # Something was added to the old folder after it was checked: put it back.
            if not _exchange(old, where):
                os.rename(where, Path(str(staging) + "-new"))
                staging = Path(str(staging) + "-new")
                os.rename(old, where)
            raise _refuse(given, f"the output folder {given} changed while partc wrote (it "
                          "now holds files partc did not write); it was left as it was")
    except OSError as exc:
        _remove_written(staging)
        _remove_folders(created)
        error = MachineError if exc.errno in MACHINE_ERRNOS else EmitError
        raise error(f"cannot write the {OUTPUT_KINDS[kind]} to {given}: "
                    f"{exc.strerror or exc}") from None
    except BaseException:
        _remove_written(staging)
        _remove_folders(created)
        raise
    _remove_written(staging)
    return where
