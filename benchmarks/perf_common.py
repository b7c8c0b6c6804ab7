"""Helpers the performance scripts share: read bandwidth, timing, target lines, result files."""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from pathlib import Path

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

HERE = Path(__file__).resolve().parent
CPUINFO = Path("/proc/cpuinfo")


def processor(cpuinfo: Path = CPUINFO) -> dict:
    """What /proc/cpuinfo says of this processor: vendor, family, model, its name and its flags."""
    fields = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return {"vendor": fields.get("vendor_id", "unknown"), "family": fields.get("cpu family", "?"),
            "model": fields.get("model", "?"), "name": fields.get("model name", "unknown"),
            "flags": set(fields.get("flags", "").split())}


def has_amx(cpuinfo: Path = CPUINFO) -> bool:
    """Whether the processor has AMX tiles (which Linux may still not grant a process)."""
    return "amx_tile" in processor(cpuinfo)["flags"]


def host_tag() -> str:
    """A short name for this kind of processor (amd-25-17: AMD family 25 model 17, a Zen 4 EPYC),
    under which its results are kept apart from other hosts'."""
    cpu = processor()
    vendor = {"AuthenticAMD": "amd", "GenuineIntel": "intel"}.get(cpu["vendor"], cpu["vendor"].lower())
    return f"{vendor}-{cpu['family']}-{cpu['model']}"


RESULTS = HERE / "results" / "perf" / host_tag()


def machine_load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} / {five:.2f} on {os.cpu_count()} cores"


def warn_if_busy() -> None:
    one = os.getloadavg()[0]
    if one > 0.5 * (os.cpu_count() or 1):
        print(f"  note: {machine_load()}: other jobs share the cores, timings will be noisy")


_BUFFERS: dict[int, torch.Tensor] = {}


# Distances (bytes) at which the reference sums also fetch in software: a short one suits some
# processors' memory systems better than the weight kernels' default (Intel's: NOTES.md).
SHORT_PREFETCH = (512, 1536)


def last_level_cache(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """Bytes of the largest cache level the system reports for CPU 0 (0 where it reports none)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    found = (0, 0)
    for index in caches.glob("index*"):
        try:
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
            found = max(found, (level, int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)))
        except (OSError, ValueError, IndexError):
            continue
    return found[1]


def read_bandwidth(gib: float = 1.0, repeats: int = 5, keep: bool = False) -> float:
    """The machine's read bandwidth in bytes/s: the best of torch.sum and the kernels'
    own streaming sum (plain, fetching ahead, and two streams per thread, as the weight
    kernels read, each also fetched a short way ahead) over a buffer far larger than the
    caches. `keep` holds on to the buffer for the next call."""
    from verispec.kernels import cpu_kernels

    size = int(gib * (1 << 30)) // 4
    buffer = _BUFFERS.pop(size, None)
    if buffer is None:
        buffer = torch.ones(size, dtype=torch.float32)
    kernels = cpu_kernels()
    readers = [buffer.sum]
    if kernels:
        readers += [lambda: kernels.stream_sum(buffer), lambda: kernels.stream_sum(buffer, True),
                    lambda: kernels.stream_sum(buffer, False, 2)]
        readers += [lambda s=streams, a=ahead: kernels.stream_sum(buffer, True, s, a)
                    for streams in (1, 2) for ahead in SHORT_PREFETCH]
    best = 0.0
    for read in readers:
        read()
        for _ in range(repeats):
            started = time.perf_counter()
            read()
            best = max(best, buffer.numel() * 4 / (time.perf_counter() - started))
    if keep:
        _BUFFERS[size] = buffer
    else:
        del buffer
        gc.collect()
    return best


def panel_kernels():
    """The compiled kernels with their panel products, or None (and a line saying why) where
    the kernels could not be built."""
    from verispec.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is None or not hasattr(kernels, "linear_int8_panels"):
        print("the CPU kernels are not built on this machine (they need AVX2 or AVX-512, and a compiler)")
        return None
    return kernels


def median(values: list[float]) -> float:
    return statistics.median(values)


def verdict(name: str, figure: str, met: bool | None) -> str:
    mark = "n/a" if met is None else ("MET" if met else "NOT MET")
    return f"[{mark:>7}] {name}: {figure}"


def rotated(names: list, index: int) -> list:
    """`names` in round `index`'s turn: the order rotates round by round, so that no way
    always runs first or after the same one."""
    return names[index % len(names):] + names[:index % len(names)]


def in_turns(runs: dict, index: int) -> dict:
    """Each of `runs` (name -> a function of no arguments) called once, in prompt or round
    `index`'s turn (`rotated`): a way run after another tends to time differently from the one
    before it, so no way keeps the same place. The results come back in `runs`' own order."""
    done = {name: runs[name]() for name in rotated(list(runs), index)}
    return {name: done[name] for name in runs}


def bracketed_runs(target, text: str, drafts: dict, index: int, gamma: int, **options) -> tuple:
    """One prompt's runs for a plain-against-speculative comparison: plain decoding, speculative
    decoding with each of `drafts` (name -> a function that makes its proposer) in the prompt's
    turn (`in_turns`), plain decoding again. Returns (plain before, {name: speculative run},
    plain after)."""
    from verispec.generate import generate

    before = generate(target, text, **options)
    specs = in_turns({name: lambda make=make: generate(target, text, draft=make(), gamma=gamma, **options)
                      for name, make in drafts.items()}, index)
    after = generate(target, text, **options)
    return before, specs, after


def take_turns(timers: dict, rounds: int, nbytes: int) -> list[dict]:
    """`rounds` rounds in which every timer (name -> seconds of one timing) runs once, the
    order rotating round by round, each round between two read-bandwidth measurements:
    per round, each way's seconds and its bytes/s over the higher of the two measurements."""
    names, records = list(timers), []
    before = read_bandwidth(keep=True)
    for index in range(rounds):
        seconds = {name: timers[name]() for name in rotated(names, index)}
        after = read_bandwidth(keep=True)
        level = max(before, after)
        records.append({"bandwidth_before": before, "bandwidth_after": after, "seconds": seconds,
                        "utilisation": {name: nbytes / s / level for name, s in seconds.items()}})
        before = after
    return records


def save(name: str, record: dict, history: dict | None = None) -> Path:
    """Write `record` to results/perf/<host>/<name>.json (the latest run on this kind of
    processor). With `history`, also append that summary as one line to <name>_history.jsonl,
    so that runs taken while the machine behaved differently are all kept."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    stamp = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "load": machine_load(), "threads": torch.get_num_threads(),
             "cpu": processor()["name"]}
    path.write_text(json.dumps({**stamp, **record}, indent=2))
    if history is not None:
        with (RESULTS / f"{name}_history.jsonl").open("a") as log:
            log.write(json.dumps({**stamp, **history}) + "\n")
    return path


def free(*objects) -> None:
    for obj in objects:
        del obj
    gc.collect()


def draft_vocabulary(limit: int | None) -> str:
    """What a draft limited to its first `limit` ids (None: not limited) proposes, in words."""
    return "its whole vocabulary" if limit is None else f"its first {limit:,} ids and the context's"


def add_pair_arguments(parser, weights_help: str | None = None) -> None:
    """The options `load_pair` reads: the demo pair, the target in int8 and the draft in int4."""
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--weights", default="int8", help=weights_help)
    parser.add_argument("--draft-weights", default="int4")


def category_prompts(category: str, count: int, skip: int = 0) -> list:
    """A Spec-Bench category's prompts `skip` to `skip + count`: the first ones left out, so that a
    change chosen on them can be checked on the next."""
    from verispec.lab.prompts import load_prompts

    return load_prompts(f"spec-bench:{category}", limit=skip + count)[skip:]


def add_category_arguments(parser, categories: list[str]) -> None:
    """--categories (Spec-Bench's), --gamma, --prompts (per category) and --tokens."""
    parser.add_argument("--categories", nargs="+", default=categories)
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=3, help="prompts per category")
    parser.add_argument("--tokens", type=int, default=128)


def ignoring_rules(proposer_class):
    """A draft-model proposer that ignores the rules generate() hands it (penalties, a
    structure's mask): what drafting without them would propose."""
    class IgnoringRules(proposer_class):
        rules = property(lambda self: None, lambda self, value: None)
    return IgnoringRules


def pair_totals(**more) -> dict:
    """Empty totals of a pair's runs (add_pair_runs), with `more` fields."""
    return {"plain_s": 0.0, "plain_steps": 0, "spec_s": 0.0, "spec_steps": 0, "draft_s": 0.0, "drafted": 0,
            "accepted": 0, **more}


def add_pair_runs(entry: dict, plain_s: float, plain_tokens: int, spec) -> None:
    """Add one prompt's plain decoding (seconds, tokens) and speculative result to a pair's totals."""
    entry["plain_s"] += plain_s
    entry["plain_steps"] += plain_tokens - 1
    entry["spec_s"] += spec.timings.decode_s
    entry["spec_steps"] += len(spec.token_ids) - 1
    entry["draft_s"] += spec.spec.draft_s
    entry["drafted"] += spec.spec.drafted
    entry["accepted"] += spec.spec.accepted


def pair_figures(entry: dict) -> None:
    """Add to a pair's totals (plain_s, plain_steps, spec_s, spec_steps, draft_s, drafted,
    accepted) the speed-up per token (sampled answers differ in length), the acceptance, and c:
    the draft's seconds per drafted token over a plain step's."""
    step = entry["plain_s"] / max(1, entry["plain_steps"])
    entry["speedup"] = step / (entry["spec_s"] / max(1, entry["spec_steps"]))
    entry["acceptance"] = entry["accepted"] / max(1, entry["drafted"])
    entry["c"] = entry["draft_s"] / max(1, entry["drafted"]) / step


def sampled_evidence_of(target, prompt: str, token_ids: list[int], temperature: float, run_seed: int, draft=None,
                        top_k: int = 0, top_p: float = 1.0):
    """What the target's distribution (at `temperature`, `top_k`, `top_p`) says of a sampled
    run's tokens for a chat prompt (lab.audit.sampled_evidence), the draft, if given, as the
    alternative; V is drawn from a stream apart from the run's own (`run_seed`)."""
    from verispec.generate import encode_prompt
    from verispec.lab.audit import sampled_evidence
    from verispec.sampling import SamplingParams

    prompt_ids = encode_prompt(target.tokenizer, prompt, True)
    return sampled_evidence(target, prompt_ids, token_ids, SamplingParams(temperature, top_k, top_p), run_seed + 2**32,
                            draft)


def load_pair(args, title: str, details: str):
    """The target and draft that args name (.target, .weights, .draft, .draft_weights),
    after a header line; and the fields every record of the pair starts with."""
    from verispec.loading import load_model

    target = load_model(args.target, weights=args.weights)
    draft = load_model(args.draft, weights=args.draft_weights)
    print(f"{title}: {target.name} ({args.weights}) with {draft.name} ({args.draft_weights}), {details}, "
          f"{torch.get_num_threads()} threads, {machine_load()}")
    warn_if_busy()
    record = {"target": args.target, "draft": args.draft, "weights": args.weights, "draft_weights": args.draft_weights}
    return target, draft, record
