"""`verispec calibrate`: measure this machine (and a model pair) for the cost model."""

from __future__ import annotations

from verispec.commands.options import (WEIGHT_FORMATS, add_draft_vocab_option, add_kv_cache_option,
                                       check_draft_options, default_dtype, positive_int)


def register(sub) -> None:
    parser = sub.add_parser("calibrate", help="measure bandwidth, FLOP/s and a model's verify-cost curve r(m)")
    parser.add_argument("--model", "-m", default=None, help="target model to time (name or path)")
    parser.add_argument("--draft", "-d", default=None, help="draft model to time; gives c = t_draft(1) / t_target(1)")
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default=None, help="weight format of the target")
    parser.add_argument("--draft-weights", choices=WEIGHT_FORMATS, default=None,
                        help="weight format of the draft (default: the target's --weights)")
    parser.add_argument("--max-m", type=positive_int, default=32, help="time passes over 1..MAX_M positions")
    parser.add_argument("--context", type=positive_int, default=64, help="tokens in the cache before each pass")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed repeats per size (median kept)")
    parser.add_argument("--buffer-mib", type=positive_int, default=512, help="size of the bandwidth test buffer")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: all cores)")
    add_kv_cache_option(parser)
    add_draft_vocab_option(parser)
    parser.add_argument("--out", "-o", default=None, help="save the profile as JSON here")
    parser.set_defaults(func=run)


def run(args) -> int:
    import torch
    from rich.console import Console

    from verispec.lab.calibrate import calibrate, check_profile_path
    from verispec.config import draft_format
    from verispec.loading import load_model

    check_draft_options(args)
    if args.out:
        check_profile_path(args.out)  # before measuring, which takes minutes that a bad path would waste
    console = Console(highlight=False)
    warn_if_busy(console)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = draft = None
    if args.draft and not args.model:
        console.print("[yellow]--draft without --model: timing the draft alone gives no c[/yellow]")
    if args.model:
        target = load_model(args.model, default_dtype(args.device, args.weights), args.device, args.weights,
                            args.kv_cache)
    if args.draft:
        fmt = draft_format(args.weights, args.draft_weights)
        draft = load_model(args.draft, default_dtype(args.device, fmt), args.device, fmt, args.kv_cache)
    profile = calibrate(target, draft, max_m=args.max_m, context=args.context, repeats=args.repeats,
                        buffer_bytes=args.buffer_mib * 2**20, device=args.device,
                        log=lambda msg: console.print(f"[dim]{msg}[/dim]"), draft_vocab=args.draft_vocab)
    print_profile(console, profile)
    if args.out:
        profile.save(args.out)
        console.print(f"saved {args.out}")
    return 0


def warn_if_busy(console) -> None:
    import os

    from verispec.lab.calibrate import load_average

    load, cores = load_average(), os.cpu_count() or 1
    if load is not None and load > 0.5 * cores:
        console.print(f"[yellow]the machine is busy (load average {load:.1f} on {cores} cores): "
                      f"timings will be slow and noisy; calibrate on an idle machine[/yellow]")


def print_profile(console, profile) -> None:
    from rich.table import Table

    facts = profile.machine
    console.print(f"[bold]{facts['processor']}[/bold] · {facts['cores']} cores, {facts['threads']} threads · "
                  f"torch {facts['torch']} · {facts['device']}" + (f" ({facts['accelerator']})"
                                                                   if facts.get("accelerator") else ""))
    console.print(f"bandwidth: copy {profile.copy_bytes_per_s / 1e9:.1f} GB/s (read + write), "
                  f"read {profile.read_bytes_per_s / 1e9:.1f} GB/s · matmul {profile.matmul_flops_per_s / 1e9:,.0f} "
                  f"GFLOP/s · ridge {profile.matmul_flops_per_s / profile.read_bytes_per_s:.0f} FLOP/byte")
    for role, timing in (("target", profile.target), ("draft", profile.draft)):
        if timing is None:
            continue
        vocab = "" if timing.vocab is None else f", logits of the first {timing.vocab:,} ids"
        table = Table(title=f"{role}: {timing.model} ({timing.weights}, {timing.weight_bytes / 1e9:.2f} GB of "
                            f"weights per pass, {timing.context} tokens cached{vocab})")
        for column in ("m", "t(m) ms", "r(m)", "weights GB/s"):
            table.add_column(column, justify="right")
        for m, seconds, r in zip(timing.positions, timing.seconds, timing.r):
            table.add_row(str(m), f"{seconds * 1e3:.1f}", f"{r:.2f}", f"{timing.weight_bytes / seconds / 1e9:.1f}")
        console.print(table)
    if profile.c is not None:
        console.print(f"c = t_draft(1) / t_target(1) = {profile.draft.t(1) * 1e3:.1f} / "
                      f"{profile.target.t(1) * 1e3:.1f} ms = [bold]{profile.c:.3f}[/bold]")
    draft = profile.draft
    if draft is not None and draft.prefill_lengths:
        reads = ", ".join(f"{n} tokens {s * 1e3:.0f} ms" for n, s in zip(draft.prefill_lengths, draft.prefill_seconds))
        console.print(f"the draft reads a prompt once per request: {reads}")
