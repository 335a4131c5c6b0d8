"""One run per output folder at a time: an OS lock held by the running process, not a marker file.

A recipe command locks ``<output>.lock``, a file beside its output folder (the
folder itself is renamed when a run publishes its result), with
``fcntl.flock``. The kernel releases a ``flock`` when the process holding it
ends for any reason (SIGKILL and a power cut included), so a dead run never
blocks the next one; the file's content (pid, command, start time) only names
the holder in the one-line refusal a second run gets. The holder removes the
file when it finishes. POSIX only: where ``fcntl`` is missing (Windows) runs
are not locked, and the command says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from .recipes import RecipeError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None


def lock_path(folder: str) -> str:
    return os.path.abspath(folder).rstrip(os.sep) + ".lock"


def holder(fd: int) -> str:
    """``pid N (command, since HH:MM:SS)`` from a lock file's content, as far as it can be read."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    since = time.strftime("%H:%M:%S", time.localtime(info["started"])) if "started" in info else "?"
    return f"pid {info.get('pid', '?')} ({info.get('command', '?')}, since {since})"


def missing_folders(path: str) -> list[str]:
    """The ancestors of ``path`` that do not exist yet, deepest first."""
    out = []
    folder = os.path.dirname(os.path.abspath(path))
    while folder and not os.path.exists(folder):
        out.append(folder)
        folder = os.path.dirname(folder)
    return out


def remove_empty(folders: list[str]) -> None:
    for folder in folders:  # deepest first
        try:
            os.rmdir(folder)
        except OSError:  # not empty (another run wrote there meanwhile), or gone
            return


@contextlib.contextmanager
def output_lock(folder: str, what: str):
    """Hold the lock of output ``folder`` for the ``with`` block; :class:`RecipeError` at once if another run holds it.

    ``what`` (e.g. ``"train default"``) names this run in a refused run's message.
    """
    if fcntl is None:
        print(f"hf-sparsemax: note: no fcntl on this system, {folder} is not locked against a second run", flush=True)
        yield
        return
    path = lock_path(folder)
    created = missing_folders(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = holder(fd)
            os.close(fd)
            raise RecipeError(f"output folder {folder} is in use by another run, {other}: wait for it to finish "
                              "or choose another --output") from None
        try:  # the previous holder may have removed the file between our open and flock: lock the current one
            current = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        info = {"pid": os.getpid(), "command": f"hf-sparsemax {what}", "started": time.time()}
        os.pwrite(fd, json.dumps(info).encode(), 0)
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # while still holding the lock (a waiting opener then retries on a fresh file)
        os.close(fd)
        remove_empty(created)
