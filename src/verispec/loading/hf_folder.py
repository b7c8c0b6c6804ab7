"""Load a Hugging Face folder: config.json, safetensors (single or sharded), tokenizer."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from verispec.config import ModelConfig
from verispec.errors import CorruptModelError, VerispecError
from verispec.loading.layer_order import in_layer_order


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


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def read_state(folder: Path, dtype: torch.dtype, mapped: set[int]) -> Iterator[dict[str, torch.Tensor]]:
    """The folder's tensors one decoder layer at a time, in order, then the rest, each read
    from its file's memory map only when asked for and cast to dtype only where it differs:
    a caller that packs each layer before asking for the next never holds the whole model
    in float32. The storages (data pointers) of tensors yielded still in a map are added
    to `mapped`."""
    from safetensors import SafetensorError, safe_open

    located = {}  # name -> (file, its open handle, which keeps the map)
    for file in weight_files(folder):
        try:
            handle = safe_open(str(file), framework="pt")
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CorruptModelError(f"{file}: corrupt or truncated safetensors file ({exc})") from None
        located.update((name, (file, handle)) for name in handle.keys())
    for names in in_layer_order(located, _LAYER_INDEX.search):
        state: dict[str, torch.Tensor] = {}
        for name in names:
            file, handle = located[name]
            try:
                value = handle.get_tensor(name)
            except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                raise CorruptModelError(f"{file}: corrupt or truncated safetensors file ({exc})") from None
            kept = value.to(dtype) if value.is_floating_point() else value
            if kept is value:
                mapped.add(value.untyped_storage().data_ptr())
            state[name] = kept
        yield state
