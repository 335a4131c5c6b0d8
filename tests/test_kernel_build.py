"""The CPU kernel's build cache: only what the user (or root) alone can write is loaded.

A shared or foreign folder is not used (one warning, a private folder instead); a library that is a link, or
that others can write, is not loaded; a build never replaces a published library; the build's name changes with
what ``-march=native`` and the compiler depend on (x86 and Arm); ``CC`` is a command line; a lost OpenMP is said
once; the kernel builds ahead of time (``hf-sparsemax build-kernels``) into a folder that later loads need not
write.
"""

import os
import stat
import subprocess
import sys
import warnings

import pytest

import hf_sparsemax_cli as cli
from hf_sparsemax.attention.cpu import fused, kernel_build

pytestmark = pytest.mark.skipif(fused.library() is None, reason="no C compiler: the kernel is not built here")


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """An empty cache folder of this user's (mode 0700); the process's kernel restored after."""
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("HF_SPARSEMAX_CACHE", str(folder))
    monkeypatch.setattr(fused, "_failed", [])
    monkeypatch.setattr(kernel_build, "_said", set())
    kernel_build.private_folder.cache_clear()
    fused.library.cache_clear()
    yield folder
    fused.library.cache_clear()
    kernel_build.private_folder.cache_clear()


def built(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.endswith(".so"))


def loaded_from() -> str:
    return os.path.dirname(fused.library()._name)


def test_a_private_folder_is_used_and_a_build_is_loaded_not_rebuilt(cache):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loaded_from() == str(cache)
    (name,) = built(cache)
    status = os.lstat(cache / name)
    assert not status.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    assert not [n for n in os.listdir(cache) if n.startswith(".building-")]  # nothing half-built left behind
    fused.library.cache_clear()
    assert loaded_from() == str(cache) and os.lstat(cache / name).st_ino == status.st_ino


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777])
def test_a_folder_others_can_write_is_not_used(cache, mode):
    os.chmod(cache, mode)
    with pytest.warns(RuntimeWarning, match="writable by its group or by others"):
        folder = loaded_from()
    assert folder != str(cache) and built(cache) == []
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700 and folder == kernel_build.private_folder()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root (CI runs as root)")
def test_a_folder_of_another_user_is_not_used(cache):
    os.chown(cache, 4242, 4242)
    with pytest.warns(RuntimeWarning, match="is owned by uid 4242, not by this user"):
        assert loaded_from() == kernel_build.private_folder()
    assert built(cache) == []


def test_a_folder_that_cannot_be_made_gives_a_private_build(monkeypatch, tmp_path, cache):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("HF_SPARSEMAX_CACHE", str(blocker / "cache"))  # e.g. a read-only home
    with pytest.warns(RuntimeWarning, match="cannot be made.*build-kernels"):
        assert loaded_from() == kernel_build.private_folder()


def planted(cache) -> str:
    """The path where this machine's library would be published in ``cache`` (built in a scratch folder)."""
    header = fused.header()
    name = kernel_build.library_name(kernel_build.compiler(), kernel_build.FLAGS + kernel_build.OPENMP, header)
    return str(cache / name)


def test_a_link_in_place_of_the_library_is_not_loaded(cache, tmp_path):
    elsewhere = tmp_path / "elsewhere.so"
    elsewhere.write_bytes(b"not a library")
    os.symlink(elsewhere, planted(cache))
    with pytest.warns(RuntimeWarning, match="not a regular file"):
        folder = loaded_from()
    assert folder == kernel_build.private_folder() and os.path.islink(planted(cache))


def test_a_library_others_can_write_is_not_loaded(cache):
    path = planted(cache)
    with open(path, "wb") as handle:
        handle.write(b"anyone's code")
    os.chmod(path, 0o666)
    with pytest.warns(RuntimeWarning, match="writable by its group or by others"):
        assert loaded_from() == kernel_build.private_folder()
    with open(path, "rb") as handle:
        assert handle.read() == b"anyone's code"  # not replaced, not loaded


def test_publishing_never_replaces_a_library_already_there(cache):
    first = fused.library()._name
    inode = os.lstat(first).st_ino
    again = kernel_build.compile_into(str(cache), os.path.basename(first), kernel_build.compiler(),
                                      kernel_build.FLAGS + kernel_build.OPENMP, fused.header())
    assert again == first and os.lstat(first).st_ino == inode  # the other process's library kept: os.link, EEXIST
    assert built(cache) == [os.path.basename(first)] and len(os.listdir(cache)) == 1


ARM = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1
"""


def test_the_build_name_holds_what_march_native_and_the_compiler_depend_on(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    monkeypatch.setattr(kernel_build, "CPUINFO", str(info))
    names = {}
    for label, text in {"neoverse-n1": ARM, "neoverse-v1": ARM.replace("0xd0c", "0xd40"),
                        "no-sve": ARM, "sve": ARM.replace("asimddp", "asimddp sve")}.items():
        info.write_text(text)
        names[label] = kernel_build.library_name(["cc"], kernel_build.FLAGS, "h")
    assert names["neoverse-n1"] != names["neoverse-v1"] and names["no-sve"] != names["sve"]
    assert "CPU part" in kernel_build.cpu_signature() and "Features" in kernel_build.cpu_signature()
    info.write_text("model name\t: Some CPU\nflags\t\t: fpu sse avx2\ncpu MHz\t\t: 1000\n")
    x86 = kernel_build.library_name(["cc"], kernel_build.FLAGS, "h")
    info.write_text("model name\t: Some CPU\nflags\t\t: fpu sse avx2\ncpu MHz\t\t: 3000\n")  # the clock: same build
    assert kernel_build.library_name(["cc"], kernel_build.FLAGS, "h") == x86
    monkeypatch.setattr(kernel_build, "compiler_version", lambda command: "cc 99.0")
    assert kernel_build.library_name(["cc"], kernel_build.FLAGS, "h") != x86


def test_cc_is_a_command_line(cache, monkeypatch):
    monkeypatch.setenv("CC", "env cc")  # as CC="ccache gcc": a command and its arguments
    assert kernel_build.compiler() == ["env", "cc"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loaded_from() == str(cache)


def test_a_lost_openmp_is_said_once(cache, monkeypatch):
    monkeypatch.setattr(kernel_build, "OPENMP", ("-fno-such-option-hf-sparsemax",))
    with pytest.warns(RuntimeWarning, match="without OpenMP, so it runs on one thread"):
        assert fused.library() is not None
    fused.library.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fused.library() is not None  # said once a process


def test_the_kernel_builds_ahead_of_time_and_loads_from_a_folder_it_need_not_write(cache, capsys):
    assert cli.main(["build-kernels"]) == 0
    (name,) = built(cache)
    assert capsys.readouterr().out.strip().endswith(name)
    os.chmod(cache, 0o555)  # read-only from now on (an image's folder)
    try:
        fused.library.cache_clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert fused.library()._name == str(cache / name)
    finally:
        os.chmod(cache, 0o700)


def test_build_ahead_of_time_refuses_a_folder_others_can_write(cache, capsys):
    os.chmod(cache, 0o777)
    assert fused.main([]) == 1
    assert "writable by its group or by others" in capsys.readouterr().err and built(cache) == []


def test_python_dash_m_builds_the_kernel(cache):
    done = subprocess.run([sys.executable, "-m", "hf_sparsemax.attention.cpu.fused"], capture_output=True,
                          text=True, env={**os.environ, "HF_SPARSEMAX_CACHE": str(cache)}, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(".so") and built(cache)


def test_no_build_leaves_a_private_folder_or_a_partial_file_behind(cache, monkeypatch, tmp_path):
    """kernel_build left its private ``mkdtemp`` folders and, on a file system without hard links, its
    ``.building-*.so`` partial file behind, and a failed compile (the compiler removes its output) raised
    FileNotFoundError from that cleanup in place of the compiler's error. Now a failed build raises the compiler's
    error, its partial file removed; the partial file
    loaded where no link can publish it, and the private folder, are removed when the process exits (each an
    ``atexit`` callback: run here)."""
    at_exit = []
    monkeypatch.setattr(kernel_build.atexit, "register", lambda call, *args, **kw: at_exit.append((call, args, kw)))
    command, header = kernel_build.compiler(), fused.header()
    with pytest.raises(RuntimeError, match="failed"):
        kernel_build.compile_into(str(cache), "broken.so", command, ("-DHF_SPARSEMAX_PARAMS=<no such header>",),
                                  header)
    assert os.listdir(cache) == [] and at_exit == []  # the failed build's partial file: removed at once

    def no_links(source, target):
        raise PermissionError("no hard links on this file system")

    monkeypatch.setattr(kernel_build.os, "link", no_links)
    path = kernel_build.compile_into(str(cache), "fused-test.so", command, kernel_build.FLAGS, header)
    assert os.path.basename(path).startswith(".building-") and os.listdir(cache) == [os.path.basename(path)]
    private = kernel_build.private_folder()
    assert os.path.isdir(private)
    for call, args, kw in at_exit:
        call(*args, **kw)
    assert os.listdir(cache) == [] and not os.path.exists(private)
