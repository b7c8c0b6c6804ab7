"""Logits -> probabilities (temperature, top-k, top-p) and drawing a token.

Both the target and the draft pass through the same warping, so speculative
sampling reproduces exactly the distribution that plain sampling draws from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from verispec.errors import VerispecError
from verispec.events import Logprob
from verispec.kernels import cpu_kernels
from verispec.values import is_number, is_whole

# torch.Generator.manual_seed takes any integer that fits in 64 bits, signed or unsigned
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not is_number(self.temperature, 0):
            raise VerispecError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not is_whole(self.top_k, 0):
            raise VerispecError(f"top-k must be a whole number >= 0, got {self.top_k!r}")
        if not is_number(self.top_p, high=1) or self.top_p <= 0:
            raise VerispecError(f"top-p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not is_whole(self.seed, SEED_MIN, SEED_MAX):
            raise VerispecError(f"seed must be an integer from {SEED_MIN} to {SEED_MAX}, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        """The random stream of one request. It lives on the CPU whatever device the model is
        on (every draw moves its probability rows there first), so a seed gives the same
        tokens on any device for the same probabilities."""
        gen = torch.Generator()
        if self.seed is not None:
            gen.manual_seed(self.seed)
        else:
            gen.seed()
        return gen


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Float32 probabilities over the last dimension after temperature, top-k and top-p."""
    logits = logits.float()
    if params.greedy:
        # a one-hot on the argmax: greedy decoding is sampling at temperature 0
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    if logits.device.type == "cpu":
        return _warp_on_one_thread(logits, params)
    return _warp_with_torch(logits, params)


def _warp_with_torch(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The warp in torch's operations, every row at once (on an accelerator)."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest set whose mass reaches top_p (the first token always stays)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


# top-p sorts the ids of at least the first floor's probability (at most 1,000 of them), then the
# next floor's while they hold too little (usually a few ids hold it)
NUCLEUS_FLOORS = (1e-3, 1e-5, 0.0)


def _warp_on_one_thread(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The warp of `_warp_with_torch` on the CPU, row by row in one buffer, on this thread,
    through the CPU kernels (NumPy where they are not built). A row of the vocabulary is too
    short to be worth waking torch's second thread for, a new tensor per operation faults fresh
    pages in, and top-p need not sort the whole vocabulary: only the few ids that hold its mass
    (`benchmarks/overhead.py` times the ways). Where the kernels are built the warp is theirs:
    a softmax in three reads of the row where NumPy's operations take six, with an exp that
    does not depend on NumPy's build; top-k's k-th largest from a heap that most of the row
    passes by, where NumPy's partition moves the whole row; top-p's search for the ids above
    its floor in one comparison per 16 ids."""
    kernels = cpu_kernels()
    if kernels is not None:
        rows = torch.from_numpy(np.array(np.asarray(logits.detach()), dtype=np.float32, order="C"))
        if params.top_k and params.top_k < rows.shape[-1]:
            kernels.top_k_(rows, 1.0 / params.temperature, params.top_k)
        else:
            kernels.softmax_(rows, 1.0 / params.temperature)
        if params.top_p < 1.0:
            kernels.nucleus_(rows, params.top_p, NUCLEUS_FLOORS)
        return rows
    out = np.divide(np.asarray(logits.detach()), np.float32(params.temperature), dtype=np.float32)
    for row in out.reshape(-1, out.shape[-1]):
        ids = None  # the ids top-k keeps, where it applies
        if params.top_k and params.top_k < row.size:
            kth = np.partition(row, row.size - params.top_k)[row.size - params.top_k]
            ids = np.flatnonzero(row >= kth)  # ties with the k-th stay, as in torch's masking
            kept = np.exp(row[ids] - row.max())
            row[:] = 0.0
            row[ids] = kept / kept.sum()
        else:
            row -= row.max()
            np.exp(row, out=row)
            row /= row.sum()
        if params.top_p < 1.0:
            _keep_nucleus(row, params.top_p, ids)
    return torch.from_numpy(out)


def _keep_nucleus(row: np.ndarray, top_p: float, ids: np.ndarray | None = None) -> None:
    """Top-p on one row of probabilities, in place: the most probable ids (of `ids`, where only
    they can be nonzero), each kept while the mass before it is below top_p (so the first always
    stays), renormalised. Only the ids of at least a floor's probability are sorted, the floor
    lowered until they hold top_p: no id below them can be kept then."""
    values = row if ids is None else row[ids]
    for floor in NUCLEUS_FLOORS:
        head = np.flatnonzero(values >= floor) if floor > 0 else np.arange(values.size)
        order = head[np.argsort(-values[head], kind="stable")]
        ranked = values[order]
        mass = np.cumsum(ranked, dtype=np.float64)
        if mass.size and mass[-1] >= top_p:
            break
    keep = mass - ranked < top_p
    kept = ranked[keep]
    row[:] = 0.0
    row[order[keep] if ids is None else ids[order[keep]]] = kept / kept.sum()


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of [rows, vocab] logits: the first of equal maxima, as
    torch.argmax gives it. Float32 logits on the CPU go through NumPy, about ten times faster
    over a 150k vocabulary (`benchmarks/overhead.py` compares the two): every decoding step,
    verification and draft step takes one."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return np.asarray(logits.detach()).argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def greedy_token(logits: torch.Tensor) -> int:
    """The argmax of one row of logits."""
    return greedy_tokens(logits.reshape(1, -1))[0]


_BLOCK = 1024  # ids per block of the two-level search in sample()


def sample(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One token drawn from one row of nonnegative weights (probabilities, or a residual not yet
    normalised), with the request's CPU generator.

    By inverting the cumulative sum at one uniform draw: first over blocks of ids, then within
    the block it falls in, both sums in float64 (NumPy's, which sum a float32 row without a copy).
    torch.multinomial draws one exponential per id, 3.4 ms over a 152k vocabulary on
    this project's CPUs; a sampled draft token and every sampled target token pay the draw.
    An id of weight zero is never drawn."""
    row = np.ascontiguousarray(weights.detach().reshape(-1).cpu().float().numpy())
    whole = row.size - row.size % _BLOCK
    sums = row[:whole].reshape(-1, _BLOCK).sum(1, dtype=np.float64)
    if whole < row.size:
        sums = np.append(sums, row[whole:].sum(dtype=np.float64))
    ends = np.cumsum(sums)
    total = float(ends[-1]) if ends.size else 0.0
    if not 0 < total < float("inf"):
        raise VerispecError(f"cannot sample from weights that sum to {total}")
    u = float(torch.rand((), generator=generator, dtype=torch.float64)) * total
    block = _landing(ends, sums, u)
    start = block * _BLOCK
    chunk = row[start:start + _BLOCK]
    before = float(ends[block - 1]) if block else 0.0
    return start + _landing(np.cumsum(chunk, dtype=np.float64) + before, chunk, u)


def _landing(ends: np.ndarray, sizes: np.ndarray, u: float) -> int:
    """The first position whose running sum passes u; where rounding carries u past the last
    one, the last position with any weight."""
    index = int(np.searchsorted(ends, u, side="right"))
    if index >= ends.size or sizes[index] <= 0:
        index = int(np.flatnonzero(sizes > 0)[-1])
    return index


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from one row of logits."""
    if params.greedy:
        return greedy_token(logits)
    return sample(probabilities(logits, params), generator)


LOGPROB_FLOOR = -9999.0  # what an impossible id (a masked logit) reports, as OpenAI does: JSON has no -inf


def token_logprob(logits: torch.Tensor, token: int, top: int = 0) -> Logprob:
    """One row's log-softmax at `token`, and its `top` most likely ids (ties: the lower id
    first). The row of logits as the model gave it: the target's own distribution, before
    temperature, top-k and top-p. The sum over the row is in float64; a row depends on nothing
    but its logits, so a kept draft, whose row comes from a verification pass, reports what a
    plain step reports wherever the two passes' logits agree."""
    row = np.asarray(logits.detach().float().cpu()).reshape(-1)
    top = min(top, row.size)
    peak = row.max()
    log_total = math.log(np.exp(row - peak).sum(dtype=np.float64))
    ids = np.argpartition(row, -top)[-top:] if top else np.empty(0, dtype=np.int64)
    ids = ids[np.lexsort((ids, -row[ids]))]
    alternatives = tuple((int(i), _floored(float(row[i] - peak) - log_total)) for i in ids)
    return Logprob(_floored(float(row[token] - peak) - log_total), alternatives)


def _floored(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)
