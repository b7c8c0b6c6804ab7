"""A cache of ready-to-run models, so a large GGUF file is parsed, decoded and packed once.

Parsing the 1.5B demo model's metadata and vocabulary and decoding its K-quant blocks with
the gguf package takes most of a minute; reading the packed weights back from a
safetensors file, and the config and tokenizer from a JSON file beside it, takes seconds.
Entries live in ~/.cache/verispec/weights (VERISPEC_CACHE_DIR moves it,
VERISPEC_WEIGHT_CACHE=0 turns it off), keyed by the model file's path, size and
modification time, the weight format and a digest of the loading and model code. Small
files are not cached: decoding them is quick. An entry is replaced when its file or the
code changes, and removed once its file is gone (a deleted checkout or download), so the
folder holds one entry per file that still exists, format and dtype.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import dataclasses

import torch
from torch import nn

from verispec.config import ModelConfig
from verispec.loading.tokenizer import Tokenizer

VERSION = 1
MIN_FILE_BYTES = 32 << 20


def _folder() -> Path:
    return Path(os.environ.get("VERISPEC_CACHE_DIR", Path.home() / ".cache" / "verispec" / "weights"))


def _code_version() -> str:
    """A digest of the code that turns a file into weights: an edit to it retires old entries."""
    package = Path(__file__).resolve().parents[1]
    sources = [package / "config.py", package / "quant.py", *sorted((package / "loading").glob("*.py")),
               *sorted((package / "models").glob("*.py"))]
    digest = hashlib.sha1()
    for source in sources:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:12]


def entry_path(model_file: Path, fmt: str, dtype: torch.dtype) -> Path | None:
    """Where the packed weights of this file in this format live; None when not cached."""
    if os.environ.get("VERISPEC_WEIGHT_CACHE", "1") == "0" or not model_file.is_file():
        return None
    stat = model_file.stat()
    if stat.st_size < MIN_FILE_BYTES:
        return None
    # which file, format and dtype: one entry each, replaced when the file or the code changes
    slot = hashlib.sha1(f"{model_file.resolve()}|{dtype}".encode()).hexdigest()[:8]
    key = f"{VERSION}|{_code_version()}|{model_file.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{fmt}|{dtype}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    return _folder() / f"{model_file.stem}-{slot}-{fmt}-{digest}.safetensors"


def _sidecar(entry: Path) -> Path:
    return entry.with_suffix(".json")


def _drop(entry: Path) -> None:
    entry.unlink(missing_ok=True)
    _sidecar(entry).unlink(missing_ok=True)


def remove_orphans(folder: Path) -> None:
    """Remove the entries whose model file no longer exists: nothing would read them again.
    Entries that do not name their file are left alone."""
    for sidecar in folder.glob("*.json"):
        try:
            source = json.loads(sidecar.read_text()).get("source")
        except (OSError, ValueError):
            continue
        if source and not Path(source).exists():
            _drop(sidecar.with_suffix(".safetensors"))


def store(entry: Path, model: nn.Module, config: ModelConfig, tokenizer: Tokenizer,
          source: Path | None = None) -> None:
    """Write the model's weights, which modules are packed, its config and tokenizer, and
    the model file they came from. A failure to write only means the next load decodes the
    file again."""
    from safetensors.torch import save_file

    from verispec.models.moe import StackedExperts
    from verispec.quant import GgufEmbedding, PackedLinear

    tensors, aliases, owners = {}, {}, {}
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tensor.numel(), tensor.dtype)
        if key in owners:
            aliases[name] = owners[key]  # e.g. a float output layer sharing the embedding
        else:
            owners[key] = name
            tensors[name] = tensor.detach().contiguous().cpu()
    described = {
        "packed": {name: type(module).__name__ for name, module in model.named_modules()
                   if isinstance(module, PackedLinear)},
        "aliases": aliases,
        "expert_kinds": {name: module.kind for name, module in model.named_modules()
                         if isinstance(module, StackedExperts)},
        "gguf_embeddings": {name: [module.quant_type, str(module.dtype).removeprefix("torch.")]
                            for name, module in model.named_modules() if isinstance(module, GgufEmbedding)},
        "config": dataclasses.asdict(config),
        "tokenizer": {"backend": tokenizer.backend.to_str(), "eos_ids": sorted(tokenizer.eos_ids),
                      "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
                      "chat_template": tokenizer.chat_template, "add_bos": tokenizer.add_bos,
                      "bos_id": tokenizer.bos_id},
        "source": str(source.resolve()) if source is not None else None,
    }
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        slot = entry.stem.rsplit("-", 1)[0]  # stem, file slot and format
        for stale in entry.parent.glob(f"{slot}-*.safetensors"):  # retired by a code or file change
            _drop(stale)
        remove_orphans(entry.parent)
        partial = entry.with_suffix(".partial")
        save_file(tensors, str(partial))
        _sidecar(entry).write_text(json.dumps(described))
        partial.replace(entry)
    except OSError:
        pass


def load(entry: Path) -> tuple[nn.Module, ModelConfig, Tokenizer, set[int]] | None:
    """The model, config and tokenizer stored at `entry`, and the storages (data pointers) of
    its tensors, which are views of the entry's memory map; None if missing or unusable."""
    from safetensors import safe_open
    from tokenizers import Tokenizer as BackendTokenizer

    from verispec import quant
    from verispec.models import build_model

    try:
        described = json.loads(_sidecar(entry).read_text())
        with safe_open(str(entry), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        config = ModelConfig(**described["config"])
        saved = described["tokenizer"]
        tokenizer = Tokenizer(BackendTokenizer.from_str(saved["backend"]), set(saved["eos_ids"]),
                              saved["bos_token"], saved["eos_token"], saved["chat_template"],
                              saved["add_bos"], saved["bos_id"])
    except Exception:  # a damaged or outdated entry: decode the model file again
        return None
    for name, source in described["aliases"].items():
        tensors[name] = tensors[source]
    with torch.device("meta"):
        model = build_model(config)
    for name, kind in described["packed"].items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        for part in getattr(type(parent), "FUSED", {}).get(attr, ()):
            delattr(parent, part)
        cls = getattr(quant, kind)
        prefix = f"{name}."
        setattr(parent, attr, cls(*(tensors[prefix + field] for field in cls.STORED), tensors.get(prefix + "bias")))
    for name, kind in described.get("expert_kinds", {}).items():
        model.get_submodule(name).expect(kind)
    for name, (quant_type, dtype) in described.get("gguf_embeddings", {}).items():
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr,
                quant.GgufEmbedding(tensors[f"{name}.blocks"], quant_type, getattr(torch, dtype)))
    if "model.embed_tokens.weight" not in tensors and "model.embed_tokens.blocks" not in tensors:  # in the output layer
        quant.share_tied_embedding(model)
    try:
        model.load_state_dict(tensors, strict=True, assign=True)
    except RuntimeError:
        return None
    return model, config, tokenizer, {t.untyped_storage().data_ptr() for t in tensors.values()}
