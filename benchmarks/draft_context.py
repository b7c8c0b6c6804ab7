"""How much of the context a draft needs: its agreement with the target's greedy tokens when it
reads only the last W tokens of the prompt, against prompt lookup's, and what reading it costs.

    python benchmarks/draft_context.py                     # summarization, rag, translation, coding
    python benchmarks/draft_context.py --categories summarization --windows 32 256 --prompts 2

With --adaptive, a draft model reads only the last READY_LAG tokens before it drafts (reading
a long prompt whole would cost a large part of a short answer). For each prompt the target
decodes greedily; the draft then reads, in one pass each, the last W prompt tokens (and with
--sink S, the first S as well) followed by the target's answer, and `agree` is how often its
most likely next token is the target's at the answer's positions: the acceptance a draft with
that context would reach at γ = 1. `lookup` is how often prompt lookup (the engine's
LOOKUP_NGRAM sizes) has a continuation at an answer position, and how often its first token
is the target's where it has one. Last, the draft's reading cost: one pass over the prompt,
in milliseconds per position.
"""

from __future__ import annotations

import argparse
import sys
import time

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import add_pair_arguments, load_pair, save


def greedy_answer(target, prompt_ids: list[int], tokens: int) -> list[int]:
    from verispec.generate import generate

    return generate(target, prompt_ids, max_tokens=tokens).token_ids


def agreement(draft, prompt_ids: list[int], answer: list[int], window: int, sink: int) -> float:
    """How often the draft, reading the first `sink` and last `window` prompt tokens and then
    the answer, would have drafted the answer's next token."""
    start = max(sink, len(prompt_ids) - window)
    fed = prompt_ids[:sink] + prompt_ids[start:] + answer
    logits = draft.model(torch.tensor([fed]), draft.model.new_cache(len(fed)))[0]
    first = len(fed) - len(answer) - 1  # the position whose next token is the answer's first
    guesses = logits[first:first + len(answer)].argmax(-1).tolist()
    return sum(g == t for g, t in zip(guesses, answer)) / len(answer)


def lookup_agreement(prompt_ids: list[int], answer: list[int]) -> tuple[float, float]:
    """(share of answer positions where prompt lookup has a continuation, share of those
    where its first token is the target's)."""
    from verispec.generate import policy_lookup

    lookup = policy_lookup()
    found = right = 0
    for i, token in enumerate(answer):
        guess = lookup.lookup(prompt_ids + answer[:i], 1)
        found += bool(guess)
        right += guess == [token]
    return found / len(answer), right / max(found, 1)


def reading_ms(draft, prompt_ids: list[int]) -> float:
    """The draft's time to read the prompt in one pass, per position (best of two)."""
    times = []
    for _ in range(2):
        cache = draft.model.new_cache(len(prompt_ids))
        started = time.perf_counter()
        draft.model(torch.tensor([prompt_ids]), cache, last_only=True)
        times.append(time.perf_counter() - started)
    return 1e3 * min(times) / len(prompt_ids)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--categories", nargs="+", default=["summarization", "rag", "translation", "coding"])
    parser.add_argument("--windows", type=int, nargs="+", default=[32, 128, 256])
    parser.add_argument("--sink", type=int, default=0, help="also read the prompt's first S tokens")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per category")
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()

    from verispec.generate import encode_prompt
    from verispec.lab.prompts import load_prompts

    sink = f", the first {args.sink} read too" if args.sink else ""
    target, draft, record = load_pair(args, "the draft's context", f"{args.tokens} tokens{sink}")
    record.update(tokens=args.tokens, sink=args.sink, requests=[])
    with torch.inference_mode():
        for category in args.categories:
            for prompt in load_prompts(f"spec-bench:{category}", limit=args.prompts):
                prompt_ids = encode_prompt(target.tokenizer, prompt.text, True)
                answer = greedy_answer(target, prompt_ids, args.tokens)
                if not answer:
                    continue
                agree = {w: agreement(draft, prompt_ids, answer, w, args.sink) for w in args.windows}
                agree["all"] = agreement(draft, prompt_ids, answer, len(prompt_ids), 0)
                found, right = lookup_agreement(prompt_ids, answer)
                cost = reading_ms(draft, prompt_ids)
                record["requests"].append({"category": category, "prompt_tokens": len(prompt_ids),
                                           "answer_tokens": len(answer), "agree": agree, "lookup_found": found,
                                           "lookup_right": right, "reading_ms_per_position": cost})
                windows = "  ".join(f"last {w}: {a:.2f}" for w, a in agree.items() if w != "all")
                print(f"  {category:>14} prompt {len(prompt_ids):4d}, answer {len(answer):3d} | agree {windows}  "
                      f"whole: {agree['all']:.2f} | lookup finds {found:.0%}, right {right:.0%} | reading "
                      f"{cost:.2f} ms a position, {cost * len(prompt_ids):.0f} ms in all", flush=True)
    save("draft_context", record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
