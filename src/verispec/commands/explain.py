"""`verispec explain`: what a pass costs, and whether speculation can pay, before running anything."""

from __future__ import annotations

import argparse

from verispec.commands.options import finite_float, non_negative_float, positive_int

PASS_SIZES = (1, 2, 3, 5, 9, 17)


def alpha_value(text: str) -> float:
    value = non_negative_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected an acceptance rate in [0, 1], got {value:g}")
    return value


def register(sub) -> None:
    from verispec.lab.costmodel import HARDWARE, WEIGHT_FORMATS

    parser = sub.add_parser("explain", help="predict the speed-up of a target/draft pair from physics or a profile")
    parser.add_argument("--target", "-m", required=True,
                        help="target: a model file or folder, a demo name, or a preset (see below)")
    parser.add_argument("--draft", "-d", required=True, help="draft: the same kinds as --target")
    parser.add_argument("--weights", choices=list(WEIGHT_FORMATS), default=None,
                        help="weight format of the target (default: the engine's float32 for files, "
                             "the preset's own format for presets)")
    parser.add_argument("--draft-weights", choices=list(WEIGHT_FORMATS), default=None,
                        help="weight format of the draft (default: --weights if given, else its own)")
    machine = parser.add_mutually_exclusive_group()
    machine.add_argument("--profile", "-p", default=None, help="a profile from `verispec calibrate --out`")
    machine.add_argument("--hardware", choices=list(HARDWARE), default=None,
                         help="a hardware preset (default: cpu, this project's CPU machines)")
    parser.add_argument("--bandwidth", type=finite_float, default=None, metavar="GB/s",
                        help="memory bandwidth, overriding the preset's or profile's")
    parser.add_argument("--flops", type=finite_float, default=None, metavar="TFLOP/s",
                        help="peak FLOP/s, overriding the preset's or profile's")
    parser.add_argument("--overhead-ms", type=non_negative_float, default=0.0,
                        help="fixed cost added to every pass (dispatch, synchronisation)")
    parser.add_argument("--context", type=positive_int, default=256, help="tokens already in the cache")
    parser.add_argument("--alpha", "-a", type=alpha_value, action="append", default=[],
                        help="an acceptance rate to explain in full (repeatable)")
    parser.epilog = "presets: " + ", ".join(_preset_names())
    parser.set_defaults(func=run)


def _preset_names() -> list[str]:
    from verispec.lab.costmodel import MODEL_PRESETS
    return list(MODEL_PRESETS)


def _hardware(args):
    from dataclasses import replace

    from verispec.errors import VerispecError
    from verispec.lab.costmodel import hardware_preset

    profile = None
    if args.profile:
        from verispec.lab.calibrate import load_profile
        profile = load_profile(args.profile)
        hardware = profile.hardware()
    else:
        hardware = hardware_preset(args.hardware or "cpu")
    for value, label in ((args.bandwidth, "--bandwidth"), (args.flops, "--flops")):
        if value is not None and not value > 0:
            raise VerispecError(f"{label} must be a positive number, got {value:g}")
    if args.bandwidth is not None:
        hardware = replace(hardware, name="custom", note="", bandwidth=args.bandwidth * 1e9)
    if args.flops is not None:
        hardware = replace(hardware, name="custom", note="", peak_flops=args.flops * 1e12)
    return replace(hardware, overhead_s=args.overhead_ms / 1e3), profile


def _measured_costs(profile, roofline):
    """The profile's measured costs when it timed this very pair in these formats, else None."""
    if profile is None or profile.target is None or profile.draft is None:
        return None
    same_target = (profile.target.model, profile.target.weights) == (
        roofline.target.name, roofline.weight_format(roofline.target).name)
    same_draft = (profile.draft.model, profile.draft.weights) == (
        roofline.draft.name, roofline.weight_format(roofline.draft).name)
    return profile.costs() if same_target and same_draft else None


def run(args) -> int:
    from rich.console import Console

    from verispec.lab.costmodel import ALPHAS, RooflineCosts, resolve_shape

    console = Console(highlight=False)
    hardware, profile = _hardware(args)
    roofline = RooflineCosts(resolve_shape(args.target), resolve_shape(args.draft), hardware,
                             args.weights, args.draft_weights, args.context)
    measured = _measured_costs(profile, roofline)
    print_models(console, roofline)
    if profile is not None and measured is None:
        timed = " and ".join(f"{t.model} ({t.weights})" for t in (profile.target, profile.draft) if t) or "no models"
        console.print(f"[dim]the profile timed {timed}, not this pair: using the roofline at its measured "
                      f"bandwidth and FLOP/s[/dim]")
    print_passes(console, roofline, measured)
    costs = measured or roofline
    source = f"measured in {args.profile}" if measured else f"roofline on {hardware.name}"
    print_predictions(console, costs, source, sorted(set(ALPHAS) | set(args.alpha)))
    for alpha in args.alpha:
        print_alpha(console, costs, alpha)
    return 0


def print_models(console, roofline) -> None:
    from rich.table import Table

    hw = roofline.hardware
    console.print(f"[bold]{hw.name}[/bold]: {hw.bandwidth / 1e9:,.1f} GB/s, {hw.peak_flops / 1e12:,.2f} TFLOP/s, "
                  f"ridge {hw.ridge:,.0f} FLOP/byte" + (f", {hw.overhead_s * 1e3:g} ms per pass" if hw.overhead_s else "")
                  + (f" · {hw.note}" if hw.note else ""))
    table = Table(title=f"models ({roofline.context} tokens in the cache)")
    for column in ("role", "model", "params", "active", "format", "B/weight", "GFLOPs/position"):
        table.add_column(column)
    notes = []
    for role, shape in (("target", roofline.target), ("draft", roofline.draft)):
        fmt = roofline.weight_format(shape)
        table.add_row(role, shape.name, f"{shape.total_params / 1e9:.2f} B", f"{shape.active_params / 1e9:.2f} B",
                      fmt.name, f"{fmt.bytes_per_weight:.4g}", f"{shape.flops_per_position(roofline.context) / 1e9:.2f}")
        if shape.is_moe:
            notes.append(f"{shape.name}: {shape.moe_layers} MoE layers of {shape.num_experts} experts, "
                         f"top-{shape.experts_per_token}")
        notes.append(f"{shape.name}: shapes from {shape.source}")
    console.print(table)
    for note in notes:
        console.print(f"[dim]{note}[/dim]")


def print_passes(console, roofline, measured) -> None:
    from rich.table import Table

    target = roofline.target
    table = Table(title=f"roofline of one target pass over m positions ({target.name})")
    columns = ["m", "weights GB", "cache MB", "GFLOP", "t(m) ms", "bound", "r(m)"]
    if target.is_moe:
        columns.insert(1, "experts")
    if measured:
        columns += ["measured t(m) ms", "measured r(m)"]
    for column in columns:
        table.add_column(column, justify="right")
    for m in PASS_SIZES:
        cost = roofline.pass_cost(target, m)
        row = [str(m), f"{cost.weight_bytes / 1e9:.3f}", f"{cost.cache_bytes / 1e6:.1f}", f"{cost.flops / 1e9:.1f}",
               f"{cost.seconds * 1e3:.2f}", cost.bound, f"{roofline.r(m):.2f}"]
        if target.is_moe:
            row.insert(1, f"{cost.distinct_experts:.1f}")
        if measured:
            row += [f"{measured.t_target(m) * 1e3:.1f}", f"{measured.r(m):.2f}"]
        table.add_row(*row)
    console.print(table)
    draft = roofline.pass_cost(roofline.draft, 1)
    line = (f"draft step ({roofline.draft.name}): roofline {draft.seconds * 1e3:.2f} ms, "
            f"c = {roofline.c:.3f}")
    if measured:
        line += f"; measured c = {measured.c:.3f}"
    console.print(line)


def print_predictions(console, costs, source: str, alphas) -> None:
    from rich.table import Table

    from verispec.lab.costmodel import GAMMAS, best_gamma, predict

    baseline = 1.0 / costs.target_step_s
    speedups = Table(title=f"predicted speed-up ({source})")
    rates = Table(title=f"predicted tok/s; the target alone: {baseline:,.2f} tok/s")
    for table in (speedups, rates):
        table.add_column("α", justify="right")
        for gamma in GAMMAS:
            table.add_column(f"γ={gamma}", justify="right")
    speedups.add_column("best γ (1..16)", justify="right")
    for alpha in alphas:
        predictions = [predict(costs, alpha, gamma) for gamma in GAMMAS]
        best = best_gamma(costs, alpha)
        speedups.add_row(f"{alpha:g}", *(_styled(p.speedup, f"{p.speedup:.2f}×") for p in predictions),
                         f"{best.gamma} ({best.speedup:.2f}×)" if best.speedup >= 1 else "none (γ = 0)")
        rates.add_row(f"{alpha:g}", *(_styled(p.speedup, f"{p.speculative_tps:,.2f}") for p in predictions))
    console.print(speedups)
    console.print(rates)
    console.print(f"[dim]c = {costs.c:.3f}, draft r(2) = {costs.draft_r2:.2f}; "
                  + ", ".join(f"r({g + 1}) = {costs.r(g + 1):.2f}" for g in GAMMAS) + "[/dim]")


def _styled(speedup: float, text: str) -> str:
    style = "green" if speedup >= 1 else "red"
    return f"[{style}]{text}[/{style}]"


def print_alpha(console, costs, alpha: float) -> None:
    from verispec.lab.costmodel import best_gamma, slowdown_reason

    best = best_gamma(costs, alpha)
    if best.speedup >= 1:
        console.print(f"at α = {alpha:g}: best γ = {best.gamma}, predicted speed-up {best.speedup:.2f}× "
                      f"({best.speculative_tps:,.2f} tok/s)", soft_wrap=True)
        return
    console.print(f"at α = {alpha:g}: speed-up < 1 for every γ (best γ = {best.gamma} at {best.speedup:.2f}×); "
                  f"decode without a draft. {slowdown_reason(costs, best)}", soft_wrap=True)
