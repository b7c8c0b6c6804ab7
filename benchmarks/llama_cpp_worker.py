"""llama.cpp's side of benchmarks/vs_llama_cpp.py, in a process of its own.

llama.cpp's CPU backend runs on OpenMP, and in one process with torch it would share torch's
OpenMP library, which verispec sets to wait passively: that slows llama.cpp's barriers by a
third. Here it keeps OpenMP's default. One JSON request per line on stdin, one answer per
line on stdout:

    {"op": "plain", "ids": [...], "tokens": N}             -> {"out": [...], "seconds": s}
    {"op": "speculative", "ids": [...], "tokens": N, "gamma": g}
                                                           -> {"out": [...], "seconds": s, "acceptance": a}
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np


class LlamaCppEngine:
    def __init__(self, target_path: str, draft_path: str, threads: int, context: int):
        from llama_cpp import Llama

        options = dict(n_threads=threads, n_threads_batch=threads, n_ctx=context, logits_all=True,
                       verbose=False, n_batch=512)
        self.target = Llama(model_path=target_path, **options)
        self.draft = Llama(model_path=draft_path, **options)
        self.eos = self.target.token_eos()

    @staticmethod
    def _feed(model, tokens: list[int]) -> np.ndarray:
        """Evaluate tokens after the model's current ones; their logit rows."""
        start = model.n_tokens
        model.eval(tokens)
        return model.scores[start:start + len(tokens)]

    def plain(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
        self.target.reset()
        out = [int(self._feed(self.target, prompt)[-1].argmax())]
        started = time.perf_counter()
        while len(out) < max_tokens and out[-1] != self.eos:
            out.append(int(self._feed(self.target, [out[-1]])[-1].argmax()))
        return out, time.perf_counter() - started

    def speculative(self, prompt: list[int], max_tokens: int, gamma: int) -> tuple[list[int], float, float]:
        target, draft = self.target, self.draft
        target.reset()
        draft.reset()
        out = [int(self._feed(target, prompt)[-1].argmax())]
        started = time.perf_counter()
        self._feed(draft, prompt)
        drafted = accepted = 0
        while len(out) < max_tokens and out[-1] != self.eos:
            context = prompt + out
            g = min(gamma, max_tokens - len(out) - 1)
            proposals: list[int] = []
            feed = context[draft.n_tokens:]
            for _ in range(g):
                proposals.append(int(self._feed(draft, feed)[-1].argmax()))
                feed = [proposals[-1]]
            base = target.n_tokens
            rows = self._feed(target, [context[-1], *proposals]).argmax(-1)
            kept = 0
            while kept < g and int(rows[kept]) == proposals[kept]:
                kept += 1
            new = proposals[:kept] + [int(rows[kept])]
            drafted, accepted = drafted + g, accepted + kept
            target.n_tokens = base + 1 + kept  # rejected cells are dropped by the next eval
            draft.n_tokens = min(draft.n_tokens, len(context) + kept)
            for token in new:
                out.append(token)
                if token == self.eos or len(out) >= max_tokens:
                    break
        return out, time.perf_counter() - started, accepted / drafted if drafted else 0.0


def main() -> int:
    target_path, draft_path, threads, context = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    engine = LlamaCppEngine(target_path, draft_path, threads, context)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "plain":
            out, seconds = engine.plain(request["ids"], request["tokens"])
            answer = {"out": out, "seconds": seconds}
        else:
            out, seconds, acceptance = engine.speculative(request["ids"], request["tokens"], request["gamma"])
            answer = {"out": out, "seconds": seconds, "acceptance": acceptance}
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
