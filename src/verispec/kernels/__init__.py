"""Hand-written CPU kernels (cpu_kernels.cpp), compiled for this processor on first use.

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
    digest = hashlib.sha1(source.read_bytes() + " ".join(flags).encode()
                          + _cpu_signature().encode()).hexdigest()[:12]
    return load(name=f"{prefix}_{digest}", sources=[str(source)], extra_cflags=flags,
                extra_ldflags=["-fopenmp"], verbose=False)


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
