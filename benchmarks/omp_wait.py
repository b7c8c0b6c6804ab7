"""Why verispec makes torch's OpenMP threads wait passively: the same decoding, both ways.

    python benchmarks/omp_wait.py            # int8 1.5B target, int4 0.5B draft, 2 coding prompts, γ = 4
    python benchmarks/omp_wait.py --quick    # one prompt, fewer tokens

OpenMP reads its wait policy once, when torch loads, so each setting runs in a process of
its own: OpenMP's default (threads spin for a while after each of torch's operations) and
passive (they sleep at once), alternating, twice each. Each process decodes the prompts
plainly and speculatively and times every draft step by its place in the round: a thread
still spinning after the argmax that ends a pass holds a core the next step needs, so the
first step of a round is where the default policy shows. Figures are medians and ratios;
each speculative output must equal the plain one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

POLICIES = {"default": "", "passive": "PASSIVE"}  # "" leaves OpenMP's default and verispec does not override it


def worker(prompts: int, tokens: int, gamma: int) -> dict:
    import verispec  # noqa: F401
    import torch  # noqa: F401

    from verispec.generate import generate
    from verispec.lab.prompts import load_prompts
    from verispec.loading import load_model

    target = load_model("qwen2.5-coder-1.5b", weights="int8")
    draft = load_model("qwen2.5-coder-0.5b", weights="int4")
    steps: list[tuple[int, float]] = []  # (place in the round, seconds) of one-position draft steps
    forward, place = draft.model.forward, [0]

    def timed(ids, *args, **kwargs):
        started = time.perf_counter()
        out = forward(ids, *args, **kwargs)
        if ids.shape[1] == 1:
            steps.append((place[0], time.perf_counter() - started))
        place[0] += 1
        return out

    from verispec.spec.draft_model import DraftModelProposer
    propose = DraftModelProposer.propose

    def new_round(self, *args, **kwargs):
        place[0] = 0
        return propose(self, *args, **kwargs)

    draft.model.forward, DraftModelProposer.propose = timed, new_round
    texts = [p.text for p in load_prompts("spec-bench:coding", limit=prompts)]
    generate(target, texts[0], draft=draft, gamma=gamma, max_tokens=8, chat=True)  # warm-up
    steps.clear()
    plain_s = spec_s = 0.0
    identical = True
    for text in texts:
        plain = generate(target, text, max_tokens=tokens, chat=True)
        spec = generate(target, text, draft=draft, gamma=gamma, max_tokens=tokens, chat=True)
        plain_s, spec_s = plain_s + plain.timings.decode_s, spec_s + spec.timings.decode_s
        identical &= plain.token_ids == spec.token_ids
    by_place: dict[int, list[float]] = {}
    for where, seconds in steps:
        by_place.setdefault(where, []).append(seconds)
    return {"plain_s": plain_s, "spec_s": spec_s, "identical": identical,
            "draft_step_ms": {k: 1e3 * statistics.median(v) for k, v in sorted(by_place.items())}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", nargs=3, type=int, metavar=("PROMPTS", "TOKENS", "GAMMA"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker)))
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from perf_common import machine_load, save, warn_if_busy

    prompts, tokens, gamma = (1, 48, 4) if args.quick else (2, 128, 4)
    print(f"OpenMP wait policy: {prompts} coding prompt(s), {tokens} tokens, γ = {gamma}, {machine_load()}")
    warn_if_busy()
    runs: dict[str, list[dict]] = {name: [] for name in POLICIES}
    for _ in range(1 if args.quick else 2):
        for name, value in POLICIES.items():
            env = {**os.environ, "OMP_WAIT_POLICY": value}
            done = subprocess.run([sys.executable, __file__, "--worker", str(prompts), str(tokens), str(gamma)],
                                  env=env, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    summary = {}
    for name, results in runs.items():
        places = sorted({int(k) for r in results for k in r["draft_step_ms"]})
        summary[name] = {
            "plain_s": sum(r["plain_s"] for r in results), "spec_s": sum(r["spec_s"] for r in results),
            "identical": all(r["identical"] for r in results),
            "draft_step_ms": {p: statistics.median(r["draft_step_ms"][str(p)] for r in results
                                                   if str(p) in r["draft_step_ms"]) for p in places}}
        s = summary[name]
        steps = ", ".join(f"step {p + 1}: {ms:.1f}" for p, ms in s["draft_step_ms"].items())
        print(f"  {name:>8}: plain {s['plain_s']:.2f} s, speculative {s['spec_s']:.2f} s "
              f"({'identical' if s['identical'] else 'DIFFERS'}); draft steps by place in the round, ms: {steps}")
    default, passive = summary["default"], summary["passive"]
    print(f"  passive / default time: plain {passive['plain_s'] / default['plain_s']:.3f}, "
          f"speculative {passive['spec_s'] / default['spec_s']:.3f}")
    save("omp_wait" + ("_quick" if args.quick else ""), {"prompts": prompts, "tokens": tokens, "gamma": gamma,
                                                          "runs": runs, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
