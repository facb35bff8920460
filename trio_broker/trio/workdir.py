"""Jobs' work folders: made fresh, locked while their job runs, swept once their owner is gone.

Every job runs in a folder of its own, ``<temp_dir>/trio-broker-work-XXXXXXXX``
(:data:`PREFIX`). The process that runs the job holds an exclusive ``flock`` on
the folder for as long as the job runs; the kernel drops it when that process
ends, however it ends (``kill -9`` included). So a folder nobody holds belongs to
no running job, and :func:`remove_stale` (run by an execserver when it starts,
and by its keeper when it is gone) removes exactly those: several execservers
may share one ``temp_dir`` without ever touching each other's folders, and no
sweep ever touches the folder of a job that runs.

Made and locked in this order, a folder cannot be swept between the two steps
without the maker noticing: it makes the folder, opens it, takes the lock, then
checks that the path still names the folder it locked (a sweeper that got there
first removed it); if not, it tries again with a new name.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from typing import Final

__all__ = ["PREFIX", "WorkDir", "remove_stale"]

PREFIX: Final = "trio-broker-work-"
"""Only folders named so are ever swept. Earlier versions named their folders
``trio-broker-job-…`` and held no lock: a sweep leaves those alone, since one of
them may belong to an older execserver that still runs."""
_ATTEMPTS: Final = 5
_OPEN_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class WorkDir:
    """One job's work folder, locked until :meth:`remove`.

    Attributes:
        path: the folder.
    """

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def create(cls, temp_dir: str | None, *, owner: tuple[int, int] | None = None) -> WorkDir:
        """Make, lock and (optionally) hand over a fresh folder.

        Args:
            temp_dir: the parent folder; ``None`` for the system's temporary folder.
            owner: ``(uid, gid)`` that the folder is given to (the user jobs run as).

        Raises:
            OSError: it cannot be made, locked or handed over.
        """
        for _ in range(_ATTEMPTS):
            path = tempfile.mkdtemp(prefix=PREFIX, dir=temp_dir)
            try:
                fd = os.open(path, _OPEN_FLAGS)
            except FileNotFoundError:  # swept already
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if not _same(path, fd):  # swept between the open and the lock
                    os.close(fd)
                    continue
                if owner is not None:
                    os.fchown(fd, *owner)
            except BlockingIOError:  # a sweeper holds it: it removes it
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                shutil.rmtree(path, ignore_errors=True)
                raise
            return cls(path, fd)
        raise OSError(f"cannot make a work folder in {temp_dir or tempfile.gettempdir()!r}")

    def remove(self) -> None:
        """Remove the folder and what is in it, then let go of the lock (blocking)."""
        if self._fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
        self._fd = None


def _same(path: str, fd: int) -> bool:
    try:
        here = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def remove_stale(temp_dir: str | None) -> list[str]:
    """Remove every work folder in ``temp_dir`` that no live process holds (blocking).

    Args:
        temp_dir: the parent folder; ``None`` for the system's temporary folder.

    Returns:
        The folders removed.
    """
    parent = temp_dir or tempfile.gettempdir()
    removed = []
    try:
        entries = [entry for entry in os.scandir(parent) if entry.name.startswith(PREFIX)]
    except OSError:
        return []
    for entry in entries:
        try:
            fd = os.open(entry.path, _OPEN_FLAGS)
        except OSError:  # gone, or not a folder
            continue
        try:
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if _same(entry.path, fd):
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed.append(entry.path)
        finally:
            os.close(fd)
    return removed
