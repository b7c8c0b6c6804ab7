"""`verispec bench`: the target alone against speculative decoding, on the same prompts, audited."""

from __future__ import annotations

import time

from verispec.commands.options import (WEIGHT_FORMATS, add_kv_cache_option, add_ngram_option, add_slack_option,
                                       draft_length, draft_vocab_choice, grammar, json_schema,
                                       non_negative_float, non_negative_int, positive_int)


def register(sub) -> None:
    parser = sub.add_parser("bench", help="measure baseline against speculative decoding, audited",
                            description="For every configuration, after a warm-up, run the target alone and "
                                        "speculative decoding on the same prompts with the same token budget; "
                                        "write one JSONL record per run and print the audited table.")
    parser.add_argument("--model", "-m", required=True, help="target model: a demo name, a GGUF file or a HF folder")
    parser.add_argument("--draft", "-d", nargs="+", required=True, metavar="PROPOSER",
                        help="draft model(s), 'ngram' (prompt lookup) and/or 'synthetic:α' "
                             "(drafts the target's own token with probability α; for cost studies)")
    parser.add_argument("--gamma", "-g", type=draft_length, nargs="+", default=[4], help="draft lengths to try")
    parser.add_argument("--adaptive", nargs="?", const="cost", choices=["cost", "heuristic"], default=False,
                        help="choose γ each round, up to the largest --gamma")
    parser.add_argument("--no-lookup", action="store_true",
                        help="with --adaptive and a draft model, never send prompt lookup's drafts in the "
                             "draft model's place")
    parser.add_argument("--draft-vocab", type=draft_vocab_choice, nargs="+", default=["auto"], metavar="N",
                        help="a draft model proposes only the first N token ids and the context's; several "
                             "values bench each ('all': the whole vocabulary; 'auto', the default: 32768 for a "
                             "vocabulary of more than 65536 ids, else all)")
    parser.add_argument("--prompts", "-p", default="spec-bench",
                        help="spec-bench, spec-bench:CATEGORY[,CATEGORY], humaneval, humaneval-infill (bodies "
                             "to fill in between the docstring and the last line), a Spec-Bench-style JSONL file "
                             "(a 'suffix' makes a prompt one to fill in), or a text file with one prompt per line")
    parser.add_argument("--limit", type=non_negative_int, default=10,
                        help="prompts: K per named category, else K spread over all categories (0: all)")
    parser.add_argument("--max-tokens", "-n", type=positive_int, default=128)
    parser.add_argument("--repeats", "-r", type=positive_int, default=3)
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default=None, help="weight format of the target")
    parser.add_argument("--draft-weights", choices=WEIGHT_FORMATS, default=None,
                        help="weight format of the draft model (default: the target's --weights)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=positive_int, default=None)
    add_kv_cache_option(parser)
    parser.add_argument("--temperature", "-t", type=non_negative_float, default=0.0,
                        help="0 (default): greedy, outputs checked token for token; above 0 sampled, outputs "
                             "tested against the target's distribution")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true", help="always generate the full token budget")
    parser.add_argument("--no-chat", action="store_true", help="do not wrap prompts in the chat template")
    parser.add_argument("--json-schema", type=json_schema, default=None, metavar="SCHEMA",
                        help="hold every output to a JSON schema (its JSON, or a file); '{\"type\": \"object\"}' "
                             "for any JSON object; the audit checks each output keeps to it")
    parser.add_argument("--regex", default=None, metavar="PATTERN",
                        help="hold every output to a regular expression")
    parser.add_argument("--grammar", type=grammar, default=None, metavar="GRAMMAR",
                        help="hold every output to a Lark grammar in llguidance's dialect (its text, or a file)")
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--bandwidth-gb-s", type=non_negative_float, default=None,
                        help="the machine's peak memory bandwidth, for the bandwidth rule of the audit")
    add_slack_option(parser)
    add_ngram_option(parser)
    parser.add_argument("--out", "-o", default=None,
                        help="JSONL file for the raw runs (default: results/bench-<time>.jsonl); runs already "
                             "in it are reused and new ones appended, so an interrupted bench resumes")
    parser.add_argument("--restart", action="store_true", help="discard the runs already in --out")
    parser.set_defaults(func=run)


def run(args) -> int:
    import torch
    from rich.console import Console

    from verispec.config import draft_format
    from verispec.errors import VerispecError
    from verispec.lab.bench import Bench, BenchSettings, load_for_bench, parse_proposer, spec_configs
    from verispec.lab.prompts import load_prompts
    from verispec.lab.records import RecordWriter, runs_by_key
    from verispec.lab.report import print_tables, summarize
    from verispec.spec.compat import check_tokenizers

    console = Console(highlight=False)
    has_model = any(p.kind == "draft" for p in map(parse_proposer, args.draft))
    if args.draft_weights and not has_model:
        raise VerispecError("--draft-weights sets a draft model's weight format, but no --draft here is a model")
    if args.draft_vocab != ["auto"] and not has_model:
        raise VerispecError("--draft-vocab limits a draft model's vocabulary, but no --draft here is a model")
    if args.no_lookup and (not has_model or args.adaptive != "cost"):
        raise VerispecError("--no-lookup keeps --adaptive's rounds to the draft model, but "
                            + ("no --draft here is a model" if not has_model else "--adaptive cost is not on"))
    if args.threads:
        torch.set_num_threads(args.threads)
    adaptive = [args.adaptive] if args.adaptive else [False]
    gammas = [max(args.gamma)] if args.adaptive else args.gamma
    configs = spec_configs(args.draft, gammas, adaptive, lookup=[not args.no_lookup], draft_vocab=args.draft_vocab)
    prompts = load_prompts(args.prompts, args.limit or None)
    settings = BenchSettings(max_tokens=args.max_tokens, repeats=args.repeats, temperature=args.temperature,
                             seed=args.seed, chat=False if args.no_chat else None, ignore_eos=args.ignore_eos,
                             warmup=not args.no_warmup, bandwidth_gb_s=args.bandwidth_gb_s, slack=args.slack,
                             ngram=tuple(args.ngram), json_schema=args.json_schema, regex=args.regex,
                             grammar=args.grammar)
    settings.structure()  # a bad schema, pattern or grammar stops here, before the models load
    out = args.out or time.strftime("results/bench-%Y%m%d-%H%M%S.jsonl")
    writer = RecordWriter(out, fresh=args.restart)  # checks the path now, writes only with the first record
    done = {} if args.restart else runs_by_key(out)
    with console.status(f"loading {args.model}"):
        target = load_for_bench(args.model, args.weights, args.device, args.kv_cache)
        draft_weights = draft_format(args.weights, args.draft_weights)
        drafts = {p.label: load_for_bench(p.label, draft_weights, args.device, args.kv_cache)
                  for p in map(parse_proposer, args.draft) if p.kind == "draft"}
    for draft in drafts.values():  # before the first run: a mismatch would stop the bench halfway
        check_tokenizers(target.tokenizer, draft.tokenizer)
    runs = len(prompts) * args.repeats * (len(configs) + 1)
    console.print(f"{len(prompts)} prompt(s) × {args.repeats} repeat(s) × (baseline + {len(configs)} "
                  f"configuration(s)) = {runs} runs of {args.max_tokens} tokens → {out}")
    if done:
        console.print(f"[dim]{out} already holds {len(done)} run(s): the matching ones are reused and new ones "
                      f"appended (--restart discards them)[/dim]")
    bench = Bench(target, settings, drafts, on_record=writer.write, done=done, label=args.model)
    with console.status("running") as status:
        bench.on_run = lambda what: status.update(f"running {what}")
        records = bench.run(args.prompts, prompts, configs)
    print_per_prompt(console, records)
    rows = summarize(records, args.slack)
    print_tables(console, rows, records)
    console.print(f"[dim]raw runs: {out}[/dim]")
    return 0 if all(row.verdict.valid for row in rows) else 1


def print_per_prompt(console, records: list[dict]) -> None:
    from rich.table import Table

    table = Table(title="per run", title_justify="left")
    for column in ("prompt", "configuration", "repeat", "tokens", "tok/s", "speed-up", "acceptance",
                   "tokens/pass", "draft/target/other ms", "passes", "peak MB", "audit"):
        table.add_column(column, justify="left" if column in ("prompt", "configuration", "audit") else "right")
    for r in records:
        spec = r.get("spec")
        split = r["time_split"]
        config = "baseline" if r["proposer_kind"] == "baseline" else f"{r['proposer']} γ={r['gamma']}"
        if r.get("draft_vocab") is not None:
            config += f" vocab={r['draft_vocab']}"
        table.add_row(f"#{r['prompt_id']} {r['category']}", config, str(r["repeat"] + 1),
                      str(r["completion_tokens"]), f"{r['tok_s']:.2f}",
                      f"{r['speedup']:.2f}x" if r.get("speedup") else "",
                      f"{spec['acceptance_rate']:.0%}" if spec else "",
                      f"{spec['tokens_per_pass']:.2f}" if spec else "",
                      "/".join(f"{1e3 * split[k]:.0f}" for k in ("draft_s", "target_s", "other_s")),
                      str(r["target_passes"]), f"{r['peak_rss_mb']:.0f}", r["audit"]["status"])
    console.print(table)
