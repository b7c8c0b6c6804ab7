"""Load a Hugging Face folder: config.json, safetensors (single or sharded), tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from verispec.config import ModelConfig
from verispec.errors import CorruptModelError, VerispecError


def read_config(folder: Path) -> tuple[ModelConfig, dict]:
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise VerispecError(f"{folder}: no config.json, so this is not a Hugging Face model folder") from None
    except json.JSONDecodeError as exc:
        raise CorruptModelError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CorruptModelError(f"{path}: expected a JSON object of settings, found {type(raw).__name__}")
    try:
        return ModelConfig.from_hf(raw), raw
    except CorruptModelError as exc:
        raise CorruptModelError(f"{path}: {exc}") from None


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CorruptModelError(f"{index}: unreadable shard index ({exc})") from None
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CorruptModelError(f"{folder}: shard(s) named in the index are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise VerispecError(f"{folder}: no *.safetensors weights (only safetensors are read)")
    return files


def load_state(folder: Path, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], set[int]]:
    """All tensors, memory-mapped by safetensors and cast to dtype only where they differ;
    and the storages (data pointers) of the tensors that still live in the files' maps."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    mapped: set[int] = set()
    for file in weight_files(folder):
        try:
            tensors = load_file(str(file))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CorruptModelError(f"{file}: corrupt or truncated safetensors file ({exc})") from None
        for name, value in tensors.items():
            kept = value.to(dtype) if value.is_floating_point() else value
            if kept is value:
                mapped.add(value.untyped_storage().data_ptr())
            state[name] = kept
    return state, mapped
