"""Building and loading the fused CPU kernel (:download:`fused.c`): a cache only the user can write.

The kernel is compiled on first use with the system's C compiler (``$CC``, split as a command line, default
``cc``; ``-O3 -march=native``, OpenMP where the compiler has it) and loaded with ``ctypes``. The library is
cached under a name that hashes everything it depends on: the C source, the generated parameter header (the
struct both sides share, :mod:`.fused`), the flags, the compiler's version and what ``-march=native`` compiles
for (x86 ``model name`` and ``flags``; Arm ``Features``, ``CPU implementer``, ``CPU part``...), so two machines
sharing a home never load each other's build.

The cache folder is ``$HF_SPARSEMAX_CACHE``, else ``$XDG_CACHE_HOME/hf_sparsemax``, else
``~/.cache/hf_sparsemax``. A library is code run in the user's process, so:

- a folder is used only if it is owned by the user (or root, for a folder built ahead of time into an image)
  and writable by no one else; otherwise one warning, and a private folder (``mkdtemp``) for this process;
- a library file is loaded only if ``lstat`` finds a regular file (not a link), owned by the user or root,
  writable by no one else;
- a new build is compiled under a temporary name and published with ``os.link``, which never replaces a file:
  where another process published first (``EEXIST``), its library is used, so a library another process (or
  host, over NFS) has mapped is never overwritten.

``hf-sparsemax build-kernels`` (or ``python -m hf_sparsemax.attention.cpu.fused``, :func:`.fused.main`) builds
ahead of time, for container images and read-only homes: point ``HF_SPARSEMAX_CACHE`` at a folder, build
there once, and processes after load it (a folder they cannot write is fine).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import warnings

SOURCE = os.path.join(os.path.dirname(__file__), "fused.c")
HEADER = "hf_sparsemax_params.h"  # generated from fused.Params, included by fused.c
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c11")
OPENMP = ("-fopenmp",)
# /proc/cpuinfo fields that decide what -march=native targets (x86; Arm; others' names where they differ)
CPU_FIELDS = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant", "CPU part",
              "isa", "cpu model", "uarch")
CPUINFO = "/proc/cpuinfo"
TRUSTED_OWNERS = (0,)  # besides the user: root (a folder or library built ahead of time into an image)
_said: set[str] = set()  # warnings already given in this process (each once)


class UnsafePath(RuntimeError):
    """A cache folder or library file that someone else could have written."""


def warn_once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        warnings.warn(f"hf_sparsemax: {message}", RuntimeWarning, stacklevel=4)


def compiler() -> list[str]:
    """``$CC`` as a command line (``CC="ccache gcc"`` is two words), default ``cc``."""
    words = shlex.split(os.environ.get("CC") or "cc")
    return words or ["cc"]


def private_problem(status: os.stat_result, what: str) -> str | None:
    """Why a file or folder with this status is not private to the user, or None."""
    if status.st_uid != os.getuid() and status.st_uid not in TRUSTED_OWNERS:
        return f"{what} is owned by uid {status.st_uid}, not by this user (uid {os.getuid()}) or root"
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by its group or by others (mode {stat.S_IMODE(status.st_mode):o})"
    return None


def check_library(path: str) -> str:
    """``path`` where it is a regular file only the user (or root) can write; raises :class:`UnsafePath`."""
    status = os.lstat(path)
    if not stat.S_ISREG(status.st_mode):
        raise UnsafePath(f"{path} is not a regular file (a link or another kind of file)")
    problem = private_problem(status, path)
    if problem:
        raise UnsafePath(problem)
    return path


def wanted_folder() -> str:
    return os.environ.get("HF_SPARSEMAX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hf_sparsemax")


@functools.lru_cache(maxsize=None)
def private_folder() -> str:
    """A folder for this process alone (mode 0700), where the shared one cannot be used; removed when the process
    exits (a library loaded from it stays mapped until then)."""
    folder = tempfile.mkdtemp(prefix="hf_sparsemax-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def folder_problem(folder: str) -> str | None:
    """Why ``folder`` cannot serve as the cache (made here if missing, mode 0700), or None."""
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        return private_problem(os.stat(folder), f"the kernel cache folder {folder}")
    except OSError as error:
        return f"the kernel cache folder {folder} cannot be made ({error.strerror or error})"


def cache_folder() -> str:
    """The cache folder if it exists (or can be made) and is private to the user, else :func:`private_folder`
    (one warning naming the reason)."""
    folder = wanted_folder()
    problem = folder_problem(folder)
    if problem is None:
        return folder
    warn_once("folder", f"{problem}; the CPU kernel is built in a private folder for this process instead "
                        "(build it ahead of time with `hf-sparsemax build-kernels` into a folder of your own, "
                        "named by HF_SPARSEMAX_CACHE)")
    return private_folder()


def cpu_signature() -> str:
    """What ``-march=native`` compiles for: the machine and its CPU's fields in /proc/cpuinfo (every platform's
    names), else what ``platform`` knows."""
    found = {platform.machine(), platform.processor()}
    try:
        with open(CPUINFO, encoding="utf-8", errors="replace") as info:
            found.update(line.strip() for line in info if line.split(":")[0].strip() in CPU_FIELDS)
    except OSError:
        pass
    return "\n".join(sorted(found))


@functools.lru_cache(maxsize=None)
def compiler_version(command: tuple[str, ...]) -> str:
    """The compiler's ``--version`` text (part of the build's name: a new compiler builds anew)."""
    try:
        return subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise RuntimeError(f"the C compiler {' '.join(command)!r} cannot run: {error}") from None


def library_name(command: list[str], flags: tuple[str, ...], header: str) -> str:
    with open(SOURCE, "rb") as handle:
        source = handle.read()
    parts = (source, header.encode(), repr(flags).encode(), compiler_version(tuple(command)).encode(),
             cpu_signature().encode())
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]
    return f"fused-{digest}.so"


def remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def compile_into(folder: str, name: str, command: list[str], flags: tuple[str, ...], header: str) -> str:
    """Compile under a temporary name in ``folder``, then publish as ``name`` with ``os.link`` (never replacing a
    file: if another process published first, its library is the one used). Returns the library's path."""
    path = os.path.join(folder, name)
    handle, partial = tempfile.mkstemp(prefix=".building-", suffix=".so", dir=folder)
    os.close(handle)
    keep_partial = False  # a file system without hard links: the private build is the library
    try:
        with tempfile.TemporaryDirectory(prefix="hf_sparsemax-build-") as include:
            with open(os.path.join(include, HEADER), "w", encoding="utf-8") as out:
                out.write(header)
            params = os.path.join(include, HEADER)  # by its absolute path: a stray header beside SOURCE never wins
            done = subprocess.run([*command, *flags, f'-DHF_SPARSEMAX_PARAMS="{params}"', SOURCE, "-o", partial,
                                   "-lm"],
                                  capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}")
        os.chmod(partial, 0o755)
        try:
            os.link(partial, path)
        except FileExistsError:
            pass  # another process built the same library first: use theirs (checked below)
        except OSError:  # a file system without hard links: load the private build, publish nothing, remove it
            keep_partial = True  # at exit (a library loaded from it stays mapped until then)
            atexit.register(remove_quietly, partial)
            return check_library(partial)
        return check_library(path)
    finally:
        if not keep_partial:
            remove_quietly(partial)  # (a failed compiler run may have removed it already)


def build(flags: tuple[str, ...], header: str) -> str:
    """The path of a checked library built with ``flags`` (from the cache, or built now); raises RuntimeError
    (compiler failed), OSError or :class:`UnsafePath`."""
    command = compiler()
    name = library_name(command, flags, header)
    folder = cache_folder()
    path = os.path.join(folder, name)
    if os.path.lexists(path):
        try:
            return check_library(path)
        except UnsafePath as error:
            warn_once("library", f"{error}; not loaded: the CPU kernel is built in a private folder instead")
            return compile_into(private_folder(), name, command, flags, header)
    try:
        return compile_into(folder, name, command, flags, header)
    except OSError:  # a folder built ahead of time by someone else (root), or a read-only one: not writable here
        return compile_into(private_folder(), name, command, flags, header)


def build_library(header: str) -> tuple[str, str | None]:
    """``(path, None)`` of the OpenMP build, or ``(path, why)`` of a one-thread build where OpenMP failed
    (the caller says so once); raises where neither builds."""
    try:
        return build(FLAGS + OPENMP, header), None
    except UnsafePath:
        raise
    except RuntimeError as error:  # the compiler refused OpenMP
        return build(FLAGS, header), str(error)
