"""Target 6: verispec against llama.cpp on the same GGUF files, prompts, threads and token budget.

    make bench                                 # llama-cpp-python, built from source
    python benchmarks/vs_llama_cpp.py          # 2 code + 2 prose prompts, 128 tokens, γ = 4 and 8
    python benchmarks/vs_llama_cpp.py --quick  # 1 + 1 prompts, 32 tokens, γ = 4

Both engines get the same prompt token ids (the chat template rendered once, by verispec)
and decode greedily. llama.cpp's plain decoding is one `eval` per token; its speculative
decoding is the same draft-then-verify loop as verispec's, written on llama-cpp-python's
`eval` (the 0.5B drafts γ tokens, the 1.5B scores them in one batch, both roll back by
resetting their token count, which drops the rejected cache cells on the next eval). llama.cpp
runs in a process of its own (llama_cpp_worker.py), with OpenMP's default wait policy.
verispec runs its int4 format built from the GGUF's own 4-bit blocks. Rates are decoding
tokens/s after the first token, so prefill is excluded on both sides; each output is
compared with the same engine's plain output.

On a processor with AMX, llama.cpp 0.3.36 built for it (its default, -march=native) crashes in
its AMX matrix products on the first evaluation (llama.cpp issue 20824). `make bench` builds it
without them on such a processor (the Makefile's LLAMA_WITHOUT_AMX); where it was built with
them, `pip uninstall -y llama-cpp-python` first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import verispec  # noqa: F401  (before torch: it sets how torch's threads wait)
import torch

from perf_common import has_amx, machine_load, save, verdict, warn_if_busy


class LlamaCppEngine:
    """llama.cpp in a worker process of its own (benchmarks/llama_cpp_worker.py), with
    OpenMP's default wait policy rather than the passive one verispec sets for torch."""

    def __init__(self, target_path: str, draft_path: str, threads: int, context: int):
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        self.worker = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("llama_cpp_worker.py")), target_path, draft_path,
             str(threads), str(context)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if not json.loads(self.worker.stdout.readline() or "{}").get("ready"):
            raise RuntimeError("the llama.cpp worker did not start")

    def _ask(self, **request) -> dict:
        self.worker.stdin.write(json.dumps(request) + "\n")
        self.worker.stdin.flush()
        line = self.worker.stdout.readline()
        if not line:
            raise SystemExit(worker_died(self.worker.wait(), request["op"]))
        return json.loads(line)

    def plain(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
        answer = self._ask(op="plain", ids=prompt, tokens=max_tokens)
        return answer["out"], answer["seconds"]

    def speculative(self, prompt: list[int], max_tokens: int, gamma: int) -> tuple[list[int], float, float]:
        answer = self._ask(op="speculative", ids=prompt, tokens=max_tokens, gamma=gamma)
        return answer["out"], answer["seconds"], answer["acceptance"]


def worker_died(status: int, op: str, amx: bool | None = None) -> str:
    """What to say when llama.cpp's worker ends mid-request. A crash on a processor with AMX is
    most likely llama.cpp's AMX products (see the top of this file), so say how to build without them."""
    message = f"llama.cpp's worker ended (exit status {status}) on a {op} request"
    if status < 0 and (has_amx() if amx is None else amx):
        message += ("; this processor has AMX, and llama.cpp 0.3.36 built for it crashes in its AMX products: "
                    "rebuild it without them (pip uninstall -y llama-cpp-python; make bench)")
    return message


def rate(tokens: list[int], seconds: float) -> float:
    return (len(tokens) - 1) / seconds if seconds > 0 else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--gammas", type=int, nargs="+", default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=None, help="prompts per kind (code, prose)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    gammas = args.gammas or ([4] if args.quick else [4, 8])
    tokens = args.tokens or (32 if args.quick else 128)
    count = args.prompts or (1 if args.quick else 2)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print(verdict("6 against llama.cpp", "llama-cpp-python is not installed (make bench)", None))
        return 0

    from verispec.generate import encode_prompt, generate
    from verispec.lab.prompts import load_prompts
    from verispec.loading import load_model, resolve

    threads = torch.get_num_threads()
    target = load_model(args.target, weights="int4")
    draft = load_model(args.draft, weights="int4")
    llama = LlamaCppEngine(str(resolve(args.target)), str(resolve(args.draft)), threads, 1024)
    print(f"verispec vs llama.cpp: {target.name} / {draft.name}, {threads} threads, {tokens} tokens, {machine_load()}")
    warn_if_busy()
    prompts = [("code", p) for p in load_prompts("spec-bench:coding", limit=count)]
    prompts += [("prose", p) for p in load_prompts("spec-bench:writing", limit=count)]
    rows, met_spec, met_moonshot, met_plain = [], True, True, True
    spec_ratios: list[float] = []
    moonshot_ratios: list[float] = []
    plain_ratios: list[float] = []
    for kind, prompt in prompts:
        ids = encode_prompt(target.tokenizer, prompt.text, chat=True)
        ours_plain = generate(target, ids, max_tokens=tokens)
        theirs_plain, theirs_plain_s = llama.plain(ids, tokens)
        row = {"prompt": prompt.id, "kind": kind, "verispec_plain": ours_plain.timings.tokens_per_s,
               "llama_plain": rate(theirs_plain, theirs_plain_s), "spec": {}}
        for g in gammas:
            ours = generate(target, ids, draft=draft, gamma=g, max_tokens=tokens)
            theirs, theirs_s, theirs_acc = llama.speculative(ids, tokens, g)
            row["spec"][g] = {
                "verispec": ours.timings.tokens_per_s, "verispec_acceptance": ours.spec.acceptance_rate,
                "verispec_identical": ours.token_ids == ours_plain.token_ids,
                "llama": rate(theirs, theirs_s), "llama_acceptance": theirs_acc,
                "llama_identical": theirs == theirs_plain}
        adaptive = generate(target, ids, draft=draft, gamma=max(gammas), adaptive="cost", max_tokens=tokens)
        row["verispec_adaptive"] = adaptive.timings.tokens_per_s
        rows.append(row)
        best_ours = max([s["verispec"] for s in row["spec"].values()] + [row["verispec_adaptive"]])
        best_theirs = max(s["llama"] for s in row["spec"].values())
        met_spec &= best_ours >= best_theirs
        met_moonshot &= best_ours >= row["llama_plain"]
        met_plain &= row["verispec_plain"] >= row["llama_plain"]
        spec_ratios.append(best_ours / best_theirs)
        moonshot_ratios.append(best_ours / row["llama_plain"])
        plain_ratios.append(row["verispec_plain"] / row["llama_plain"])
        print(f"  {kind:>5} {prompt.id}: plain verispec {row['verispec_plain']:.1f} vs llama.cpp "
              f"{row['llama_plain']:.1f} tok/s ({row['verispec_plain'] / row['llama_plain']:.2f}x); "
              f"adaptive verispec {row['verispec_adaptive']:.1f}")
        for g, s in row["spec"].items():
            print(f"        γ={g}: verispec {s['verispec']:.1f} tok/s ({s['verispec_acceptance']:.0%} accepted, "
                  f"{'identical' if s['verispec_identical'] else 'DIFFERS'}) vs llama.cpp {s['llama']:.1f} tok/s "
                  f"({s['llama_acceptance']:.0%}, {'identical' if s['llama_identical'] else 'differs'}): "
                  f"{s['verispec'] / s['llama']:.2f}x")
    print(verdict("6 speculative >= llama.cpp speculative, every prompt",
                  f"best of each engine: {min(spec_ratios):.2f}-{max(spec_ratios):.2f}x", met_spec))
    print(verdict("6 moonshot: speculative >= llama.cpp plain, every prompt",
                  f"verispec's best {min(moonshot_ratios):.2f}-{max(moonshot_ratios):.2f}x llama.cpp plain", met_moonshot))
    print(verdict("   and plain >= llama.cpp plain, every prompt",
                  f"verispec plain {min(plain_ratios):.2f}-{max(plain_ratios):.2f}x llama.cpp plain", met_plain))
    save("vs_llama_cpp" + ("_quick" if args.quick else ""), {"tokens": tokens, "threads": threads, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
