"""Weight formats, chosen at load: float32 / bfloat16 / float16 as they are, int8 weight-only
with one scale per output channel, and int4 in groups of 32 with a float16 scale and offset
per group (w = s*q + z, q in 0..15).

`quantize_model(model, fmt)` swaps every projection of the decoder blocks, and the output
layer, for a `PackedLinear` of that format, and fuses q/k/v and gate/up into one product
each. A PackedLinear runs the hand-written kernel (verispec.kernels) for the few rows of a
decoding step or a verification pass, and PyTorch for long prompts or without the kernels.

int4 weights come straight from a GGUF file's 4-bit blocks where it has them: Q4_0, Q4_1
and Q4_K blocks are exactly s*q + z per 32 weights, so they are repacked without passing
through float32 (only the scale and offset are rounded to float16). Tensors stored at
higher precision (Q5_0, Q6_K, Q8_0, float) are quantised to 4 bits from their values.

The kernels read weights rearranged into panels of 16 output columns, so that each thread
reads one sequential stream and can fetch it far enough ahead (row-major weights made a
tile read several short streams that the hardware prefetcher never caught up with). A
layer switches to its panels on the first use of the kernel; its state dict, `packed()`
and `dense_weight()` still give the canonical tensors.

The int4 panel kernel also rounds the activations, per row, to int8 in groups of 32
(`round_activations`, as llama.cpp does for its 4-bit formats) and multiplies with 8-bit
integer dot products (AVX-512 VNNI's, or AVX2's built to give the same sums): dequantising
to float32 made every row cost 4 FMAs per 64 weights, so one-row decoding was
compute-bound on a fast memory system and each extra row of a verification pass cost nearly as
much as the first. The result is the int4 weights times the rounded activations (a
relative error of a few thousandths per product), still batch-invariant because rows are
rounded one by one, and the same bits with AVX2 as with AVX-512. The PyTorch path stays
the exact reference.
"""

from __future__ import annotations

import math
from abc import ABCMeta, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from verispec.kernels import cpu_kernels

FORMATS = ("float32", "bfloat16", "float16", "int8", "int4", "int4-mixed")
PACKED_FORMATS = ("int8", "int4", "int4-mixed")  # the formats that are not a float type
# GGUF types that hold more than 4 bits per weight: "int4-mixed" keeps such tensors in int8
MORE_THAN_4_BITS = {"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K", "F16", "BF16", "F32"}
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GROUP = 32  # int4 group size along the input features
PANEL = 16  # output columns per panel of the panel layouts
INT4_PANEL_GROUP_BYTES = 64 + 256  # per panel and group of 32 in int4's panels: scales and offsets, nibbles
KERNEL_MAX_ROWS = 64  # more rows (a long prompt) go to a dense GEMM instead
KERNEL_LANES = 16  # the row-major float kernel reads input features in sixteens


class PackedLinear(nn.Module, metaclass=ABCMeta):
    """y = x·Wᵀ (+ bias) (+ residual) with W kept in one weight format.

    Subclasses store their tensors as buffers (so `.to(device)` and weight counts see them)
    and say how to run the kernel and how to get W back in float32.
    """

    fmt = "?"

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        kernels = cpu_kernels() if x.device.type == "cpu" else None
        if kernels is not None and rows.shape[0] <= KERNEL_MAX_ROWS and self.kernel_ready():
            res = None if residual is None else residual.reshape(-1, self.out_features).float().contiguous()
            y = self.kernel(kernels, rows.float().contiguous(), res)
        else:
            y = self.torch_product(rows)
            if residual is not None:
                y = y + residual.reshape(-1, self.out_features).to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def torch_product(self, rows: torch.Tensor) -> torch.Tensor:
        """The reference path: PyTorch's own product with the float32 weights."""
        y = F.linear(rows.float(), self.dense_weight())
        return y + self.bias if self.bias is not None else y

    KERNEL = ""  # the kernel's name; its arguments are x, the STORED tensors, bias, residual
    STORED: tuple[str, ...] = ()
    # The panel layout (16 output columns interleaved, one sequential stream per thread),
    # used where the kernels have PANEL_KERNEL: CANONICAL names the tensors it replaces.
    PANEL_KERNEL = ""
    PANEL_STORED: tuple[str, ...] = ()
    CANONICAL: tuple[str, ...] = ()

    @abstractmethod
    def make_panels(self, kernels) -> torch.Tensor:
        """The CANONICAL tensors in the panel layout."""

    @abstractmethod
    def canonical_from_panels(self) -> tuple[torch.Tensor, ...]:
        """The CANONICAL tensors, rebuilt from `panels`."""

    @abstractmethod
    def panel_shape(self) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and type of `make_panels`' result."""

    def panels_apply(self, kernels) -> bool:
        """Whether the layer would switch to the panel layout now."""
        return bool(self.PANEL_KERNEL and getattr(self, "panels", None) is None and kernels is not None
                    and hasattr(kernels, self.PANEL_KERNEL) and self.out_features % PANEL == 0
                    and self.in_features % GROUP == 0 and getattr(self, self.CANONICAL[0]).device.type == "cpu")

    def _use_panels(self, kernels, into: torch.Tensor | None = None) -> None:
        """Switch to the panel layout, once, where the kernels have it (stored in `into`,
        a tensor of `panel_shape()`, if given)."""
        if self.panels_apply(kernels):
            panels = self.make_panels(kernels)
            if into is not None:
                panels = into.copy_(panels)
            self.panels = panels
            for name in self.CANONICAL:
                setattr(self, name, None)
            self.STORED, self.KERNEL = self.PANEL_STORED, self.PANEL_KERNEL

    def canonical(self) -> tuple[torch.Tensor, ...]:
        """The CANONICAL tensors, whichever layout the layer runs."""
        if getattr(self, "panels", None) is None:
            return tuple(getattr(self, name) for name in self.CANONICAL)
        return self.canonical_from_panels()

    def kernel_ready(self) -> bool:
        self._use_panels(cpu_kernels())
        return self.in_features % GROUP == 0

    def kernel(self, kernels, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        self._use_panels(kernels)
        return getattr(kernels, self.KERNEL)(x, *(getattr(self, name) for name in self.STORED), self.bias, residual)

    def bound_kernel(self, kernels, outputs: int | None = None):
        """`kernel` bound to this layer's tensors once (a `kernels.Product`): f(x, residual=None).
        With `outputs`, the product of the first `outputs` output features only (a multiple
        of 16 in the panel layout), on views of the same tensors."""
        self._use_panels(kernels)
        tensors, bias = [getattr(self, n) for n in self.STORED], self.bias
        if outputs is not None and outputs < self.out_features:
            panels = getattr(self, "panels", None)
            if panels is not None and outputs % PANEL:
                raise ValueError(f"the panel layout gives outputs in sixteens, not {outputs}")
            tensors = [t[:outputs // PANEL] if t is panels else t[:outputs] for t in tensors]
            bias = None if bias is None else bias[:outputs]
        return kernels.Product(self.KERNEL, tensors, bias)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if getattr(self, "panels", None) is not None:  # the state dict holds the canonical layout
            destination.update({prefix + name: t for name, t in zip(self.CANONICAL, self.canonical())})

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if getattr(self, "panels", None) is not None:  # back to the canonical layout first
            for name, tensor in zip(self.CANONICAL, self.canonical()):
                setattr(self, name, tensor)
            self.panels = None
            del self.STORED, self.KERNEL
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @abstractmethod
    def dense_weight(self) -> torch.Tensor:
        """W as float32 [out, in]."""

    @abstractmethod
    def packed(self) -> list[torch.Tensor]:
        """The tensors that hold W, row-major in the output dimension (for fusing)."""

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt}, bias={self.bias is not None}"


class FloatLinear(PackedLinear):
    """float32, bfloat16 or float16 weights as they are. The first use of the kernel
    rearranges `weight` into `panels` (`to_panels`); the state dict keeps `weight`."""

    STORED = CANONICAL = ("weight",)
    KERNEL = "linear_float"
    PANEL_STORED, PANEL_KERNEL = ("panels",), "linear_float_panels"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.register_buffer("weight", weight.detach().contiguous())
        self.register_buffer("panels", None, persistent=False)
        self.fmt = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[weight.dtype]

    def make_panels(self, kernels):
        return to_panels(self.weight)

    def panel_shape(self):
        return panel_shape(self.out_features, self.in_features, self.weight.dtype), self.weight.dtype

    def canonical_from_panels(self):
        return (from_panels(self.panels),)

    def torch_product(self, rows):
        (weight,) = self.canonical()
        if weight.dtype == torch.float32 or rows.dtype == weight.dtype:
            y = F.linear(rows.to(weight.dtype), weight)
            return (y + self.bias.to(y.dtype)) if self.bias is not None else y
        return super().torch_product(rows)

    def dense_weight(self):
        return self.canonical()[0].float()

    def packed(self):
        return list(self.canonical())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight, read from whichever layout the layer holds (an embedding
        lookup for a tied output layer); panel p holds rows 16p..16p+15 interleaved."""
        if self.panels is None:
            return F.embedding(ids, self.weight)
        flat = ids.reshape(-1)
        picked = self.panels[flat // PANEL, :, flat % PANEL, :]  # [n, in / L, L]
        return picked.reshape(*ids.shape, self.in_features)


class TiedEmbedding(nn.Module):
    """The token embedding of a model whose float output layer is the same matrix: rows are
    read from that layer, so the table is stored once even after the layer has rearranged
    it into panels (before, the embedding kept its own copy: 0.9 GB for a 1.5B model in
    float32). The weights belong to the output layer; this module holds none."""

    def __init__(self, head: FloatLinear):
        super().__init__()
        self._head = (head,)  # a tuple: a reference, not a submodule with a second copy in the state dict

    @property
    def stored(self) -> torch.Tensor:
        """The tensor the table lives in now (for its type and device)."""
        head = self._head[0]
        return head.weight if head.panels is None else head.panels

    @property
    def weight(self) -> torch.Tensor:
        """The table as a [vocab, hidden] tensor (rebuilt, once per call, if it is in panels)."""
        return self._head[0].canonical()[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._head[0].rows(ids)


class GgufEmbedding(nn.Module):
    """A token embedding kept in the GGUF file's own blocks, dequantised row by row on lookup
    with gguf's decoder: the same floats as the whole table decoded at load, in a fraction
    of the memory (the 1.5B demo model's table: 131 MB of 4-bit blocks against 933 MB of
    float32). Used where the output layer does not read the table (loading.keep_embedding_blocks)."""

    # Rows kept once decoded, at most. gguf's decoder costs tens of microseconds a call
    # whatever the number of rows (numpy's per-call overhead), once per decoding step and draft
    # step; a token met before costs a dictionary lookup. 4,096 rows of 1,536 floats: 25 MB.
    CACHED_ROWS = 4096

    def __init__(self, blocks: torch.Tensor, quant_type: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("blocks", blocks)  # [vocab, bytes per row], uint8
        self.quant_type, self.dtype = int(quant_type), dtype
        self._rows: dict[int, torch.Tensor] = {}  # token id -> its decoded row, on the CPU

    @property
    def stored(self) -> torch.Tensor:
        """The tensor the table lives in now (for its device)."""
        return self.blocks

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        wanted = ids.reshape(-1).tolist()
        new = [i for i in dict.fromkeys(wanted) if i not in self._rows]
        fresh = dict(zip(new, self._decode(new))) if new else {}
        for i in new[:max(0, self.CACHED_ROWS - len(self._rows))]:
            self._rows[i] = fresh[i]
        out = torch.stack([self._rows[i] if i in self._rows else fresh[i] for i in wanted])
        return out.reshape(*ids.shape, -1).to(ids.device)

    def _decode(self, ids: list[int]) -> torch.Tensor:
        """The rows of `ids`, decoded by gguf from their blocks: [len(ids), hidden]."""
        from gguf import GGMLQuantizationType, quants

        picked = self.blocks[torch.tensor(ids, device=self.blocks.device)].cpu()  # only these rows leave a GPU
        rows = quants.dequantize(picked.numpy(), GGMLQuantizationType(self.quant_type))
        return torch.from_numpy(rows.reshape(len(ids), -1)).to(self.dtype)


def stored_as_floats(tensor) -> bool:
    """Whether a raw GGUF tensor holds plain floats (F32, F16, BF16) rather than quantised blocks."""
    from gguf import GGMLQuantizationType

    return tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def embedding_from_gguf(tensor, dtype: torch.dtype) -> GgufEmbedding | None:
    """The GGUF token embedding `tensor` kept in its blocks, or None if it is stored as floats."""
    if stored_as_floats(tensor):
        return None
    rows = int(tensor.shape[-1])
    blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(rows, -1))  # a copy: not the file's map
    return GgufEmbedding(blocks, int(tensor.tensor_type), dtype)


def share_tied_embedding(model: nn.Module) -> None:
    """Let the embedding read its rows from a float output layer that holds the same table."""
    head = getattr(model, "lm_head", None)
    backbone = getattr(model, "model", None)
    if (isinstance(head, FloatLinear) and getattr(model.config, "tie_word_embeddings", False)
            and isinstance(getattr(backbone, "embed_tokens", None), nn.Embedding)):
        backbone.embed_tokens = TiedEmbedding(head)


class Int8Linear(PackedLinear):
    """Weight-only int8, symmetric, one float32 scale per output channel. The first use of
    the kernel rearranges `weight` into `panels`, whose kernel carries the activations in
    16-bit fixed point per group of 32 (a relative error of at most 1.5e-5 of the group's
    largest value, finer than bfloat16) and multiplies 16-bit pairs (`vpdpwssd` with AVX-512
    VNNI, `vpmaddwd` with AVX2)."""

    fmt = "int8"
    STORED = ("weight", "scale")
    KERNEL = "linear_int8"
    CANONICAL = ("weight",)
    PANEL_STORED, PANEL_KERNEL = ("panels", "scale"), "linear_int8_panels"

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight.shape[1], weight.shape[0], bias)
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scale", scale.float().contiguous())
        self.register_buffer("panels", None, persistent=False)

    def make_panels(self, kernels):
        return to_panels(self.weight)

    def panel_shape(self):
        return panel_shape(self.out_features, self.in_features, torch.int8), torch.int8

    def canonical_from_panels(self):
        return (from_panels(self.panels),)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        return cls(*int8_from_float(weight), bias)


    def torch_product(self, rows):
        if rows.device.type == "cpu":  # PyTorch's own weight-only int8 kernel
            y = torch.ops.aten._weight_int8pack_mm(rows.float().contiguous(), self.canonical()[0], self.scale)
            return y + self.bias if self.bias is not None else y
        return super().torch_product(rows)

    def dense_weight(self):
        return self.canonical()[0].float() * self.scale[:, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows `ids` of the weight, read from only the panels they lie in."""
        if self.panels is None:
            weight = self.weight[ids]
        else:
            weight = from_panels(self.panels[ids // PANEL])[_within_panels(ids)]
        return weight.float() * self.scale[ids, None]

    def packed(self):
        return [self.canonical()[0], self.scale]


class Int4Linear(PackedLinear):
    """4-bit groups of 32: `nibbles` [out, in/2] uint8 (byte j of a group: weight j low,
    weight j+16 high) and `scales` [out, in/32, 2] float16 (scale s, offset z; w = s*q + z).

    That canonical layout is what the layer is built from, fused, cached and saved as. The
    first use of the kernel rearranges it once into `panels` (16 output columns per panel,
    `linear_int4_panels`) and drops the canonical tensors;
    `state_dict()`, `packed()` and `dense_weight()` still give the canonical layout's contents.
    Layers whose output size is not a multiple of 16 keep the float32 int4 kernel.
    """

    fmt = "int4"
    STORED = CANONICAL = ("nibbles", "scales")
    KERNEL = "linear_int4"
    PANEL_STORED, PANEL_KERNEL = ("panels",), "linear_int4_panels"

    def __init__(self, nibbles: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(nibbles.shape[1] * 2, nibbles.shape[0], bias)
        self.register_buffer("nibbles", nibbles.contiguous())
        self.register_buffer("scales", scales.to(torch.float16).contiguous())
        self.register_buffer("panels", None, persistent=False)  # the state dict holds the canonical layout

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int4Linear":
        return cls(*int4_from_float(weight), bias)

    def make_panels(self, kernels):
        return kernels.int4_to_panels(self.nibbles, self.scales)

    def panel_shape(self):
        return (self.out_features // PANEL, self.in_features // GROUP, INT4_PANEL_GROUP_BYTES), torch.uint8

    def canonical_from_panels(self):
        return int4_from_panels(self.panels)

    def dense_weight(self):
        stored = self.nibbles if self.panels is None else self.panels
        kernels = cpu_kernels() if stored.device.type == "cpu" else None
        if self.panels is None:
            if kernels is not None:
                return kernels.dequantize_int4(self.nibbles, self.scales)
            return int4_to_float(self.nibbles, self.scales)
        if kernels is not None and hasattr(kernels, "dequantize_int4_panels"):
            return kernels.dequantize_int4_panels(self.panels)
        return int4_to_float(*int4_from_panels(self.panels))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 rows `ids` of the weight, read from only the panels they lie in."""
        if self.panels is None:
            return int4_to_float(self.nibbles[ids], self.scales[ids])
        nibbles, scales = int4_from_panels(self.panels[ids // PANEL])
        pick = _within_panels(ids)
        return int4_to_float(nibbles[pick], scales[pick])

    def packed(self):
        return list(self.canonical())


# ------------------------------------------------------------------ panel layouts

def panel_shape(out_features: int, in_features: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """The shape `to_panels` gives a weight [out_features, in_features] of `dtype`."""
    per_dword = 4 // dtype.itemsize
    return out_features // PANEL, in_features // per_dword, PANEL, per_dword


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out/16, in/L, 16, L], L = 4 bytes / element size: each 64-byte line holds
    L consecutive inputs of 16 output columns (the layout of `linear_float_panels` and
    `linear_int8_panels`). For int8 each line holds inputs 4t, 4t+1 of the 16 columns in
    its first half and 4t+2, 4t+3 in its second (pairs side by side), so that widening a
    half to 16 bits gives the pairs `vpdpwssd` multiplies; the shape is the same."""
    out_features, in_features = weight.shape
    if weight.dtype == torch.int8:
        return (weight.reshape(out_features // PANEL, PANEL, in_features // 4, 2, 2)
                .permute(0, 2, 3, 1, 4).contiguous().view(out_features // PANEL, in_features // 4, PANEL, 4))
    per_dword = 4 // weight.element_size()
    return (weight.reshape(out_features // PANEL, PANEL, in_features // per_dword, per_dword)
            .permute(0, 2, 1, 3).contiguous())


def _within_panels(ids: torch.Tensor) -> torch.Tensor:
    """Where each of `ids` lies among the rows of the panels `ids // PANEL`, unpacked in turn."""
    return torch.arange(len(ids), device=ids.device) * PANEL + ids % PANEL


def from_panels(panels: torch.Tensor) -> torch.Tensor:
    """The [out, in] weight of `to_panels`' layout."""
    count, dwords, _, per_dword = panels.shape
    if panels.dtype == torch.int8:
        return panels.view(count, dwords, 2, PANEL, 2).permute(0, 3, 1, 2, 4).reshape(count * PANEL, dwords * 4)
    return panels.permute(0, 2, 1, 3).reshape(count * PANEL, dwords * per_dword)


# ------------------------------------------------------------------ int4 packing

def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """q [..., groups, 32] in 0..15 -> bytes [..., groups, 16]: byte j = q[j] | q[j+16] << 4."""
    q = q.astype(np.uint8)
    return q[..., :16] | (q[..., 16:] << 4)


def int4_to_float(nibbles: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    out_features = nibbles.shape[0]
    groups = nibbles.reshape(out_features, -1, 16)
    q = torch.cat([groups & 15, groups >> 4], dim=-1).float()
    s, z = scales.float().unbind(-1)
    return torch.addcmul(z[..., None], q, s[..., None]).reshape(out_features, -1)


def int4_from_panels(panels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The canonical (nibbles, scales) of the int4 kernel's panel layout [out/16, in/32, 320]:
    per panel and group, 16 scales and 16 offsets as float16, then 4 chunks of 64 bytes in
    which dword j of chunk t is column j's group bytes 4t..4t+3."""
    count, groups = panels.shape[:2]
    scales = panels[..., :64].contiguous().view(torch.float16).reshape(count, groups, 2, PANEL)
    scales = scales.permute(0, 3, 1, 2).reshape(count * PANEL, groups, 2)
    nibbles = panels[..., 64:].reshape(count, groups, 4, PANEL, 4).permute(0, 3, 1, 2, 4)
    return nibbles.reshape(count * PANEL, groups * GROUP // 2), scales.contiguous()


def round_activations(x: torch.Tensor, levels: int = 127) -> torch.Tensor:
    """x as the integer panel kernels see it: each row rounded in groups of 32 along the
    features to integers in [-levels, levels] (dx = max|x| / levels, dx * round(x / dx)); 127 for the
    int4 kernel's int8 activations, 32767 for the int8 kernel's 16-bit ones. Those kernels
    compute exactly the product of their weights with these values, up to float32 rounding."""
    g = x.float().reshape(*x.shape[:-1], -1, GROUP)
    dx = g.abs().amax(-1, keepdim=True) / levels
    q = torch.round(g / torch.where(dx > 0, dx, torch.ones_like(dx))).clamp(-levels, levels)
    return (q * dx).reshape(x.shape)


ROWS_AT_ONCE = 8192  # rows quantised together, so that the float temporaries stay small


def _in_row_chunks(convert, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """convert(weight) a few thousand rows at a time, or None where one call will do. Each row
    is quantised on its own, so the result is the same; the temporaries are not: a whole
    output layer of 151,936 rows made several of 0.93 GB each."""
    if weight.dim() != 2 or weight.shape[0] <= ROWS_AT_ONCE:
        return None
    parts = [convert(weight[first:first + ROWS_AT_ONCE]) for first in range(0, weight.shape[0], ROWS_AT_ONCE)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def int8_from_float(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row (the last dimension is the input): (q, float32 scale)."""
    if (chunked := _in_row_chunks(int8_from_float, weight)) is not None:
        return chunked
    w = weight.detach().float()
    scale = w.abs().amax(dim=-1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def int4_from_float(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantisation per group of 32: s = (max - min)/15, z = min."""
    if (chunked := _in_row_chunks(int4_from_float, weight)) is not None:
        return chunked
    w = weight.detach().float()
    rows, cols = w.shape
    if cols % GROUP:
        raise ValueError(f"int4 needs the input size to be a multiple of {GROUP}, got {cols}")
    g = w.reshape(rows, cols // GROUP, GROUP)
    low, high = g.amin(-1), g.amax(-1)
    scale = ((high - low) / 15).to(torch.float16).float()
    offset = low.to(torch.float16).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - offset[..., None]) / safe[..., None]).clamp(0, 15)
    q = q.to(torch.uint8)  # packed with torch, on whatever device the weight is
    nibbles = (q[..., :16] | (q[..., 16:] << 4)).reshape(rows, cols // 2)
    return nibbles, torch.stack([scale, offset], -1).to(torch.float16)


def _halves(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scales and mins of Q4_K's 8 sub-blocks, from its 12 packed bytes."""
    s = packed.astype(np.uint8)
    low_sc, low_min = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    high_min = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return (np.concatenate([low_sc, high_sc], -1).astype(np.float32),
            np.concatenate([low_min, high_min], -1).astype(np.float32))


def int4_from_gguf(tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Repack a GGUF Q4_0 / Q4_1 / Q4_K tensor as (nibbles, scales); None for other types."""
    kind = tensor.tensor_type.name
    rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
    data = np.asarray(tensor.data).reshape(rows, -1)
    if kind in ("Q4_0", "Q4_1"):
        blocks = data.reshape(rows, cols // 32, 18 if kind == "Q4_0" else 20)
        d = _halves(blocks, 0)
        nibbles = blocks[..., 2:18] if kind == "Q4_0" else blocks[..., 4:20]
        scale, offset = (d, -8.0 * d) if kind == "Q4_0" else (d, _halves(blocks, 2))
    elif kind == "Q4_K":
        blocks = data.reshape(rows, cols // 256, 144)
        d, dmin = _halves(blocks, 0), _halves(blocks, 2)
        sc, mn = _q4_k_scales(blocks[..., 4:16])
        scale = (d[..., None] * sc).reshape(rows, -1)
        offset = (-dmin[..., None] * mn).reshape(rows, -1)
        # each 32-byte chunk holds sub-block 2c in its low nibbles and 2c+1 in its high ones
        qs = blocks[..., 16:].reshape(rows, cols // 256, 4, 1, 32)
        q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(rows, cols // 32, 32)
        nibbles = _pack_nibbles(q)
    else:
        return None
    scales = np.stack([scale, offset], -1).astype(np.float16)
    return (torch.from_numpy(np.ascontiguousarray(nibbles).reshape(rows, cols // 2)),
            torch.from_numpy(np.ascontiguousarray(scales)))


# ------------------------------------------------------------------ building and fusing

def pack_linear(linear: nn.Linear, fmt: str, gguf_tensor=None) -> PackedLinear:
    """One nn.Linear in the weight format `fmt` (int4 from GGUF blocks when it can; with
    "int4-mixed", int8 where the GGUF tensor holds more than 4 bits per weight)."""
    bias = linear.bias
    if fmt in ("int4", "int4-mixed"):
        if linear.in_features % GROUP:
            return Int8Linear.from_float(linear.weight, bias)  # no whole groups: int8 instead
        packed = int4_from_gguf(gguf_tensor) if gguf_tensor is not None else None
        if packed is not None:
            return Int4Linear(*packed, bias)
        if fmt == "int4-mixed" and gguf_tensor is not None and gguf_tensor.tensor_type.name in MORE_THAN_4_BITS:
            return Int8Linear.from_float(linear.weight, bias)
        return Int4Linear.from_float(linear.weight, bias)
    if fmt == "int8":
        return Int8Linear.from_float(linear.weight, bias)
    if fmt in FLOAT_DTYPES:
        return FloatLinear(linear.weight.to(FLOAT_DTYPES[fmt]), bias)
    raise ValueError(f"unknown weight format {fmt!r}; choose from {', '.join(FORMATS)}")


def fuse(parts: Sequence[PackedLinear]) -> PackedLinear:
    """One product whose outputs are the parts' outputs side by side."""
    kinds = {type(p) for p in parts}
    if len(kinds) > 1:  # mixed formats (int4 and an int8 fallback): keep int8 for all
        parts = [p if isinstance(p, Int8Linear) else Int8Linear.from_float(p.dense_weight(), p.bias)
                 for p in parts]
    biases = [p.bias for p in parts]
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else torch.zeros(p.out_features) for b, p in zip(biases, parts)])
    else:
        bias = None
    tensors = [torch.cat(group, dim=0) for group in zip(*(p.packed() for p in parts))]
    return type(parts[0])(*tensors, bias)


def _linear_children(module: nn.Module, names: Sequence[str]) -> list[nn.Linear] | None:
    children = [getattr(module, n, None) for n in names]
    return children if all(isinstance(c, nn.Linear) for c in children) else None


def pack_projections(root: nn.Module, fmt: str, gguf_tensors: dict, prefix: str = "") -> None:
    """Put every projection and expert stack under `root` (named `prefix` in the model) in
    weight format `fmt`, in place, fusing q/k/v and gate/up; what is packed already stays."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose from {', '.join(FORMATS)}")
    from verispec.models.moe import StackedExperts

    def pack(module_prefix: str, name: str, linear: nn.Linear) -> PackedLinear:
        return pack_linear(linear, fmt, gguf_tensors.get(f"{module_prefix}{name}.weight"))

    for name, module in list(root.named_modules()):
        module_prefix = prefix + (f"{name}." if name else "")
        for fused, names in getattr(type(module), "FUSED", {}).items():
            children = _linear_children(module, names)
            if children is not None:
                setattr(module, fused, fuse([pack(module_prefix, n, c) for n, c in zip(names, children)]))
                for n in names:
                    delattr(module, n)
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, pack(module_prefix, child_name, child))
        if isinstance(module, StackedExperts) and module.kind == "float":  # not packed at loading
            module.pack(fmt)


def quantize_model(model: nn.Module, fmt: str, gguf_tensors: dict | None = None) -> nn.Module:
    """Put every projection of `model` in weight format `fmt`, in place.

    q/k/v become one `qkv_proj` and gate/up one `gate_up_proj` (fewer, larger products); a
    tied output layer gets its own packed copy of the embedding in int8 and int4, and is the
    embedding's only copy in float formats (`TiedEmbedding`). `gguf_tensors` maps weight
    names to raw GGUF tensors, which int4 repacks directly and "int4-mixed" reads the
    stored precision of (a fused product with any int8 part is int8 throughout).
    """
    gguf_tensors = gguf_tensors or {}
    pack_projections(model, fmt, gguf_tensors)
    if getattr(model, "lm_head", "absent") is None and hasattr(model, "model"):
        embedding = model.model.embed_tokens.weight
        head = nn.Linear(embedding.shape[1], embedding.shape[0], bias=False)
        head.weight = nn.Parameter(embedding, requires_grad=False)
        model.lm_head = pack_linear(head, fmt, gguf_tensors.get("model.embed_tokens.weight"))
        if model.lm_head.canonical()[0].data_ptr() == embedding.data_ptr():
            share_tied_embedding(model)  # float formats: one table for both
    from verispec.fast import attach_fast_path
    attach_fast_path(model)
    return model


def panels_in_one_buffer(model: nn.Module, kernels) -> None:
    """Switch every packed layer that has a panel layout to it now, all panels in one buffer,
    in the order the layers run.

    torch backs a buffer of 2 MB or more with huge pages (`import verispec` asks it to), but
    only the whole 2 MB pages inside it: a buffer per layer left each one's last part on 4 KB
    pages, a third of a 1.5B model's 3 MB q/k/v product, which the kernels read up to a tenth
    slower (benchmarks/weight_streams.py: panels-4k). In one buffer all but the last 2 MB sit
    on huge pages, and one step reads it from start to end."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear) and m.panels_apply(kernels)]
    if not layers:
        return
    specs = [m.panel_shape() for m in layers]
    offsets, total = [], 0
    for shape, dtype in specs:
        offsets.append(total)
        total += -(-math.prod(shape) * dtype.itemsize // 64) * 64  # each starts on a cache line
    buffer = torch.empty(total, dtype=torch.uint8)
    for layer, (shape, dtype), offset in zip(layers, specs, offsets):
        size = math.prod(shape) * dtype.itemsize
        layer._use_panels(kernels, into=buffer[offset:offset + size].view(dtype).view(shape))


def weight_bytes(model: nn.Module) -> int:
    """Bytes one decoding step reads: every weight except the embedding lookup table
    (which counts when it doubles as the output layer). Storage shared by two names counts once."""
    total = 0
    seen: set[int] = set()
    has_head = getattr(model, "lm_head", None) is not None
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if "rope_" in name or (has_head and "embed_tokens." in name):
            continue
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total
