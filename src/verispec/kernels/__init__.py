"""Hand-written CPU kernels (cpu_kernels.cpp), compiled for this processor on first use
into verispec's cache folder ($XDG_CACHE_HOME/verispec/kernels, ~/.cache by default).

Everything that uses them has a plain PyTorch path, taken when the kernels are switched
off (`VERISPEC_KERNELS=0` or `set_enabled(False)`), when the compiler is missing or the
build fails (a one-line warning says why), or when tensors are not on the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

try:
    import fcntl
except ImportError:  # not a POSIX system: builds are not serialised
    fcntl = None

_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]
_enabled = os.environ.get("VERISPEC_KERNELS", "1") != "0"


def set_enabled(flag: bool) -> None:
    """Switch the kernels on or off for this process (the plain path is the reference)."""
    global _enabled
    _enabled = flag


def enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def switched_off() -> Iterator[None]:
    """The plain PyTorch path within the block; the kernels' state before it after."""
    before = _enabled
    set_enabled(False)
    try:
        yield
    finally:
        set_enabled(before)


def _cpu_signature() -> str:
    """What -march=native depends on, so a build is never reused on a different processor."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def compile_source(source: Path, prefix: str = "verispec_cpu", extra_flags: Sequence[str] = ()) -> ModuleType:
    """`source` (this file's kernels, or a changed copy of them) compiled for this processor
    as its own module, named after what it is built from; raises if it cannot be built.
    `extra_flags` go after the usual ones (`-mno-avx512f` builds the AVX2 path on a processor
    that has AVX-512)."""
    from torch.utils.cpp_extension import load

    flags = _FLAGS + list(extra_flags)
    name = module_name(source, prefix, flags)
    folder = build_folder(name)
    with _one_build_at_a_time(folder):
        return load(name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                    build_directory=str(folder), verbose=False)


def module_name(source: Path, prefix: str, flags: Sequence[str]) -> str:
    digest = hashlib.sha1(source.read_bytes() + " ".join(flags).encode()
                          + _cpu_signature().encode()).hexdigest()[:12]
    return f"{prefix}_{digest}"


def build_folder(name: str) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = cache / "verispec" / "kernels" / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def _one_build_at_a_time(folder: Path) -> Iterator[None]:
    """Hold a lock on the build folder that the system drops if this process dies. PyTorch
    marks a build in progress with a `lock` file and waits for ever while one is there, so a
    build killed midway (Ctrl-C on the first run) would hang every later start; holding our
    lock, no build is in progress, and a `lock` file found is such a leftover."""
    with build_lock(folder):
        (folder / "lock").unlink(missing_ok=True)
        yield


@contextlib.contextmanager
def build_lock(folder: Path) -> Iterator[None]:
    """The lock every build and load of the kernels in `folder` holds (none without fcntl)."""
    if fcntl is None:
        yield
        return
    with open(folder / "verispec.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def _build() -> ModuleType | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        return compile_source(_SOURCE)
    except Exception as exc:  # no compiler, no ninja, an old processor: fall back, say why once
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        warnings.warn(f"verispec: fast CPU kernels unavailable, using PyTorch ops ({first_line})",
                      RuntimeWarning, stacklevel=3)
        return None


def cpu_kernels() -> ModuleType | None:
    """The compiled kernel module, or None when they are off or could not be built."""
    return _build() if _enabled else None
