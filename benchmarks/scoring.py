"""What scoring a prompt costs: a prefill that reports every prompt token's log-probability
(`prompt_logprobs`, the server's `echo` with `logprobs`), against a plain prefill.

    python benchmarks/scoring.py [--weights int8] [--tokens 512] [--chunks 64 128 256] [--quick]
    python benchmarks/scoring.py --chunks 16 32 64 --rounds 3
    python benchmarks/scoring.py --chunks 64 256 --split --rounds 3

The target reads Spec-Bench questions joined and cut to --tokens tokens. The ways take turns,
round by round: a plain prefill (one pass, the last position's logits only), and scored
prefills that read the prompt PROMPT_CHUNK positions a pass and keep every position's logits,
with 0 and with 5 alternatives per token, at each chunk size. With --split, also the passes
alone at each chunk size: the chunks with only their last row's logits (what chunking costs
the model's body) and with every row's (the output layer's share), no log-softmax. Printed:
each way's median time as a ratio of the plain prefill's in the same run.
"""

from __future__ import annotations

import argparse
import json
import time

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import machine_load, median, rotated, save, warn_if_busy


def prompt_of(tokenizer, tokens: int) -> list[int]:
    """Spec-Bench's questions, one after another, until `tokens` token ids."""
    from verispec.lab.prompts import spec_bench_path

    ids: list[int] = []
    for line in spec_bench_path().read_text().splitlines():
        ids += tokenizer.encode(json.loads(line)["turns"][0] + "\n\n")
        if len(ids) >= tokens:
            return ids[:tokens]
    raise SystemExit(f"Spec-Bench holds fewer than {tokens} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--weights", default="int8")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--split", action="store_true", help="also time the chunked passes alone")
    parser.add_argument("--quick", action="store_true", help="a 0.5B model, 128 tokens, 2 rounds: a rehearsal")
    args = parser.parse_args()
    if args.quick:
        args.model, args.tokens, args.rounds, args.chunks = "qwen2.5-coder-0.5b", 128, 2, [64]

    from verispec import generate as generate_module
    from verispec.generate import generate
    from verispec.loading import load_model

    target = load_model(args.model, weights=args.weights)
    ids = prompt_of(target.tokenizer, args.tokens)
    print(f"scoring a {len(ids)}-token prompt: {target.name} ({args.weights}), {torch.get_num_threads()} threads, "
          f"{machine_load()}")
    warn_if_busy()

    def plain() -> float:
        return generate(target, ids, max_tokens=1).timings.prefill_s

    def scored(chunk: int, alternatives: int):
        def run() -> float:
            generate_module.PROMPT_CHUNK = chunk
            result = generate(target, ids, max_tokens=0, prompt_logprobs=alternatives)
            assert len(result.prompt_logprobs) == len(ids)
            return result.timings.prefill_s
        return run

    @torch.inference_mode()
    def passes(chunk: int, last_only: bool):
        def run() -> float:
            model = target.model
            cache = model.new_cache(len(ids) + 1)
            started = time.perf_counter()
            for start in range(0, len(ids), chunk):
                model(torch.tensor([ids[start:start + chunk]]), cache, last_only=last_only)
            return time.perf_counter() - started
        return run

    ways = {"plain": plain}
    for chunk in args.chunks:
        for alternatives in (0, 5):
            ways[f"chunk {chunk}, top {alternatives}"] = scored(chunk, alternatives)
        if args.split:
            ways[f"chunk {chunk}, last rows"] = passes(chunk, last_only=True)
            ways[f"chunk {chunk}, all rows"] = passes(chunk, last_only=False)
    plain()  # warm: the first pass pays for allocations and page faults
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for index in range(args.rounds):
        for name in rotated(list(ways), index):
            seconds[name].append(ways[name]())
    base = median(seconds["plain"])
    rows = {}
    for name, values in seconds.items():
        rows[name] = {"median_s": median(values), "ratio": median(values) / base, "seconds": values}
        print(f"  {name:>20}: {median(values) * 1e3:8.1f} ms  {median(values) / base:5.2f}x the plain prefill")
    save("scoring", {"model": args.model, "weights": args.weights, "tokens": len(ids), "ways": rows})


if __name__ == "__main__":
    main()
