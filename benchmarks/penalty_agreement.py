"""Why a penalised draft still parts from a penalised target more often than an unpenalised
pair does: the draft's and the target's choices, position by position, with and without the
penalties. A count, not a timing.

    python benchmarks/penalty_agreement.py                  # coding and writing, 3 prompts each
    python benchmarks/penalty_agreement.py --categories writing --prompts 5 --settings "repetition 1.1"
    python benchmarks/penalty_agreement.py --draft-vocab auto    # the draft limited as the engine limits it

For each prompt and setting (benchmarks/penalties.py's) the target answers greedily under the
penalties. Then the target and the draft each read the prompt and that answer in one pass,
and every answer position's row is taken as it is and as the penalties leave it, given the
answer before it (verispec.penalties.PenaltyState, as decoding applies it). The penalised
target's choice must be the answer's token (a pass gives each row the logits a plain step
does). Per position: did the penalties change the target's choice, did they change the
draft's, and does the penalised draft choose the target's token: the acceptance a draft that
read the whole context would reach at γ = 1; and does either of the draft's two choices (a
tree of two proposals where the penalties turned the draft's choice) hold the target's. The
draft proposes the whole vocabulary unless --draft-vocab limits it as the engine does (its
first ids, Markdown's marks, and every id of the prompt and of the answer before the
position).
"""

from __future__ import annotations

import argparse
import sys

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch
from verispec.commands.options import draft_vocab_choice

from perf_common import add_pair_arguments, category_prompts, load_pair, save
from penalties import SETTINGS, fence_ban

CELLS = ("neither", "target only", "draft only", "both")  # whose choice the penalties changed


def rows_of(model, prompt_ids: list[int], answer: list[int]) -> torch.Tensor:
    """The model's logits at the positions that choose the answer's tokens: [len(answer), vocab]."""
    ids = prompt_ids + answer
    with torch.inference_mode():
        logits = model.model(torch.tensor([ids]), model.model.new_cache(len(ids)))[0]
    return logits[len(prompt_ids) - 1:len(ids) - 1].float()


def limited(rows: torch.Tensor, limit: int | None, standing: list[int], prompt_ids: list[int],
            answer: list[int]) -> torch.Tensor:
    """`rows` with every id the limited draft cannot propose at its position set to -inf: it
    proposes the first `limit` ids, the `standing` ones, and those of the prompt and of the
    answer before the position. `limit` None: `rows` as they are."""
    if limit is None:
        return rows
    allowed = torch.zeros(rows.shape, dtype=torch.bool)
    allowed[:, :limit] = True
    allowed[:, [i for i in dict.fromkeys(standing + prompt_ids) if i < rows.shape[1]]] = True
    for position, token in enumerate(answer[:-1]):
        if token < rows.shape[1]:
            allowed[position + 1:, token] = True  # rows after the token's own choose with it in context
    return rows.masked_fill(~allowed, float("-inf"))


def penalised(rows: torch.Tensor, penalties, prompt_ids: list[int], answer: list[int]) -> torch.Tensor:
    """`rows` as decoding penalises them: row i after the answer's first i tokens."""
    from verispec.penalties import PenaltyState

    return PenaltyState(penalties, prompt_ids).apply(rows, drafts=answer)


def position_counts(target_rows, draft_rows, target_penalised, draft_penalised, answer: list[int]) -> dict:
    """Per cell (whose choice the penalties changed): positions, and those where the penalised
    draft, the unpenalised draft, and either of the two (a tree that proposes both where they
    differ) chose the target's token; and how many positions the penalised target's choice was
    not the answer's token (0 when the pass is exact)."""
    target_plain, target_choice = target_rows.argmax(-1).tolist(), target_penalised.argmax(-1).tolist()
    draft_plain, draft_choice = draft_rows.argmax(-1).tolist(), draft_penalised.argmax(-1).tolist()
    counts = empty_counts()
    for i, token in enumerate(answer):
        cell = CELLS[int(target_plain[i] != target_choice[i]) + 2 * int(draft_plain[i] != draft_choice[i])]
        counts[cell]["positions"] += 1
        counts[cell]["penalised_draft_agrees"] += int(draft_choice[i] == token)
        counts[cell]["unpenalised_draft_agrees"] += int(draft_plain[i] == token)
        counts[cell]["either_draft_agrees"] += int(token in (draft_choice[i], draft_plain[i]))
    counts["not_the_answer"] = sum(choice != token for choice, token in zip(target_choice, answer))
    return counts


def empty_counts() -> dict:
    fields = ("positions", "penalised_draft_agrees", "unpenalised_draft_agrees", "either_draft_agrees")
    return {**{cell: dict.fromkeys(fields, 0) for cell in CELLS}, "not_the_answer": 0}


def add_counts(total: dict, counts: dict) -> None:
    for cell in CELLS:
        for key, value in counts[cell].items():
            total[cell][key] += value
    total["not_the_answer"] += counts["not_the_answer"]


def summary(total: dict) -> str:
    positions = sum(total[cell]["positions"] for cell in CELLS)
    agree = sum(total[cell]["penalised_draft_agrees"] for cell in CELLS)
    either = sum(total[cell]["either_draft_agrees"] for cell in CELLS)
    parts = [f"{positions} positions, the penalised draft agrees {agree / max(positions, 1):.1%}, "
             f"either draft {either / max(positions, 1):.1%}"]
    for cell in CELLS:
        c = total[cell]
        if c["positions"]:
            parts.append(f"{cell} changed {c['positions']} ({c['positions'] / positions:.1%}): penalised draft "
                         f"{c['penalised_draft_agrees'] / c['positions']:.0%}, unpenalised "
                         f"{c['unpenalised_draft_agrees'] / c['positions']:.0%}"
                         + (f", either {c['either_draft_agrees'] / c['positions']:.0%}"
                            if cell in ("draft only", "both") else ""))
    return "; ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--categories", nargs="+", default=["coding", "writing"])
    parser.add_argument("--prompts", type=int, default=3, help="prompts per category")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--draft-vocab", type=draft_vocab_choice, default=None, metavar="N",
                        help="'all' (default), 'auto' or a number of first ids: what the draft may propose")
    args = parser.parse_args()

    from verispec.generate import encode_prompt, generate
    from verispec.penalties import Penalties
    from verispec.spec.draft_model import markdown_ids, pair_vocab_limit

    target, draft, record = load_pair(args, "penalised choices, position by position", f"{args.tokens} tokens, greedy")
    settings = {name: dict(SETTINGS[name]) for name in args.settings}
    if "no code fences" in settings:
        settings["no code fences"]["logit_bias"] = fence_ban(target.tokenizer)
    limit = pair_vocab_limit(args.draft_vocab, draft, target)
    standing = markdown_ids(draft.tokenizer) if limit is not None else []
    proposes = "every id" if limit is None else f"the first {limit} ids, Markdown's and the context's"
    print(f"  the draft proposes {proposes}")
    record.update(tokens=args.tokens, draft_vocab=limit, categories={})
    exact = True
    for category in args.categories:
        totals = {name: empty_counts() for name in settings}
        for prompt in category_prompts(category, args.prompts):
            prompt_ids = encode_prompt(target.tokenizer, prompt.text, True)
            for name, options in settings.items():
                answer = generate(target, prompt_ids, max_tokens=args.tokens, **options).token_ids
                penalties = Penalties(options.get("presence_penalty", 0.0), options.get("frequency_penalty", 0.0),
                                      options.get("repetition_penalty", 1.0), options.get("logit_bias", ()))
                target_rows = rows_of(target, prompt_ids, answer)
                draft_rows = limited(rows_of(draft, prompt_ids, answer), limit, standing, prompt_ids, answer)
                add_counts(totals[name], position_counts(
                    target_rows, draft_rows, penalised(target_rows, penalties, prompt_ids, answer),
                    penalised(draft_rows, penalties, prompt_ids, answer), answer))
        for name, total in totals.items():
            exact &= total["not_the_answer"] == 0
            print(f"  {category:>10} {name:>15}: {summary(total)}"
                  + (f"; {total['not_the_answer']} rows NOT the answer's token" if total["not_the_answer"] else ""))
        record["categories"][category] = totals
    save("penalty_agreement" if limit is None else f"penalty_agreement_vocab_{limit}", record)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
