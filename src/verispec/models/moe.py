"""Sparse mixture-of-experts decoders: Qwen2-MoE, Qwen3-MoE and Mixtral.

The blocks are the dense ones (see dense.py) with the SwiGLU replaced by a sparse
block in the layers that have one: a router scores the experts for every token,
the top k run, and their outputs are summed with the router's weights. Qwen2-MoE
adds a shared expert that every token goes through, scaled by a sigmoid gate.

Routing rules, as each family's reference implementation has them:
    Qwen2-MoE / Qwen3-MoE: softmax over all experts, take the top k, and
        renormalise the k weights to sum to 1 only when `norm_topk_prob` is set;
    Mixtral: take the top k logits, softmax over those k.

Expert weights are stacked per layer, [experts, out, in], under
`mlp.experts.{gate,up,down}_proj`: the layout GGUF's `ffn_*_exps` tensors have.
`sanitize` brings Hugging Face checkpoints (one tensor per expert, Mixtral's
`block_sparse_moe.experts.N.w1/w2/w3`, or a fused `gate_up_proj`) to it.

A verify pass over m positions reads every expert that any of them picked, so each
block records how many distinct experts its last pass ran (`experts_touched`).
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from verispec.config import ModelConfig
from verispec.errors import CorruptModelError
from verispec.kernels import cpu_kernels
from verispec.models.common import SwiGLU
from verispec.models.dense import CausalLM, DecoderLayer
from verispec.quant import (FLOAT_DTYPES, GROUP, KERNEL_LANES, KERNEL_MAX_ROWS, int4_from_float, int4_to_float,
                            int8_from_float)

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class StackedExperts(nn.Module):
    """E SwiGLU experts: gate_proj, up_proj [E, ff, hidden] and down_proj [E, hidden, ff].

    `pack(fmt)` stores them in a weight format, as quant.py does for single layers:
    `kind` "float" keeps the three stacks in float32, bfloat16 or float16; "int8" holds
    them as int8 with one float32 scale per output row (`*_scale`, [E, out]); "int4" as
    nibbles [E, out, in/2] with float16 (scale, offset) per group of 32 (`*_scales`,
    [E, out, in/32, 2]), the layout of `quant.Int4Linear`.
    """

    kind = "float"
    EXTRA = {"float": (), "int8": ("_scale",), "int4": ("_scales",)}  # per projection, beside it

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        kernels = self._kernels(x)
        if kernels is None:
            gate, up, down = (self.dense_weight(name, expert).to(x.dtype) for name in PROJECTIONS)
            return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
        # verispec's products give each row the same bits however many rows an expert gets
        # (PyTorch's do not), so a verification pass routes to the bits of plain steps
        rows = x.float().contiguous()
        hidden = F.silu(self._product(kernels, "gate_proj", expert, rows)) * self._product(kernels, "up_proj", expert, rows)
        return self._product(kernels, "down_proj", expert, hidden).to(x.dtype)

    def _product(self, kernels, name: str, expert: int, rows: torch.Tensor) -> torch.Tensor:
        weight = getattr(self, name)[expert]
        if self.kind == "int8":
            return kernels.linear_int8(rows, weight, getattr(self, name + "_scale")[expert], None, None)
        if self.kind == "int4":
            return kernels.linear_int4(rows, weight, getattr(self, name + "_scales")[expert], None, None)
        return kernels.linear_float(rows, weight, None, None)

    def _kernels(self, x: torch.Tensor):
        """The CPU kernels, where they take these rows and weights; else None."""
        if x.device.type != "cpu" or x.shape[0] > KERNEL_MAX_ROWS:
            return None
        if self.gate_proj.shape[-1] * self._inputs_per_element() % KERNEL_LANES:
            return None
        if self.down_proj.shape[-1] * self._inputs_per_element() % KERNEL_LANES:
            return None
        return cpu_kernels()

    def _inputs_per_element(self) -> int:
        return 2 if self.kind == "int4" else 1  # two 4-bit weights per stored byte

    def dense_weight(self, name: str, expert: int) -> torch.Tensor:
        """One expert's projection `name` as a float [out, in] tensor (float32 unless stored as a float)."""
        weight = getattr(self, name)[expert]
        if self.kind == "int8":
            return weight.float() * getattr(self, name + "_scale")[expert][:, None]
        if self.kind == "int4":
            return int4_to_float(weight, getattr(self, name + "_scales")[expert])
        return weight

    def pack(self, fmt: str) -> None:
        """Store the experts in weight format `fmt` (see quant.FORMATS), in place."""
        if self.kind != "float":
            raise ValueError(f"the experts are packed already ({self.kind})")
        kind = expert_kind(fmt, *(getattr(self, name).shape[-1] for name in PROJECTIONS))
        for name in PROJECTIONS:
            stored, extra = pack_stack(getattr(self, name).detach(), fmt, kind)
            setattr(self, name, nn.Parameter(stored, requires_grad=False))
            if extra is not None:
                self.register_buffer(name + self.EXTRA[kind][0], extra)
        self.kind = kind

    def expect(self, kind: str) -> None:
        """Take the tensors' shapes and types of `kind` before a state dict of that kind is
        assigned (on a model built on the meta device, as the weight cache does: packing
        meta tensors computes nothing)."""
        if kind != "float":
            self.pack(kind)

    def bytes_per_expert(self) -> int:
        """Bytes one expert's three projections hold, scales included."""
        names = [name + suffix for name in PROJECTIONS for suffix in ("", *self.EXTRA[self.kind])]
        return sum(getattr(self, n)[0].numel() * getattr(self, n).element_size() for n in names)


def expert_kind(fmt: str, *input_sizes: int) -> str:
    """How experts are stored in weight format `fmt`: "float", "int8" or "int4" (int4 needs
    every projection's input size to be a multiple of 32; otherwise all three are int8)."""
    if fmt in FLOAT_DTYPES:
        return "float"
    return "int4" if fmt in ("int4", "int4-mixed") and all(n % GROUP == 0 for n in input_sizes) else "int8"


def pack_stack(weight: torch.Tensor, fmt: str, kind: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One projection's expert stack [E, out, in] as `kind` stores it: (stored, extra tensor or None)."""
    if kind == "float":
        return weight.to(FLOAT_DTYPES[fmt]), None
    convert = int8_from_float if kind == "int8" else int4_from_float
    if weight.is_meta:  # shapes and types only
        stored, extra = convert(weight.reshape(-1, weight.shape[-1]))
        return tuple(t.reshape(weight.shape[0], weight.shape[1], *t.shape[1:]) for t in (stored, extra))
    parts = [convert(expert) for expert in weight]  # one expert at a time: the temporaries of one
    return torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])


def expect_packed_experts(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Before `state` is assigned to `model` (built on the meta device): give each stack of
    experts the storage `state` holds it in, packed as the weights were decoded."""
    for name, module in model.named_modules():
        if isinstance(module, StackedExperts):
            for kind, suffixes in StackedExperts.EXTRA.items():
                if suffixes and f"{name}.gate_proj{suffixes[0]}" in state:
                    module.expect(kind)


class SparseMoeBlock(nn.Module):
    """Router, top-k experts and an optional gated shared expert."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden = config.hidden_size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.softmax_over_top_k = config.model_type == "mixtral"
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(hidden, self.num_experts, bias=False)
        # Mixtral's experts are as wide as its (unused) dense MLP
        intermediate = config.moe_intermediate_size or config.intermediate_size
        self.experts = StackedExperts(self.num_experts, hidden, intermediate)
        shared = config.shared_expert_intermediate_size
        self.shared_expert = SwiGLU(hidden, shared) if shared else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if shared else None
        self.experts_touched = 0  # distinct experts run by the last forward pass

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts), both [tokens, top_k], for tokens x [tokens, hidden]."""
        logits = self.gate(x).float()
        if self.softmax_over_top_k:
            top_logits, experts = logits.topk(self.top_k, dim=-1)
            weights = top_logits.softmax(dim=-1)
        else:
            weights, experts = logits.softmax(dim=-1).topk(self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.route(flat)
        out = self._run_experts(flat, weights, experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(x.shape)

    def _run_experts(self, flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Run each chosen expert once, on just the tokens routed to it."""
        slots = experts.reshape(-1)  # slot s belongs to token s // top_k
        order = torch.argsort(slots, stable=True)  # slots grouped by expert
        counts = torch.bincount(slots, minlength=self.num_experts).tolist()  # the one host sync
        token_of_slot = order // self.top_k
        inputs = flat.index_select(0, token_of_slot)
        outputs, begin = [], 0
        for expert, count in enumerate(counts):
            if count:
                outputs.append(self.experts(inputs[begin:begin + count], expert))
                begin += count
        self.experts_touched = len(outputs)
        scaled = torch.cat(outputs) * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(flat).index_add_(0, token_of_slot, scaled)


def is_sparse_layer(config: ModelConfig, layer_index: int) -> bool:
    """Whether a layer has experts; the others have a dense SwiGLU of intermediate_size."""
    step = max(config.decoder_sparse_step, 1)
    return layer_index not in config.mlp_only_layers and (layer_index + 1) % step == 0


def _attention_config(config: ModelConfig) -> ModelConfig:
    """Mixtral applies its sliding window whenever one is set; Qwen needs use_sliding_window."""
    if config.model_type == "mixtral" and config.extra.get("sliding_window"):
        return dataclasses.replace(config, extra={**config.extra, "use_sliding_window": True})
    return config


class ExpertAccounting:
    """What the lab asks of any model with sparse layers: which experts the last pass read."""

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]

    def experts_touched(self) -> list[int]:
        """Distinct experts the last forward pass ran, per sparse layer."""
        return [block.experts_touched for block in self.moe_blocks()]

    def touched_expert_bytes(self) -> int:
        """Bytes of expert weights the last forward pass read (shared experts and routers excluded)."""
        return sum(b.experts_touched * b.experts.bytes_per_expert() for b in self.moe_blocks())


class MoeCausalLM(ExpertAccounting, CausalLM):
    """A decoder whose sparse layers route tokens to experts; see the module notes."""

    def __init__(self, config: ModelConfig):
        layer_config = _attention_config(config)
        layers = [
            DecoderLayer(layer_config, i, mlp=SparseMoeBlock(config) if is_sparse_layer(config, i)
                         else SwiGLU(config.hidden_size, config.intermediate_size))
            for i in range(config.num_hidden_layers)
        ]
        super().__init__(config, layers)

    @staticmethod
    def sanitize(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hugging Face or GGUF names -> stacked expert tensors. Moves tensors out of `state`."""
        return _stack_experts(_rename(state))


_MIXTRAL_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_EXPERT = re.compile(r"(.*\.mlp\.experts\.\d+)\.(w[123])\.weight")
_ONE_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_STACKED_WITH_SUFFIX = re.compile(r"(.*\.mlp\.experts\.(?:gate_proj|up_proj|down_proj))\.weight")


def _rename(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    renamed = {}
    for name in list(state):
        value = state.pop(name)
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if match := _MIXTRAL_EXPERT.fullmatch(name):
            name = f"{match.group(1)}.{_MIXTRAL_PROJECTIONS[match.group(2)]}.weight"
        elif match := _STACKED_WITH_SUFFIX.fullmatch(name):
            name = match.group(1)  # GGUF's ffn_*_exps come with a .weight suffix
        elif name.endswith(".mlp.shared_expert_gate.weight") and value.dim() == 1:
            value = value.unsqueeze(0)  # GGUF keeps this [1, hidden] gate as a vector
        renamed[name] = value
    return renamed


def _stack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    per_expert: dict[str, dict[int, str]] = defaultdict(dict)
    for name in list(state):
        if match := _ONE_EXPERT.fullmatch(name):
            prefix, expert, projection = match.groups()
            per_expert[f"{prefix}.{projection}"][int(expert)] = name
        elif name.endswith(".mlp.experts.gate_up_proj"):
            # transformers' fused layout: [E, 2 * ff, hidden], gate rows first
            gate, up = state.pop(name).chunk(2, dim=1)
            prefix = name.removesuffix(".gate_up_proj")
            state[f"{prefix}.gate_proj"], state[f"{prefix}.up_proj"] = gate.contiguous(), up.contiguous()
    for stacked_name, names in per_expert.items():
        if sorted(names) != list(range(len(names))):
            missing = sorted(set(range(max(names) + 1)) - set(names))
            raise CorruptModelError(f"{stacked_name}: no weights for expert(s) {missing}")
        state[stacked_name] = torch.stack([state.pop(names[e]) for e in range(len(names))])
    return state
