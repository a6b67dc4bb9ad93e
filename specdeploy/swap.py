"""Replacing a bundle folder so that it is never lost: a lock, an atomic exchange, and leftovers.

An export builds the new bundle in `.NAME.partial-*` beside NAME and, holding `.NAME.lock` (a
POSIX flock, the file deleted on release), swaps it into place. On Linux the swap is one renameat2(RENAME_EXCHANGE) call: at every instant
NAME is the old bundle or the new one, and the old one ends up inside the partial folder, which
is then deleted. Where the exchange is not available (another OS, some network file systems) it
is two renames, NAME -> `.NAME.old-*` then the new one -> NAME; a crash between them leaves NAME
missing, and the next export or load renames the old bundle back. Leftover partial and old
folders are deleted by the next export to the same NAME (under the lock, so never a live one).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import errno
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Iterator

from .errors import SpecdeployError
from .manifest import MANIFEST_NAME
from .manifest_rules import read_manifest_file

PARTIAL, OLD = ".partial-", ".old-"
_AT_FDCWD, _RENAME_NOREPLACE, _RENAME_EXCHANGE = -100, 1, 2
# Linux's inode flags (ioctl FS_IOC_GETFLAGS): an immutable or append-only folder cannot be renamed, nor
# its entries changed, even by root.
_FS_IOC_GETFLAGS, _IMMUTABLE, _APPEND_ONLY = 0x80086601, 0x10, 0x20


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


@contextlib.contextmanager
def bundle_lock(out: Path, on_wait: Callable[[str], None] | None = None, timeout: float = -1) -> Iterator[None]:
    """Hold `.NAME.lock` beside out: one export (or recovery) per bundle path at a time.

    A second holder waits (on_wait is told once) up to timeout seconds (-1: for as long as it
    takes). The lock file exists only while held: the holder deletes it before letting go, and a
    waiter that then wins the lock on the deleted file sees it is no longer the one at the path
    and tries again (so two holders can never both believe they hold it)."""
    path = lock_path(out)
    deadline = None if timeout < 0 else time.monotonic() + timeout
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise SpecdeployError(f"cannot create the lock file {path}: {exc.strerror or exc}") from None
        try:
            if not _try_lock(fd, blocking=False):
                if on_wait is not None:
                    on_wait(f"another export to {out} is running; waiting for it to finish")
                    on_wait = None
                while not _try_lock(fd, blocking=deadline is None):
                    if time.monotonic() >= deadline:
                        raise SpecdeployError(f"another export to {out} holds {path}; try again when it has finished")
                    time.sleep(0.1)
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            break
        os.close(fd)  # won the lock on a file its last holder had deleted: try the one at the path now
    try:
        yield
    finally:
        os.unlink(path)  # while still held: see the docstring
        os.close(fd)


def _try_lock(fd: int, blocking: bool) -> bool:
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def leftovers(out: Path) -> list[Path]:
    """Partial and old folders an interrupted export to out left beside it: exactly the names this module
    gives them (`.NAME.partial-` and mkdtemp's suffix, `.NAME.old-` and a timestamp), never another
    bundle's (`.NAME.old-1.partial-x` is the work folder of an export to `NAME.old-1`)."""
    own = re.compile(rf"\.{re.escape(out.name)}({re.escape(PARTIAL)}[a-z0-9_]+|{re.escape(OLD)}[0-9]+)")
    if not out.parent.is_dir():
        return []
    return sorted(p for p in out.parent.iterdir() if own.fullmatch(p.name))


def clean_leftovers(out: Path) -> list[str]:
    """With the lock held: bring back an old bundle that lost its name, delete the other leftovers.

    Returns one line per action, for the caller to report."""
    actions = []
    old_bundle = lambda p: p.name.startswith(f".{out.name}{OLD}") and _is_bundle(p)  # noqa: E731
    if not os.path.lexists(out):  # a dangling symlink or a file at out is not replaced
        olds = [p for p in leftovers(out) if old_bundle(p)]
        if olds:
            try:
                os.rename(olds[-1], out)  # the newest: names sort by time
            except OSError as exc:
                raise SpecdeployError(f"cannot restore {out} from {olds[-1].name}: {exc}") from None
            actions.append(f"restored {out} from {olds[-1].name} (an export was interrupted while replacing it)")
    keep_olds = not _is_bundle(out)  # an old bundle is deleted only once out holds a bundle again
    for path in leftovers(out):
        if keep_olds and old_bundle(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        actions.append(f"removed {path.name}, left by an interrupted export")
    return actions


def recover_missing(out: Path) -> bool:
    """out is missing: if an interrupted replacement left the old bundle aside, put it back. True if it did."""
    out = Path(out).expanduser().absolute()
    if not any(p.name.startswith(f".{out.name}{OLD}") for p in leftovers(out)):
        return False
    try:
        with bundle_lock(out, timeout=0):
            clean_leftovers(out)
    except SpecdeployError:
        return False  # an export to out is running: it will put a bundle there
    return out.is_dir()


def check_movable(out: Path) -> None:
    """Fail now, before any work, where an existing `out` could not be moved aside for a new bundle: it or its
    folder is immutable or append-only (chattr +i / +a), or its folder is not writable."""
    for path in (out, out.parent):
        if _flags(path) & (_IMMUTABLE | _APPEND_ONLY):
            raise SpecdeployError(f"--out {out}: {path} is {'immutable' if _flags(path) & _IMMUTABLE else 'append-only'} "
                                  "(chattr), so it cannot be replaced; nothing was touched")
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise SpecdeployError(f"--out {out}: its folder {out.parent} is not writable; nothing was touched")


def _flags(path: Path) -> int:
    """The inode flags of path (0 where the file system keeps none, or not on Linux)."""
    import array
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0
    try:
        buffer = array.array("l", [0])
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, buffer)
        return buffer[0]
    except OSError:
        return 0
    finally:
        os.close(fd)


def replace(built: Path, out: Path) -> None:
    """Move the finished bundle built to out; an existing out (already checked to be a bundle) is
    exchanged with it atomically and left at built, for the caller to delete. Where out was absent,
    the move never replaces what appears there meanwhile (renameat2's RENAME_NOREPLACE)."""
    if not out.exists():
        if _renameat2(built, out, _RENAME_NOREPLACE) is None:
            os.rename(built, out)  # no renameat2 here: an empty folder that appeared is replaced, nothing else
        return
    if _exchange(built, out):
        return
    old = out.with_name(f".{out.name}{OLD}{datetime.datetime.now().strftime('%Y%m%d%H%M%S%f')}")
    try:
        os.rename(out, old)
    except OSError as exc:
        raise SpecdeployError(f"cannot move the old bundle at {out} aside: {exc.strerror}; nothing was replaced") from None
    os.rename(built, out)
    shutil.rmtree(old, ignore_errors=True)


def _exchange(first: Path, second: Path) -> bool:
    """renameat2(first, second, RENAME_EXCHANGE): both names swap in one step. False where unsupported."""
    try:
        return _renameat2(first, second, _RENAME_EXCHANGE) is not None
    except SpecdeployError:
        return False


def _renameat2(first: Path, second: Path, flags: int) -> bool | None:
    """renameat2(first, second, flags): True once done, None where this system or file system lacks it;
    SpecdeployError when the target is in the way (RENAME_NOREPLACE) or another error stops it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return None
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), flags) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return None
    if error == errno.EEXIST:
        raise SpecdeployError(f"--out {second} appeared while the export ran; nothing was replaced")
    raise SpecdeployError(f"cannot move the new bundle to {second}: {os.strerror(error)}")


def _is_bundle(path: Path) -> bool:
    return (path / MANIFEST_NAME).is_file()


def is_replaceable(out: Path) -> str | None:
    """None if --force may replace out (an empty folder, or a folder whose manifest parses as a
    specdeploy bundle's); otherwise why not, in words."""
    if out.is_symlink() or not out.is_dir():
        return "is not a folder" if not out.is_symlink() else "is a symbolic link"
    if not any(out.iterdir()):
        return None
    if not (out / MANIFEST_NAME).is_file():
        return f"is not a specdeploy bundle (no {MANIFEST_NAME})"
    try:
        read_manifest_file(out / MANIFEST_NAME)
    except SpecdeployError as exc:
        return f"does not hold a specdeploy bundle ({exc})"
    return None
