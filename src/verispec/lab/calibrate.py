"""Measure this machine for the cost model: bandwidth, matmul FLOP/s, and a model's t(m).

t(m) is the time of one target pass over m positions on top of a filled cache,
the shape of a verify pass. Sizes are timed round-robin (every m once per
repeat, after a warm-up of each), so that a slow drift in machine load moves
every size alike and the ratios r(m) = t(m) / t(1) stay fair; each size's
figure is the median of its repeats. The cache is rolled back after every pass,
so each one sees the same context.

A profile is saved as JSON:

    {"format": "verispec-calibration/1", "created": ..., "machine": {...},
     "copy_bytes_per_s": ..., "read_bytes_per_s": ..., "matmul_flops_per_s": ...,
     "target": {"model", "weights", "context", "positions": [1..M], "seconds": [...],
                "weight_bytes"}, "draft": {... the same, usually positions [1, 2], with
                "prefill_lengths" and "prefill_seconds": the draft reading prompts of those
                lengths, a cost a draft model pays once per request}}

`load_profile(path)` reads one back; `profile.costs()` gives the cost model's MeasuredCosts.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from verispec.errors import VerispecError
from verispec.lab.costmodel import Hardware, MeasuredCosts
from verispec.spec.draft_model import draft_vocab_limit

PROFILE_FORMAT = "verispec-calibration/1"


# ---------------------------------------------------------------- the machine

def processor_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> float | None:
    """The one-minute load average (None where the system does not say)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def machine_facts(device: str = "cpu") -> dict[str, Any]:
    facts = {
        "processor": processor_name(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": device,
        "platform": platform.platform(),
        "load_average": load_average(),  # other work on the machine skews every timing
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        facts["accelerator"] = torch.cuda.get_device_name(torch.device(device))
    return facts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def measure_bandwidth(size_bytes: int = 512 * 2**20, repeats: int = 5, device: str = "cpu") -> tuple[float, float]:
    """(copy, read) bytes per second: a big tensor copy (read + write counted) and a sum (read only)."""
    dev = torch.device(device)
    src = torch.ones(size_bytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    copy_s = _median_time(lambda: dst.copy_(src), repeats, dev)
    read_s = _median_time(lambda: src.sum(), repeats, dev)
    return 2 * size_bytes / copy_s, size_bytes / read_s


def measure_matmul_flops(size: int = 2048, repeats: int = 5, device: str = "cpu") -> float:
    """FLOP/s of a square float32 matrix product (bfloat16 on CUDA, where the tensor cores are)."""
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=dev, dtype=dtype)
    b = torch.randn(size, size, device=dev, dtype=dtype)
    seconds = _median_time(lambda: a @ b, repeats, dev)
    return 2 * size**3 / seconds


# ---------------------------------------------------------------- a model's passes

@dataclass
class ModelTiming:
    model: str
    weights: str
    context: int
    positions: list[int]
    seconds: list[float]  # median time of one pass over positions[i]
    weight_bytes: int = 0
    prefill_lengths: list[int] = field(default_factory=list)  # prompts read into an empty cache
    prefill_seconds: list[float] = field(default_factory=list)
    vocab: int | None = None  # a draft's first ids whose logits its passes computed; None: all

    def t(self, positions: int) -> float:
        return self.seconds[self.positions.index(positions)]

    @property
    def r(self) -> list[float]:
        """r(m) = t(m) / t(1) for every measured m."""
        return [s / self.t(1) for s in self.seconds]


@torch.inference_mode()
def time_passes(model: torch.nn.Module, positions: Sequence[int], context: int = 64, repeats: int = 5,
                last_only: bool = False, seed: int = 0, outputs: int | None = None) -> list[float]:
    """Median seconds of one pass over m positions after `context` cached ones, for each m.

    `last_only` matches how the pass is used: a verify pass wants logits for
    every position, a draft step only for the last; `outputs`, the logits of only the first
    ids, as a draft with a limited vocabulary computes.
    """
    if not positions or min(positions) < 1:
        raise VerispecError("positions to time must be whole numbers >= 1")
    if repeats < 1:
        raise VerispecError(f"repeats must be >= 1, got {repeats}")
    weight = next(model.parameters())
    device = weight.device
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    cache = model.new_cache(context + max(positions))
    model(torch.randint(0, vocab, (1, context), generator=generator).to(device), cache, last_only=True)
    inputs = {m: torch.randint(0, vocab, (1, m), generator=generator).to(device) for m in positions}
    limited = {} if outputs is None else {"outputs": outputs}

    def one_pass(m: int) -> float:
        _sync(device)
        started = time.perf_counter()
        model(inputs[m], cache, last_only=last_only, **limited)
        _sync(device)
        elapsed = time.perf_counter() - started
        cache.rollback(context)
        return elapsed

    for m in positions:  # warm-up: first calls allocate and pick kernels
        one_pass(m)
    samples: dict[int, list[float]] = {m: [] for m in positions}
    for _ in range(repeats):
        for m in positions:
            samples[m].append(one_pass(m))
    return [statistics.median(samples[m]) for m in positions]


@torch.inference_mode()
def time_prefills(model: torch.nn.Module, lengths: Sequence[int], repeats: int = 3, seed: int = 0,
                  outputs: int | None = None) -> list[float]:
    """Median seconds to read a prompt of each length into an empty cache, as a draft does
    once per request before its first round (`outputs`: see `time_passes`)."""
    if not lengths or min(lengths) < 1:
        raise VerispecError("prompt lengths to time must be whole numbers >= 1")
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    cache = model.new_cache(max(lengths))
    prompts = {n: torch.randint(0, model.config.vocab_size, (1, n), generator=generator).to(device) for n in lengths}
    limited = {} if outputs is None else {"outputs": outputs}

    def one_prefill(n: int) -> float:
        cache.rollback(0)
        _sync(device)
        started = time.perf_counter()
        model(prompts[n], cache, last_only=True, **limited)
        _sync(device)
        return time.perf_counter() - started

    for n in lengths:  # warm-up
        one_prefill(n)
    samples: dict[int, list[float]] = {n: [] for n in lengths}
    for _ in range(max(1, repeats)):
        for n in lengths:
            samples[n].append(one_prefill(n))
    return [statistics.median(samples[n]) for n in lengths]


def time_model(loaded, positions: Sequence[int], context: int = 64, repeats: int = 5,
               last_only: bool = False, prefill_lengths: Sequence[int] = (), vocab: int | None = None) -> ModelTiming:
    """Time a LoadedModel's passes (see `time_passes`) and, if asked, its prefills; with `vocab`,
    computing only the first ids' logits."""
    seconds = time_passes(loaded.model, positions, context, repeats, last_only, outputs=vocab)
    prefills = time_prefills(loaded.model, prefill_lengths, repeats, outputs=vocab) if prefill_lengths else []
    return ModelTiming(loaded.name, loaded.weights, context, list(positions), seconds, bytes_per_pass(loaded, vocab),
                       list(prefill_lengths), prefills, vocab)


def bytes_per_pass(loaded, vocab: int | None = None) -> int:
    """Weight bytes one pass reads: all of them, less the output rows past the first `vocab`."""
    total = loaded.weight_bytes()
    if vocab is None or vocab >= loaded.config.vocab_size:
        return total
    layer = loaded.model.output_weight()
    head = sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])
    return total - round(head * (1 - vocab / loaded.config.vocab_size))


# ---------------------------------------------------------------- the profile

@dataclass
class CalibrationProfile:
    machine: dict[str, Any]
    copy_bytes_per_s: float
    read_bytes_per_s: float
    matmul_flops_per_s: float
    target: ModelTiming | None = None
    draft: ModelTiming | None = None
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))

    @property
    def c(self) -> float | None:
        if self.target is None or self.draft is None:
            return None
        return self.draft.t(1) / self.target.t(1)

    def hardware(self) -> Hardware:
        """The machine as the roofline sees it: the read bandwidth and the matmul FLOP/s."""
        return Hardware(f"calibrated ({self.machine.get('processor', '?')})", self.read_bytes_per_s,
                        self.matmul_flops_per_s, note=f"measured {self.created}")

    def costs(self) -> MeasuredCosts:
        if self.target is None or self.draft is None:
            raise VerispecError("this profile has no target and draft timings; "
                                "run `verispec calibrate --model T --draft D --out profile.json`")
        two = self.draft.t(2) if 2 in self.draft.positions else None
        return MeasuredCosts(dict(zip(self.target.positions, self.target.seconds)), self.draft.t(1), two,
                             dict(zip(self.draft.prefill_lengths, self.draft.prefill_seconds)) or None)

    def to_dict(self) -> dict[str, Any]:
        out = {"format": PROFILE_FORMAT, **asdict(self)}
        out["target"] = asdict(self.target) if self.target else None
        out["draft"] = asdict(self.draft) if self.draft else None
        return out

    def save(self, path: str | Path) -> None:
        check_profile_path(path)
        try:
            Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        except OSError as exc:
            raise VerispecError(f"cannot save the profile to {path}: {exc.strerror or exc}") from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CalibrationProfile":
        if data.get("format") != PROFILE_FORMAT:
            raise VerispecError(f"not a verispec calibration profile (format {data.get('format')!r}, "
                                f"expected {PROFILE_FORMAT!r})")
        try:
            timings = {key: ModelTiming(**data[key]) if data.get(key) else None for key in ("target", "draft")}
            return cls(data["machine"], float(data["copy_bytes_per_s"]), float(data["read_bytes_per_s"]),
                       float(data["matmul_flops_per_s"]), timings["target"], timings["draft"],
                       data.get("created", ""))
        except (KeyError, TypeError, ValueError) as exc:
            raise VerispecError(f"calibration profile is incomplete or damaged ({exc})") from None


def check_profile_path(path: str | Path) -> None:
    """Fail at once, before the slow measuring, when a profile could not be saved at `path`."""
    path = Path(path)
    if path.is_dir():
        raise VerispecError(f"{path} is a folder; give a file to save the profile to, "
                            f"e.g. {path / 'profile.json'}")
    folder = path.parent
    if not folder.exists():
        raise VerispecError(f"cannot save the profile to {path}: there is no folder {folder}")
    if not folder.is_dir():
        raise VerispecError(f"cannot save the profile to {path}: {folder} is a file, not a folder")
    if not os.access(path if path.exists() else folder, os.W_OK):
        raise VerispecError(f"cannot save the profile to {path}: permission denied")


def load_profile(path: str | Path) -> CalibrationProfile:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise VerispecError(f"no calibration profile at {path}; make one with "
                            f"`verispec calibrate --out {path}`") from None
    except IsADirectoryError:
        raise VerispecError(f"{path} is a folder; give the profile file that "
                            f"`verispec calibrate --out` wrote") from None
    except OSError as exc:
        raise VerispecError(f"cannot read the calibration profile {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise VerispecError(f"{path}: not a JSON calibration profile ({exc})") from None
    if not isinstance(data, dict):
        raise VerispecError(f"{path}: not a JSON calibration profile")
    return CalibrationProfile.from_dict(data)


DRAFT_PREFILL_LENGTHS = (32, 128, 512)


def calibrate(target=None, draft=None, max_m: int = 32, context: int = 64, repeats: int = 5,
              buffer_bytes: int = 512 * 2**20, device: str = "cpu",
              prefill_lengths: Sequence[int] = DRAFT_PREFILL_LENGTHS,
              log: Callable[[str], None] = lambda _: None, draft_vocab: int | str | None = "auto") -> CalibrationProfile:
    """Measure the machine and, given LoadedModels, the target's t(1..max_m) and the draft's step,
    with the draft vocabulary decoding would use (`draft_vocab`, as `generate`'s)."""
    if max_m < 1:
        raise VerispecError(f"--max-m must be >= 1, got {max_m}")
    for loaded, positions in ((target, max_m), (draft, 2)):  # before measuring, which takes a while
        if loaded is not None and context + positions > loaded.config.max_position_embeddings:
            raise VerispecError(
                f"--context {context} and passes over {positions} positions need {context + positions:,} "
                f"positions, but {loaded.name} holds {loaded.config.max_position_embeddings:,}; "
                f"lower --context" + (" or --max-m" if loaded is target else ""))
    log("measuring bandwidth")
    copy_bw, read_bw = measure_bandwidth(buffer_bytes, device=device)
    log("measuring matmul FLOP/s")
    flops = measure_matmul_flops(device=device)
    profile = CalibrationProfile(machine_facts(device), copy_bw, read_bw, flops)
    if target is not None:
        log(f"timing {target.name}: passes over 1..{max_m} positions")
        profile.target = time_model(target, range(1, max_m + 1), context, repeats)
    if draft is not None:
        log(f"timing {draft.name}: draft steps and prompt reading")
        lengths = [n for n in prefill_lengths if n < draft.config.max_position_embeddings]
        vocab = draft_vocab_limit(draft_vocab, draft.config.vocab_size)
        profile.draft = time_model(draft, [1, 2], context, repeats, last_only=True, prefill_lengths=lengths,
                                   vocab=vocab)
    return profile
