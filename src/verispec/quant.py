"""Weight formats: float32/bfloat16/float16 as they are, int8 per-channel and int4 group-wise.

`quantize_model` swaps every nn.Linear in the decoder blocks for a quantised one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Int8Linear(nn.Module):
    """Weight-only int8 with one float scale per output channel."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(linear.weight.dtype))
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.weight, self.scale)
        out = out.reshape(*shape[:-1], self.out_features)
        return out + self.bias if self.bias is not None else out


def quantize_model(model: nn.Module, fmt: str, gguf_tensors: dict | None = None) -> nn.Module:
    if fmt != "int8":
        raise NotImplementedError(f"weight format {fmt}")
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child_name != "lm_head":
                setattr(module, child_name, Int8Linear(child))
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes one decoding step reads: every weight except the embedding lookup table
    (which counts once more when it doubles as the output layer)."""
    total = 0
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if "rope_" in name:
            continue
        if name.endswith("embed_tokens.weight"):
            if getattr(model, "lm_head", None) is None:
                total += tensor.numel() * tensor.element_size()
            continue
        total += tensor.numel() * tensor.element_size()
    return total
