"""A changed kernel source against the current one, on a real model's decoding steps.

    python benchmarks/stack_ab.py --variant /path/to/changed_cpu_kernels.cpp
    python benchmarks/stack_ab.py --patch benchmarks/variants/reuse_buffers.patch --rounds 300
    python benchmarks/stack_ab.py --weights bfloat16 --variant a.cpp --variant b.cpp
    python benchmarks/stack_ab.py --weights int8 --context 2048 --positions 5 --variant old.cpp

Each variant is a whole copy of src/verispec/kernels/cpu_kernels.cpp (--variant), or the
current one with a patch applied (--patch; benchmarks/variants/ keeps the trials NOTES.md
describes, each against the source of its day), compiled with the same flags as its own
module. The model is loaded once; every way gets its own lean forward (`fast.FastPath`:
decoder stack and output layer) bound to the same weight tensors, so the ways differ only
in their code. A step is that forward over one position after a prompt (no sampling);
--positions makes it a verification pass over several, --context puts a long context
before it.

Rounds take turns (the order rotates), each way timed over a few steps, and each round sits
between two read-bandwidth measurements. Utilisation is bytes of weights per step over the
higher of the two. The host's bandwidth moves between a slow and a fast level, and small
changes show only at the fast one, so the medians are given apart for each (as
`stream_layout.py` splits them), with each variant's step time as a ratio of the current
one's in the same rounds.

Every variant's output is first checked to equal the current kernels' bit for bit
(`--no-check` skips that, for trials that deliberately compute something else).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import machine_load, median, panel_kernels, save, take_turns, warn_if_busy
from stream_layout import spell_groups, spells, time_ratio

PROMPT = "Write a Python function that merges two sorted lists into one sorted list."


def build_variant(source: Path):
    from verispec.kernels import compile_source

    module = compile_source(source, prefix="verispec_variant")
    return module, module.__name__.rsplit("_", 1)[-1]


def patched(patch: Path, into: Path) -> Path:
    """The current kernel source with `patch` (a unified diff of it) applied, as a file in `into`."""
    from verispec.kernels import _SOURCE

    target = into / patch.stem / "src" / "verispec" / "kernels" / "cpu_kernels.cpp"
    target.parent.mkdir(parents=True)
    target.write_bytes(_SOURCE.read_bytes())
    try:
        result = subprocess.run(["git", "apply", str(patch.resolve())], cwd=into / patch.stem,
                                capture_output=True, text=True)
    except FileNotFoundError:
        raise SystemExit("applying a patch needs git; give the changed source with --variant instead") from None
    if result.returncode:
        raise SystemExit(f"{patch} does not apply to the current kernels: {result.stderr.strip()}")
    return target.rename(target.with_name(f"{patch.stem}.cpp"))


class ChangedKernels:
    """The changed kernel sources (whole files, then the current one with each patch applied),
    built, by name: `modules` (name -> module) and `recorded` (name -> file given and digest)."""

    def __init__(self, variants: list[Path], patches: list[Path]):
        self._scratch = tempfile.TemporaryDirectory()
        sources = variants + [patched(patch, Path(self._scratch.name)) for patch in patches]
        self.modules, self.recorded = {}, {}
        for source, origin in zip(sources, variants + patches):
            self.modules[source.name], digest = build_variant(source)
            self.recorded[source.name] = {"file": str(origin), "sha1": digest}


class Way:
    """One kernel module's lean forward (`fast.FastPath`) over the model's tensors."""

    def __init__(self, kernels, model, cache, prompt_length: int, tokens: list[int]):
        from verispec.fast import FastPath

        self.forward, self.cache, self.start = FastPath(model, kernels), cache, prompt_length
        self.tokens = torch.tensor([tokens])

    def step(self) -> torch.Tensor:
        """The logits of the step's positions (one, or a verification pass's); the cache is
        written at the same place every time."""
        self.cache.rollback(self.start)
        return self.forward(self.tokens, self.cache, last_only=self.tokens.shape[1] == 1)

    def timed(self, steps: int) -> float:
        self.step()
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - started)
        return median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", type=Path, action="append", default=[], help="a changed cpu_kernels.cpp")
    parser.add_argument("--patch", type=Path, action="append", default=[], help="a patch to cpu_kernels.cpp")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--weights", default="int4", choices=["int4", "int8", "bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--steps", type=int, default=5, help="steps per way and round (their median counts)")
    parser.add_argument("--no-check", action="store_true", help="do not require bit-identical logits")
    parser.add_argument("--context", type=int, default=0,
                        help="step after this many cached positions (the prompt repeated) instead of after the "
                             "prompt alone, where attention weighs more")
    parser.add_argument("--positions", type=int, default=1,
                        help="positions per step: more than 1 times a verification pass (γ + 1) instead")
    parser.add_argument("--save-as", default="stack_ab", help="results/perf/<host>/<name>.json")
    args = parser.parse_args()
    if not args.variant and not args.patch:
        parser.error("give at least one --variant or --patch")

    current = panel_kernels()
    if current is None:
        return 1
    from verispec.loading import load_model

    changed = ChangedKernels(args.variant, args.patch)
    modules = {"current": current, **changed.modules}
    loaded = load_model(args.model, "bfloat16" if args.weights == "bfloat16" else "float32", weights=args.weights)
    model = loaded.model
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": PROMPT}])
    if args.context:
        ids = (ids * (args.context // len(ids) + 1))[:args.context]
    cache = model.new_cache(len(ids) + args.positions + 1)
    model(torch.tensor([ids]), cache)
    ways = {name: Way(kernels, model, cache, cache.length, ids[-args.positions:]) for name, kernels in modules.items()}
    reference = ways["current"].step()
    for name, way in ways.items():
        if not args.no_check and not torch.equal(way.step(), reference):
            print(f"{name}: its logits differ from the current kernels' (use --no-check if that is intended)")
            return 1
    nbytes = loaded.weight_bytes()
    names = list(ways)
    print(f"{model.config.num_hidden_layers}-layer {args.model} in {args.weights} ({nbytes / 1e9:.2f} GB read per step), "
          f"steps of {args.positions} position(s) after {len(ids)}, "
          f"{torch.get_num_threads()} threads, {machine_load()}; ways: {', '.join(names)}")
    warn_if_busy()

    records = take_turns({name: lambda way=way: way.timed(args.steps) for name, way in ways.items()},
                         args.rounds, nbytes)
    summary = spells(records)
    for spell, group in spell_groups(records).items():
        result = summary[spell]
        result["time_vs_current"] = {name: time_ratio(group, name, "current") for name in names[1:]}
        low, high = result["bandwidth"]
        print(f"{spell} spell: {result['rounds']} steady rounds at {low / 1e9:.0f}-{high / 1e9:.0f} GB/s")
        for name in names:
            ratio = "" if name == "current" else f", step time {result['time_vs_current'][name]:.4f}x the current"
            print(f"  {name:>24}: {result['utilisation'][name]:.1%} of the read bandwidth{ratio}")
    save(args.save_as, {"model": args.model, "weights": args.weights, "weight_bytes": nbytes, "context": len(ids),
                        "positions": args.positions,
                        "variants": changed.recorded,
                        "spells": summary, "rounds": records})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
