"""Turn a model name or path into a ready model: weights, config and tokenizer."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from verispec.cache import CACHE_DTYPES
from verispec.config import ModelConfig
from verispec.errors import CorruptModelError, ModelNotFoundError, VerispecError
from verispec.loading.demo_models import DEMO_MODELS, is_intact, model_path
from verispec.loading.tokenizer import Tokenizer
from verispec.models import build_model, check_supported
from verispec.models.moe import expect_packed_experts
from verispec.quant import FORMATS, PACKED_FORMATS

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    name: str
    path: Path
    model: nn.Module
    tokenizer: Tokenizer
    config: ModelConfig
    load_s: float
    dtype: torch.dtype
    device: torch.device
    weights: str = "float32"  # weight format
    info: dict = field(default_factory=dict)

    @property
    def kv_cache(self) -> str:
        """The type its caches keep keys and values in: "float32", "bfloat16" or "float16"."""
        return str(self.model.kv_dtype()).removeprefix("torch.")

    def weight_bytes(self) -> int:
        """Bytes of weights one decoding step reads (the embedding is a lookup, not a read)."""
        from verispec.quant import weight_bytes
        return weight_bytes(self.model)


def resolve(spec: str | Path) -> Path:
    """A demo model name or a path -> an existing path."""
    text = str(spec)
    if text in DEMO_MODELS:
        path = model_path(text)
        if not path.is_file():
            raise ModelNotFoundError(
                f"demo model {text!r} is not installed (expected {path}); "
                f"run `verispec models --install` or `make demo`")
        if not is_intact(DEMO_MODELS[text], path):
            raise CorruptModelError(f"demo model {text!r} at {path} is damaged: its SHA-256 is not the "
                                    f"pinned one; run `verispec models --install` to install it again")
        return path
    path = Path(text).expanduser()
    if not path.exists():
        names = ", ".join(DEMO_MODELS)
        raise ModelNotFoundError(f"no model at {text!r}: not a file or folder, nor a demo model name ({names})")
    return path


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _build(config: ModelConfig, layers, path: Path, device: torch.device, fmt: str | None = None,
           gguf_tensors: dict | None = None) -> nn.Module:
    """The model, from `layers` (state dicts, one decoder layer's after another, then the rest).

    Each decoder layer goes to `device`, and with `fmt` is packed in that weight format there,
    as soon as its weights are in, before the next layer is read: loading then holds one
    layer in float32 on the host, not the whole model (a 1.5B model from its GGUF file in
    int4 peaked at 10.4 GB when every layer was decoded first)."""
    with torch.device("meta"):
        model = build_model(config)
    settled: set[int] = set()
    for state in layers:
        if hasattr(model, "sanitize"):
            state = model.sanitize(state)
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        expect_packed_experts(model, state)
        model.load_state_dict(state, strict=False, assign=True)
        del state
        _settle_complete_layers(model, device, fmt, gguf_tensors or {}, settled)
    missing = [name for name, tensor in model.state_dict(keep_vars=True).items() if tensor.is_meta]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise CorruptModelError(f"{path}: {len(missing)} weight(s) missing: {shown}")
    return model


def _settle_complete_layers(model: nn.Module, device: torch.device, fmt: str | None, gguf_tensors: dict,
                            settled: set[int]) -> None:
    """Move each decoder layer whose weights are all in, and that is not in `settled` yet, to
    `device`, and pack it there in weight format `fmt` if one is given."""
    from verispec.quant import pack_projections

    for index, layer in enumerate(model.model.layers):
        if index in settled or any(t.is_meta for t in [*layer.parameters(), *layer.buffers()]):
            continue
        layer.to(device)
        if fmt is not None:
            pack_projections(layer, fmt, gguf_tensors, prefix=f"model.layers.{index}.")
        settled.add(index)


def keep_embedding_blocks(model: nn.Module, raw) -> None:
    """Look tokens up in the GGUF file's own embedding blocks (`raw`, its raw tensor) rather
    than in a decoded float table, wherever the output layer does not read that table: when
    the file stores an output layer of its own, or the weight format packs a copy. Then the
    table serves only lookups, and decoded it is a large part of a model's memory (0.93 GB of
    the 1.5B demo model's in float32)."""
    from verispec.quant import embedding_from_gguf

    backbone = getattr(model, "model", None)
    table = getattr(backbone, "embed_tokens", None)
    if raw is None or not isinstance(table, nn.Embedding) or getattr(model, "lm_head", None) is None:
        return
    blocks = embedding_from_gguf(raw, table.weight.dtype)
    if blocks is not None:
        backbone.embed_tokens = blocks


def settle_in_memory(model: nn.Module, mapped: set[int]) -> None:
    """Leave a packed CPU model holding each weight once, in memory of its own.

    The packed layers switch to the kernels' layout now rather than on first use, straight
    from wherever their tensors are, into one buffer (`quant.panels_in_one_buffer`). Tensors
    still in a file's memory map (`mapped`: their storages' data pointers) are then copied
    out, aliases staying aliases, so the map closes: while any tensor points into it, every
    page once read stays in the resident set (the 1.5B model in bfloat16 from the weight
    cache showed 4.87 GB resident for 3.55 GB of tensors). Last, glibc is asked to hand
    back the heap pages loading freed, which it otherwise keeps resident."""
    import ctypes

    from verispec.kernels import cpu_kernels
    from verispec.quant import panels_in_one_buffer

    panels_in_one_buffer(model, cpu_kernels())
    copies: dict[tuple, torch.Tensor] = {}

    def owned(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in mapped:
            return tensor
        key = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)
        if key not in copies:
            copies[key] = tensor.clone()
        return copies[key]

    for module in model.modules() if mapped else ():
        for name, parameter in list(module._parameters.items()):
            if parameter is not None:
                module._parameters[name] = nn.Parameter(owned(parameter.detach()), requires_grad=False)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = owned(buffer)
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        pass


def load_model(spec: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu",
               weights: str | None = None, kv_cache: str | None = None) -> LoadedModel:
    """Load a demo model name, a GGUF file or a Hugging Face folder.

    `weights` picks the weight format (float32, bfloat16, float16, int8, int4, int4-mixed);
    by default the format follows `dtype`. `kv_cache` picks the type its caches keep keys and
    values in (float32, bfloat16, float16); by default the activations' type.
    """
    started = time.perf_counter()
    if kv_cache is not None and kv_cache not in CACHE_DTYPES:
        raise VerispecError(f"unknown KV cache type {kv_cache!r}; choose from {', '.join(CACHE_DTYPES)}")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise VerispecError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    asked = device
    try:
        device = torch.device(device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):  # the engine runs on these two
        raise VerispecError(f"unknown device {str(asked)!r}; use cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise VerispecError("--device cuda was asked for, but no CUDA device is available")
    path = resolve(spec)
    fmt = weights or {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    if fmt not in FORMATS:
        raise VerispecError(f"unknown weight format {fmt!r}; choose from {', '.join(FORMATS)}")
    from verispec.kernels import cpu_kernels
    # float formats are packed too on the CPU: fused projections on the fast kernels
    packed = fmt in PACKED_FORMATS or (device.type == "cpu" and cpu_kernels() is not None)
    meta: dict = {}
    quantized: dict = {}
    mapped: set[int] = set()  # storages still in a file's memory map
    cached = entry = None
    if path.is_dir():
        from verispec.loading.hf_folder import read_config, read_state
        from verispec.loading.tokenizer import from_hf_folder

        config, _ = read_config(path)
        check_supported(config)  # before reading gigabytes of weights
        layers = read_state(path, dtype, mapped)
        tokenizer = from_hf_folder(path, config.eos_token_ids)
    elif _is_gguf(path):
        from verispec.loading import weight_cache
        from verispec.loading.gguf_file import read_gguf
        from verispec.loading.tokenizer import from_gguf

        entry = weight_cache.entry_path(path, fmt, dtype) if packed else None
        cached = weight_cache.load(entry) if entry is not None and entry.is_file() else None
        if cached is not None:
            cached, config, tokenizer, mapped = cached
        else:
            if entry is not None:  # the one slow load of this file in this format: say why it takes a while
                log.info("%s: decoding and packing its weights as %s, once; later loads read them from %s",
                         path.name, fmt, entry.parent)
            config, layers, meta, quantized = read_gguf(path, dtype, keep_quantized=fmt in ("int4", "int4-mixed"),
                                                        expert_format=fmt if packed else None,
                                                        embedding_blocks=packed)
            tokenizer = from_gguf(path, meta)
    else:
        raise CorruptModelError(f"{path}: neither a GGUF file nor a Hugging Face folder")
    if not tokenizer.eos_ids:
        tokenizer.eos_ids = config.eos_token_ids
    if cached is not None:
        model = cached
    else:
        model = _build(config, layers, path, device, fmt if packed else None, quantized)
        if packed:  # where the file has an output layer of its own: its stand-in never moves
            keep_embedding_blocks(model, quantized.get("model.embed_tokens.weight"))
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    if cached is not None:
        from verispec.fast import attach_fast_path
        attach_fast_path(model)
    elif packed:
        from verispec.quant import quantize_model
        quantize_model(model, fmt, gguf_tensors=quantized)
        keep_embedding_blocks(model, quantized.get("model.embed_tokens.weight"))  # int formats copy a tied one
        if entry is not None:
            weight_cache.store(entry, model, config, tokenizer, source=path)
    if packed and device.type == "cpu":
        quantized = None  # the raw GGUF tensors: released before the heap is trimmed
        settle_in_memory(model, mapped)
    if kv_cache is not None:
        model.cache_dtype = CACHE_DTYPES[kv_cache]
    name = str(spec) if str(spec) in DEMO_MODELS else path.name
    return LoadedModel(name, path, model, tokenizer, config, time.perf_counter() - started,
                       dtype, device, fmt, {"gguf_metadata_keys": len(meta)})
