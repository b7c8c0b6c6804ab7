"""`verispec generate`: decode one prompt, plainly or speculatively."""

from __future__ import annotations

import json
import sys

from verispec.commands.options import (add_draft_vocab_option, add_model_options, finite_float, grammar,
                                       id_and_amount, json_schema, load_target_and_draft, non_negative_float,
                                       non_negative_int, probability)
from verispec.events import MAX_TOP_LOGPROBS

# how --show colours each token by origin (the seed's figure: kept drafts purple)
ORIGIN_STYLE = {"target": "default", "draft": "magenta", "recovered": "red", "bonus": "green"}


def register(sub) -> None:
    parser = sub.add_parser("generate", help="generate text from a prompt")
    add_model_options(parser)
    add_draft_vocab_option(parser)
    parser.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--suffix", default=None, metavar="TEXT",
                        help="fill in the middle: generate the text between the prompt and this (code models "
                             "trained for it, such as Qwen2.5-Coder)")
    parser.add_argument("--max-tokens", "-n", type=non_negative_int, default=128,
                        help="tokens to generate (0 with --prompt-logprobs: score the prompt alone)")
    parser.add_argument("--min-tokens", type=non_negative_int, default=0,
                        help="tokens before the end-of-text token, a stop token or a stop string may end the text")
    parser.add_argument("--temperature", "-t", type=non_negative_float, default=0.0,
                        help="0 (default) decodes greedily")
    parser.add_argument("--top-k", type=non_negative_int, default=0)
    parser.add_argument("--top-p", type=probability, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--presence-penalty", type=finite_float, default=0.0,
                        help="subtracted from a token's logit once it has been generated (-2 to 2)")
    parser.add_argument("--frequency-penalty", type=finite_float, default=0.0,
                        help="subtracted from a token's logit for each time it has been generated (-2 to 2)")
    parser.add_argument("--repetition-penalty", type=finite_float, default=1.0,
                        help="divides the positive logits (multiplies the negative) of tokens in the prompt "
                             "or output; 1: none")
    parser.add_argument("--logit-bias", type=id_and_amount, action="append", default=[], metavar="ID=AMOUNT",
                        help="add AMOUNT (-100 to 100) to token ID's logit, as 13=-100 (repeatable)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--stop-token-id", type=non_negative_int, action="append", default=[], metavar="ID",
                        help="a token id that ends the text as a stop string does (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past the end-of-text token")
    parser.add_argument("--json-schema", type=json_schema, default=None, metavar="SCHEMA",
                        help="hold the output to a JSON schema (its JSON, or a file); '{\"type\": \"object\"}' "
                             "for any JSON object")
    parser.add_argument("--regex", default=None, metavar="PATTERN", help="hold the output to a regular expression")
    parser.add_argument("--grammar", type=grammar, default=None, metavar="GRAMMAR",
                        help="hold the output to a Lark grammar in llguidance's dialect (its text, or a file), "
                             "which may embed JSON schemas as %%json {...}")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    parser.add_argument("--logprobs", type=non_negative_int, default=None, metavar="N",
                        help="with --json: each token's log-probability under the target and its N most "
                             f"likely alternatives (0 to {MAX_TOP_LOGPROBS})")
    parser.add_argument("--prompt-logprobs", type=non_negative_int, default=None, metavar="N",
                        help="with --json: the same for every prompt token, given the tokens before it")
    parser.add_argument("--show", action="store_true",
                        help="colour tokens by origin (kept draft, recovered, bonus) and print the statistics")
    parser.set_defaults(func=run)


def run(args) -> int:
    from rich.console import Console

    from verispec.errors import VerispecError
    from verispec.events import Finished, Token
    from verispec.generate import stream

    for flag, value in (("--logprobs", args.logprobs), ("--prompt-logprobs", args.prompt_logprobs)):
        if value is not None and not args.json:
            raise VerispecError(f"{flag} is reported in the JSON output: add --json")
        if value is not None and value > MAX_TOP_LOGPROBS:
            raise VerispecError(f"{flag} takes 0 to {MAX_TOP_LOGPROBS} alternatives per token, got {value}")
    if args.max_tokens == 0 and args.prompt_logprobs is None:
        raise VerispecError("--max-tokens 0 generates nothing; it is for scoring a prompt with --prompt-logprobs")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    target, draft = load_target_and_draft(args)
    events = stream(target, prompt, draft=draft, gamma=args.gamma, adaptive=args.adaptive,
                    max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, seed=args.seed, stop=args.stop, chat=args.chat,
                    ignore_eos=args.ignore_eos, ngram=tuple(args.ngram), draft_vocab=args.draft_vocab,
                    lookup=not args.no_lookup, logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs,
                    presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                    repetition_penalty=args.repetition_penalty, logit_bias=args.logit_bias,
                    stop_token_ids=args.stop_token_id, min_tokens=args.min_tokens,
                    suffix=args.suffix, json_schema=args.json_schema, regex=args.regex,
                    grammar=args.grammar)
    console = Console(highlight=False)
    result = None
    for event in events:
        if isinstance(event, Finished):
            result = event.result
            if not args.json:
                console.print(event.tail, end="", markup=False)
        elif isinstance(event, Token) and not args.json:
            style = ORIGIN_STYLE[event.origin] if args.show else None
            console.print(event.text, end="", style=style, markup=False, soft_wrap=True)
            sys.stdout.flush()
    if args.json:
        print(json.dumps(result.to_dict(), ensure_ascii=False))
        return 0
    console.print()
    t = result.timings
    draft_load = f" (draft {draft.load_s:.1f} s)" if hasattr(draft, "load_s") else ""
    console.print(f"[dim]load {t.load_s:.1f} s{draft_load} · prompt {result.prompt_tokens} tokens, prefill "
                  f"{t.prefill_s:.2f} s · {len(result.token_ids)} tokens at {t.tokens_per_s:.1f} tok/s · "
                  f"{result.finish_reason}[/dim]")
    if result.spec is not None:
        print_spec_stats(console, result.spec, legend=args.show)
    return 0


def print_spec_stats(console, spec, legend: bool = False) -> None:
    by_position = " ".join(f"{a:.0%}" for a in spec.acceptance_by_position)
    console.print(f"[dim]speculative: {spec.rounds} target passes · drafted {spec.drafted}, accepted {spec.accepted} "
                  f"({spec.acceptance_rate:.1%}), recovered {spec.recovered}, bonus {spec.bonus}, "
                  f"plain {spec.plain} · "
                  f"{spec.tokens_per_pass:.2f} tokens/pass · draft {spec.draft_s:.2f} s"
                  + (f" (reading skipped context {spec.catch_up_s:.2f} s)" if spec.catch_up_s else "")
                  + f", verify {spec.verify_s:.2f} s[/dim]")
    if by_position:
        console.print(f"[dim]acceptance by draft position: {by_position}[/dim]")
    if spec.draft_vocab is not None:
        console.print(f"[dim]the draft proposed its first {spec.draft_vocab:,} token ids and the context's "
                      f"(--draft-vocab all: every id)[/dim]")
    if legend:
        console.print("legend: [magenta]kept draft[/magenta]  [red]recovered (target's token at a rejection)"
                      "[/red]  [green]bonus[/green]  plain = target step")
