"""What holding the output to a structure costs per row: the check of one id that greedy rows
make, and the whole mask that sampled rows need.

    python benchmarks/structure_mask.py                     # the 1.5B's tokenizer, 3 JSON answers
    python benchmarks/structure_mask.py --prompts 5 --weights int4

The target answers 3 extraction prompts as any JSON object (greedy, as `structured.py` does).
Then, position by position along each answer, a matcher at the output so far is timed five
ways, in turn: checking the answer's token alone (`validate_tokens`, what a greedy row whose
argmax the structure allows pays), the matcher's bitmask over the whole vocabulary, that
bitmask unpacked into one boolean per id (`StructureState._mask`), a whole row of logits
masked the way a sampled row is (`StructureState.apply` without `greedy`: a copy of the
matcher, the mask, and -inf written into the refused columns), and the same row masked by
torch's `masked_fill_`, as the engine did before (the mask, a copy of the row, the fill).
Medians over the positions are set against the median plain step of the same answers,
decoded free: a sampled verification pass over γ + 1 positions masks every row, so γ + 1
times the masked row is what the structure adds to it, whatever the pass keeps. Rows after
the first rejected draft are never read; masking them as the verifier reaches them would save
their share.
"""

from __future__ import annotations

import argparse
import sys
import time

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import category_prompts, machine_load, median, save, warn_if_busy

WAYS = ("check one id", "bitmask", "mask", "masked row", "masked_fill_ row")


def way_times(state, token: int, row: torch.Tensor, repeats: int = 5) -> dict[str, float]:
    """Seconds each way takes at the matcher's position (median of `repeats`), the ways in
    turn; `token` is the answer's next token, `row` logits of the vocabulary's width."""
    ways = {
        "check one id": lambda: state.matcher.validate_tokens([token]),
        "bitmask": lambda: state.matcher.compute_bitmask(),
        "mask": lambda: state._mask(state.matcher),
        "masked row": lambda: state.apply(row),
        "masked_fill_ row": lambda: row.clone()[0].masked_fill_(~state._mask(state.matcher), float("-inf")),
    }
    times = {name: [] for name in ways}
    for _ in range(repeats):
        for name, way in ways.items():
            started = time.perf_counter()
            way()
            times[name].append(time.perf_counter() - started)
    return {name: median(values) for name, values in times.items()}


def answer_times(state, answer: list[int], vocab: int) -> dict[str, list[float]]:
    """Each way's time at every position of `answer`, the matcher advanced token by token."""
    row = torch.randn(1, vocab)
    out = {name: [] for name in WAYS}
    for token in answer:
        for name, seconds in way_times(state, token, row).items():
            out[name].append(seconds)
        state.add([token])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--weights", default="int8")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--gamma", type=int, default=5, help="a sampled pass masks γ + 1 rows")
    args = parser.parse_args()

    from verispec.generate import encode_prompt, generate
    from verispec.loading import load_model
    from verispec.structured import Structure, StructureState

    target = load_model(args.target, weights=args.weights)
    vocab = target.config.vocab_size
    print(f"a structure's mask per row: {target.name} ({target.weights}), {vocab:,} ids, any JSON object, "
          f"{torch.get_num_threads()} threads, {machine_load()}")
    warn_if_busy()
    times = {name: [] for name in WAYS}
    steps = []
    for prompt in category_prompts("extraction", args.prompts):
        prompt_ids = encode_prompt(target.tokenizer, prompt.text, True)
        answer = generate(target, prompt_ids, max_tokens=args.tokens, json_schema=True).token_ids
        answer = [t for t in answer if t not in target.tokenizer.eos_ids]
        free = generate(target, prompt_ids, max_tokens=args.tokens)
        steps.append(1 / free.timings.tokens_per_s)
        state = StructureState(Structure.json(True), target.tokenizer, vocab)
        for name, values in answer_times(state, answer, vocab).items():
            times[name].extend(values)
        print(f"  #{prompt.id}: {len(answer)} answer positions timed")
    step = median(steps)
    medians = {name: median(values) for name, values in times.items()}
    for name in WAYS:
        print(f"  {name:>12}: {medians[name] * 1e6:9.1f} µs a row ({medians[name] / step:.2%} of a plain step)")
    rows = args.gamma + 1
    print(f"  plain step {step * 1e3:.1f} ms; a sampled pass over {rows} rows masks them all: "
          f"{rows * medians['masked row'] * 1e3:.2f} ms ({rows * medians['masked row'] / step:.1%} of a step), "
          f"a greedy pass checks {rows} ids: {rows * medians['check one id'] * 1e6:.0f} µs")
    save("structure_mask", {"target": target.name, "weights": target.weights, "vocab": vocab,
                            "positions": len(times["mask"]), "step_s": step,
                            "median_s": medians, "gamma": args.gamma})
    return 0


if __name__ == "__main__":
    sys.exit(main())
