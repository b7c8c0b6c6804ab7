"""`verispec demo`: the demo pair, plain and speculative, with one coloured answer and the audited table."""

from __future__ import annotations

from verispec.commands.options import WEIGHT_FORMATS, draft_length, positive_int


def register(sub) -> None:
    from verispec.lab.demo import DEMO_DRAFT, DEMO_TARGET, DemoOptions

    defaults = DemoOptions()
    parser = sub.add_parser("demo", help="run the demo: baseline, draft model and prompt lookup, audited")
    parser.add_argument("--model", "-m", default=DEMO_TARGET, help=f"target (default {DEMO_TARGET})")
    parser.add_argument("--draft", "-d", default=DEMO_DRAFT, help=f"draft model (default {DEMO_DRAFT})")
    parser.add_argument("--limit", type=positive_int, default=defaults.limit,
                        help="how many prompts (default: 2 coding questions and 1 of another category)")
    parser.add_argument("--max-tokens", "-n", type=positive_int, default=defaults.max_tokens)
    parser.add_argument("--gamma", "-g", type=draft_length, default=defaults.gamma)
    parser.add_argument("--prompts", "-p", default=None, help="a prompt source instead of the Spec-Bench pick")
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default=None, help="weight format of the target")
    parser.add_argument("--draft-weights", choices=WEIGHT_FORMATS, default=None,
                        help="weight format of the draft model (default: the target's --weights)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=positive_int, default=None)
    parser.add_argument("--out", "-o", default=defaults.out, help="JSONL file for the raw runs")
    parser.set_defaults(func=run)


def run(args) -> int:
    import torch
    from rich.console import Console

    from verispec.lab.demo import DemoOptions, run_demo

    if args.threads:
        torch.set_num_threads(args.threads)
    options = DemoOptions(args.model, args.draft, args.weights, args.draft_weights, args.device, args.limit,
                          args.max_tokens, args.gamma, args.prompts, args.out)
    return run_demo(options, Console(highlight=False))
