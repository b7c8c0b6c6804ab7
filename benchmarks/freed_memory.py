"""Whether glibc keeping freed memory for reuse speeds up decoding: child processes in turn.

    python benchmarks/freed_memory.py                  # 3 rounds, int8 target, int4 draft
    python benchmarks/freed_memory.py --rounds 4 --tokens 96

verispec asks for transparent huge pages on torch's buffers of 2 MB or more (for the weights'
sake). Whenever glibc has handed such a block back to the kernel, the next one is new memory,
zeroed by the kernel on first touch: a fresh copy of a 6-row pass's logits took 3.2 ms where a
copy into memory written before took 0.1 (`penalty_cost.py`). Raising glibc's trim and mmap
thresholds (mallopt) keeps freed blocks for the next allocation. Each round runs one child
process per setting, the order moving from round to round; each child loads the pair, warms
up, and decodes --prompts Spec-Bench coding prompts plainly and speculatively (greedy, γ = 5),
reporting tok/s and the page faults the decoding took. Outputs are compared: the setting
moves no arithmetic.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
from pathlib import Path

SETTINGS = ("glibc's defaults", "freed memory kept")


def keep_freed_memory() -> None:
    """glibc: keep up to 128 MB freed at the heap's top, and serve blocks under 32 MB from the heap."""
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not (libc.mallopt(m_trim_threshold, 128 << 20) and libc.mallopt(m_mmap_threshold, 32 << 20)):
        raise SystemExit("mallopt refused the thresholds")


def child(setting: str, args) -> dict:
    """One process's figures: load, warm up, decode each prompt plainly and speculatively."""
    import resource

    import verispec  # noqa: F401  (before torch: it sets how torch's threads wait)

    from perf_common import category_prompts
    from verispec.generate import encode_prompt, generate
    from verispec.loading import load_model

    target = load_model(args.target, weights=args.weights)
    draft = load_model(args.draft, weights=args.draft_weights)
    prompts = [encode_prompt(target.tokenizer, p.text, True) for p in category_prompts("coding", args.prompts)]
    generate(target, prompts[0], max_tokens=8)
    generate(target, prompts[0], max_tokens=8, draft=draft, gamma=5)
    out = {"setting": setting, "plain_tok_s": [], "spec_tok_s": [], "faults": 0, "tokens": []}
    for ids in prompts:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        plain = generate(target, ids, max_tokens=args.tokens)
        spec = generate(target, ids, max_tokens=args.tokens, draft=draft, gamma=5)
        out["faults"] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        out["plain_tok_s"].append(plain.timings.tokens_per_s)
        out["spec_tok_s"].append(spec.timings.tokens_per_s)
        out["tokens"].append([plain.token_ids, spec.token_ids])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--weights", default="int8")
    parser.add_argument("--draft-weights", default="int4")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child == SETTINGS[1]:
            keep_freed_memory()
        print(json.dumps(child(args.child, args)))
        return 0

    from perf_common import machine_load, median, save

    print(f"freed memory kept or handed back: {args.target} ({args.weights}) with {args.draft} "
          f"({args.draft_weights}), {args.prompts} coding prompts, {args.tokens} tokens, γ = 5, {machine_load()}")
    runs = {setting: [] for setting in SETTINGS}
    for round_ in range(args.rounds):
        for setting in SETTINGS[round_ % 2:] + SETTINGS[:round_ % 2]:
            command = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--child", setting]
            done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).parent)
            if done.returncode != 0:
                print(done.stderr[-2000:])
                return 1
            run = json.loads(done.stdout.strip().splitlines()[-1])
            runs[setting].append(run)
            print(f"  round {round_ + 1}, {setting}: plain "
                  + " ".join(f"{x:.2f}" for x in run["plain_tok_s"]) + " tok/s, speculative "
                  + " ".join(f"{x:.2f}" for x in run["spec_tok_s"]) + f" tok/s, {run['faults']} page faults")
    same = all(run["tokens"] == runs[SETTINGS[0]][0]["tokens"] for setting in SETTINGS for run in runs[setting])
    summary = {}
    for setting in SETTINGS:
        summary[setting] = {kind: median([x for run in runs[setting] for x in run[f"{kind}_tok_s"]])
                            for kind in ("plain", "spec")}
        summary[setting]["faults"] = median([run["faults"] for run in runs[setting]])
    kept, default = summary[SETTINGS[1]], summary[SETTINGS[0]]
    print(f"  medians: plain {default['plain']:.2f} -> {kept['plain']:.2f} tok/s "
          f"({kept['plain'] / default['plain']:.3f}x), speculative {default['spec']:.2f} -> {kept['spec']:.2f} "
          f"({kept['spec'] / default['spec']:.3f}x); page faults {default['faults']:.0f} -> {kept['faults']:.0f}; "
          f"outputs {'identical' if same else 'DIFFER'}")
    save("freed_memory", {"summary": summary, "identical": same,
                          "runs": {s: [{k: v for k, v in r.items() if k != "tokens"} for r in rs]
                                   for s, rs in runs.items()}})
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
