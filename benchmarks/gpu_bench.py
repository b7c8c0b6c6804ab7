"""Target 8: the engine on a GPU, with random-weight models of real shapes built on the device.

    python benchmarks/gpu_bench.py                      # CUDA: an 8B dense and a 30B-A3B MoE shape, bf16
    python benchmarks/gpu_bench.py --tiny --device cpu  # the same script at toy sizes (the tests run this)

First an engine check: tiny checkpoint folders loaded on the device in every weight format,
decoded plainly and speculatively (a draft model, prompt lookup), greedy and sampled, and
through the command line; greedy speculative tokens must equal plain ones.

Then for each model: the device's read bandwidth, a decoding step's bandwidth utilisation
(bytes of weights the step reads / step time / bandwidth; for the MoE only the experts the
step routed to count), the verification cost r(m) = t(m)/t(1) for m = 1..32, and the speed-up
of speculative decoding under synthetic acceptance α in {0, 0.5, 0.8} x γ in {4, 8, 16}: a
proposer that drafts the target's own next token with probability α and costs nothing, so
the figure is what the target's verification passes allow, printed beside the cost model's
prediction from the measured r(γ+1). Every speculative output is audited against plain
decoding. Timings synchronise the device before reading the clock.

The engine runs eagerly: one kernel launch per operation, issued from Python. On a GPU a
batch-1 step of such a loop can be bound by those launches rather than by memory, so for the
dense model the script also captures each pass in a CUDA graph and replays it: the kernels'
own time, what a step would cost with the launches taken off the critical path. (The MoE's
expert loop reads its routing on the host, which a graph cannot capture.)

Results go to a JSON file after every section, so a run cut short keeps what it measured.
The GGUF part of the engine check needs the gguf package; without it that part is reported
as failed and the rest goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

SHAPES = {
    # Qwen3-8B's shape
    "dense-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                     qk_norm=True, max_position_embeddings=4096),
    # Qwen3-30B-A3B's shape: 128 experts, 8 per token
    "moe-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                        num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                        qk_norm=True, max_position_embeddings=4096),
}
TINY = {
    "dense-8b": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, intermediate_size=128),
    "moe-30b-a3b": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=128, num_experts=8,
                        num_experts_per_tok=2, moe_intermediate_size=32),
}
ALPHAS = (0.0, 0.5, 0.8)
GAMMAS = (4, 8, 16)


class _Tokenizer:
    """Random models speak no language: token ids in, no text out."""

    eos_ids: set[int] = set()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return ""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn) -> float:
    synchronize(device)
    started = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - started


def read_bandwidth(device: torch.device, nbytes: int) -> float:
    buffer = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    buffer.sum()
    best = min(timed(device, buffer.sum) for _ in range(5))
    del buffer
    return nbytes / best


def build(name: str, device: torch.device, dtype: torch.dtype, tiny: bool, seed: int = 0):
    from verispec.config import ModelConfig
    from verispec.loading import LoadedModel
    from verispec.models import build_model

    config = ModelConfig(**{**SHAPES[name], **(TINY[name] if tiny else {})})
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # never materialise the float32 model
    try:
        with torch.device(device):
            model = build_model(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.eval().requires_grad_(False)
    loaded = LoadedModel(name, Path(name), model, _Tokenizer(), config, 0.0, dtype, device, str(dtype))
    return loaded


def bytes_per_step(model) -> int:
    """Weights one single-token step reads: all but the embedding table; for an MoE only the
    experts the step routed to (read after the step has run)."""
    from verispec.quant import weight_bytes

    total = weight_bytes(model)
    if hasattr(model, "moe_blocks"):
        total -= sum(b.experts.bytes_per_expert() * b.num_experts for b in model.moe_blocks())
        total += model.touched_expert_bytes()
    return total


@torch.inference_mode()
def verify_costs(model, device, context: int, sizes, rounds: int) -> tuple[dict[int, float], int]:
    """Median seconds per eager pass over m positions. Each round starts one position further
    on, so every timed pass meets a key length it has not met before, as decoding does (a
    backend that prepares something per shape pays for it here too); round 0 is a warm-up."""
    cache = model.new_cache(context + rounds + max(sizes) + 1)
    vocab = model.config.vocab_size
    model(torch.arange(context, device=device).view(1, -1) % vocab, cache)
    feed = (torch.arange(max(sizes), device=device).view(1, -1) * 7 + 3) % vocab
    times: dict[int, list[float]] = {m: [] for m in sizes}
    step_bytes = 0
    for round_index in range(rounds + 1):
        for m in sizes:
            cache.rollback(context + round_index)
            elapsed = timed(device, lambda: model(feed[:, :m], cache))
            if m == 1:
                step_bytes = max(step_bytes, bytes_per_step(model))
            if round_index:
                times[m].append(elapsed)
    medians = {m: statistics.median(t) for m, t in times.items()}
    return medians, step_bytes


@torch.inference_mode()
def graph_costs(model, device, context: int, sizes, replays: int = 20) -> dict[int, float]:
    """Seconds per pass over m positions with the pass captured in a CUDA graph and replayed:
    the kernels' own time, without Python issuing each launch. Every replay writes the same
    cache slots after the same `context`, as a verification pass does before its rollback."""
    if device.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    if hasattr(model, "moe_blocks"):
        raise RuntimeError("the expert loop reads its routing on the host, which a graph cannot capture")
    cache = model.new_cache(context + max(sizes) + 1)
    vocab = model.config.vocab_size
    model(torch.arange(context, device=device).view(1, -1) % vocab, cache)
    feed = (torch.arange(max(sizes), device=device).view(1, -1) * 7 + 3) % vocab
    seconds: dict[int, float] = {}
    for m in sizes:
        inputs = feed[:, :m].clone()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up off the capture stream, as capture requires
            for _ in range(2):
                cache.rollback(context)
                model(inputs, cache)
        torch.cuda.current_stream(device).wait_stream(side)
        cache.rollback(context)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(inputs, cache)
        cache.rollback(context)
        graph.replay()
        best = float("inf")
        for _ in range(3):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            best = min(best, begin.elapsed_time(end) / 1e3 / replays)
        seconds[m] = best
        del graph
    return seconds


def speculative_grid(loaded, device, prompt_len: int, tokens: int, r: dict[int, float]) -> dict:
    """Measured speed-ups under synthetic acceptance, each beside the cost model's prediction
    from the measured r(γ+1) with a free draft (c = 0)."""
    from verispec.generate import generate
    from verispec.lab.costmodel import predict_speedup
    from verispec.spec.synthetic import SyntheticProposer

    vocab = loaded.config.vocab_size
    prompt = [(i * 31 + 5) % vocab for i in range(prompt_len)]
    plain_runs = [generate(loaded, prompt, max_tokens=tokens) for _ in range(2)]
    reference = plain_runs[-1].token_ids
    plain_s = min(r.timings.decode_s for r in plain_runs)
    grid = {}
    for alpha in ALPHAS:
        for gamma in GAMMAS:
            proposer = SyntheticProposer(reference, alpha, vocab, seed=1)
            spec = generate(loaded, prompt, draft=proposer, gamma=gamma, max_tokens=tokens)
            diverges = next((i for i, (a, b) in enumerate(zip(spec.token_ids, reference)) if a != b), None)
            grid[f"a={alpha},g={gamma}"] = {
                "alpha": alpha, "gamma": gamma, "speedup": plain_s / spec.timings.decode_s,
                "predicted": predict_speedup(alpha, gamma, 0.0, r) if gamma + 1 in r else None,
                "acceptance": spec.spec.acceptance_rate, "valid": spec.token_ids == reference,
                "first_difference": diverges, "rounds": spec.spec.rounds, "decode_s": spec.timings.decode_s,
                "verify_s": spec.spec.verify_s, "draft_s": spec.spec.draft_s}
    return {"plain_tok_s": (len(reference) - 1) / plain_s, "grid": grid}


ENGINE_FORMATS = ("float32", "bfloat16", "float16", "int8", "int4")
PROMPT = "the cat sat on the mat. the cat sat on the"


def _error(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def engine_check(device: torch.device, tokens: int = 24) -> dict:
    """The engine on `device` through its public paths, with tiny checkpoint folders (the
    tests' own builders): every weight format loads and decodes, a dense model's (from a
    folder and from a GGUF file) and an MoE's, and speculative greedy tokens equal plain ones;
    sampled decoding repeats itself under a seed; the command line runs.
    `ok` is whether every check passed; `cpu_agreement` (information only) is how many
    leading float32 greedy tokens the device and the CPU share."""
    sys.path.insert(0, str(REPO / "tests"))
    import test_moe
    import tiny
    from verispec.generate import generate
    from verispec.loading import load_model

    folder = Path(tempfile.mkdtemp(prefix="verispec-gpu-check-"))
    reference = tiny.save_hf_model(folder / "target", "qwen3", seed=0)
    tiny.save_hf_model(folder / "draft", "qwen3", seed=0, num_hidden_layers=1)
    test_moe.save_moe_model(folder / "moe", "qwen3_moe", seed=0)
    target_path, draft_path = folder / "target", folder / "draft"
    run = dict(max_tokens=tokens, ignore_eos=True)
    report: dict = {"formats": {}, "failures": []}

    def check(name: str, passed: bool) -> None:
        if not passed:
            report["failures"].append(name)

    try:  # needs the gguf package, which a GPU machine's image may lack
        tiny.write_gguf(folder / "target.gguf", reference, "qwen3", embedding_type="Q8_0")
    except Exception as exc:
        check(f"writing a GGUF file: {_error(exc)}", False)

    for fmt in ENGINE_FORMATS:
        try:
            target = load_model(target_path, device=str(device), weights=fmt)
            draft = load_model(draft_path, device=str(device), weights=fmt)
            plain = generate(target, PROMPT, **run).token_ids
            by_draft = generate(target, PROMPT, draft=draft, gamma=4, **run)
            by_lookup = generate(target, PROMPT, draft="ngram", gamma=4, **run)
            report["formats"][fmt] = {
                "tokens": len(plain), "draft_equal": by_draft.token_ids == plain,
                "lookup_equal": by_lookup.token_ids == plain,
                "draft_acceptance": by_draft.spec.acceptance_rate,
                "lookup_acceptance": by_lookup.spec.acceptance_rate}
            check(f"{fmt}: tokens", len(plain) == tokens)
            check(f"{fmt}: draft model", by_draft.token_ids == plain)
            check(f"{fmt}: prompt lookup", by_lookup.token_ids == plain)
        except Exception as exc:  # record and go on: one run on a lent device must tell everything
            report["formats"][fmt] = {"error": _error(exc)}
            check(f"{fmt}: {_error(exc)}", False)
        try:  # a GGUF file, its token embedding looked up in the file's blocks
            if not (folder / "target.gguf").is_file():
                raise RuntimeError("no GGUF file was written")
            from_gguf = load_model(folder / "target.gguf", device=str(device), weights=fmt)
            report["formats"][fmt]["gguf_equal"] = same = (
                generate(from_gguf, PROMPT, **run).token_ids
                == generate(from_gguf, PROMPT, draft="ngram", gamma=4, **run).token_ids)
            check(f"{fmt}: GGUF with prompt lookup", same)
        except Exception as exc:
            report["formats"][fmt]["gguf_error"] = _error(exc)
            check(f"{fmt} GGUF: {_error(exc)}", False)
        try:  # a mixture of experts, its experts in the same format
            moe = load_model(folder / "moe", device=str(device), weights=fmt)
            plain = generate(moe, PROMPT, **run).token_ids
            report["formats"][fmt]["moe_lookup_equal"] = same = (
                generate(moe, PROMPT, draft="ngram", gamma=4, **run).token_ids == plain)
            check(f"{fmt}: MoE with prompt lookup", same and len(plain) == tokens)
        except Exception as exc:
            report["formats"][fmt]["moe_error"] = _error(exc)
            check(f"{fmt} MoE: {_error(exc)}", False)

    try:
        target = load_model(target_path, device=str(device))
        draft = load_model(draft_path, device=str(device))
        sampled = dict(temperature=1.0, top_p=0.9, seed=7, **run)
        plain = [generate(target, PROMPT, **sampled).token_ids for _ in range(2)]
        by_draft = [generate(target, PROMPT, draft=draft, gamma=4, **sampled).token_ids for _ in range(2)]
        by_lookup = generate(target, PROMPT, draft="ngram", gamma=4, **sampled).token_ids
        vocab = target.config.vocab_size
        report["sampled"] = {"plain_repeats": plain[0] == plain[1], "draft_repeats": by_draft[0] == by_draft[1],
                             "lengths": [len(plain[0]), len(by_draft[0]), len(by_lookup)]}
        check("sampled: plain repeats under a seed", plain[0] == plain[1])
        check("sampled: draft model repeats under a seed", by_draft[0] == by_draft[1])
        check("sampled: every token in the vocabulary and every run full length",
              all(0 <= t < vocab for t in [*plain[0], *by_draft[0], *by_lookup])
              and [len(plain[0]), len(by_draft[0]), len(by_lookup)] == [tokens] * 3)
        if device.type != "cpu":
            on_cpu = generate(load_model(target_path, device="cpu"), PROMPT, **run).token_ids
            on_device = generate(target, PROMPT, **run).token_ids
            shared = next((i for i, (a, b) in enumerate(zip(on_cpu, on_device)) if a != b), len(on_cpu))
            report["cpu_agreement"] = f"{shared}/{len(on_cpu)}"
    except Exception as exc:
        report["sampled"] = {"error": _error(exc)}
        check(f"sampled: {_error(exc)}", False)

    command = [sys.executable, "-c", "import sys; from verispec.cli import main; sys.exit(main())",
               "generate", "--model", str(target_path), "--draft", str(draft_path), "--device", device.type,
               "--max-tokens", "8", "--ignore-eos", "--json", PROMPT]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    report["cli"] = {"returncode": done.returncode, "output_tail": (done.stdout + done.stderr)[-600:]}
    check("command line", done.returncode == 0)
    report["ok"] = not report["failures"]
    return report


def _cell(cell: dict) -> str:
    predicted = f" ({cell['predicted']:.2f}x)" if cell["predicted"] is not None else ""
    return f"{cell['speedup']:.2f}x{predicted}"


def save(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tiny", action="store_true", help="toy sizes (for a CPU check of the script)")
    parser.add_argument("--max-m", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--no-engine-check", action="store_true", help="skip the engine check")
    parser.add_argument("--no-graphs", action="store_true", help="skip the graph-replayed timings")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    tokens = args.tokens or (12 if args.tiny else 128)
    sizes = list(range(1, args.max_m + 1))
    out = Path(args.out) if args.out else HERE / "results" / "gpu" / f"gpu_bench{'_tiny' if args.tiny else ''}.json"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "dtype": args.dtype,
               "tiny": args.tiny, "models": {}}

    check = {"ok": True}
    if not args.no_engine_check:
        started = time.perf_counter()
        results["engine_check"] = check = engine_check(device)
        print(f"engine check on {name} ({time.perf_counter() - started:.0f} s): "
              + ("every check passed" if check["ok"] else "FAILED: " + "; ".join(check["failures"])), flush=True)
        if "cpu_agreement" in check:
            print(f"  float32 greedy tokens shared with the CPU: {check['cpu_agreement']}")
        save(results, out)

    bandwidth = read_bandwidth(device, (64 << 20) if args.tiny else (4 << 30))
    results["read_bandwidth"] = bandwidth
    print(f"device {name}: read bandwidth {bandwidth / 1e9:.0f} GB/s; {args.dtype}"
          f"{', toy sizes' if args.tiny else ''}; torch {torch.__version__}", flush=True)
    for model_name in args.models:
        started = time.perf_counter()
        loaded = build(model_name, device, dtype, args.tiny)
        context = 16 if args.tiny else 128
        costs, step_bytes = verify_costs(loaded.model, device, context, sizes, rounds=2 if args.tiny else 5)
        t1 = costs[1]
        r = {m: costs[m] / t1 for m in sizes}
        entry = results["models"][model_name] = {"step_s": t1, "step_bytes": step_bytes,
                                                 "utilisation": step_bytes / t1 / bandwidth, "r": r}
        print(f"\n{model_name}: eager step {t1 * 1e3:.2f} ms reading {step_bytes / 1e9:.2f} GB "
              f"-> {step_bytes / t1 / 1e9:.0f} GB/s = {entry['utilisation']:.0%} of read bandwidth", flush=True)
        print("  r(m), eager: " + " ".join(f"{m}:{r[m]:.2f}" for m in sizes), flush=True)
        try:
            if args.no_graphs:
                raise RuntimeError("skipped (--no-graphs)")
            graph = graph_costs(loaded.model, device, context, sizes)
            entry.update(graph_step_s=graph[1], graph_utilisation=step_bytes / graph[1] / bandwidth,
                         graph_r={m: graph[m] / graph[1] for m in sizes})
            print(f"  graph-replayed step {graph[1] * 1e3:.2f} ms -> {step_bytes / graph[1] / 1e9:.0f} GB/s = "
                  f"{entry['graph_utilisation']:.0%} of read bandwidth; the eager step takes "
                  f"{t1 / graph[1]:.2f}x as long", flush=True)
            print("  r(m), graph-replayed: " + " ".join(f"{m}:{entry['graph_r'][m]:.2f}" for m in sizes))
        except Exception as exc:
            entry["graph_error"] = _error(exc)
            print(f"  no graph-replayed timings: {entry['graph_error']}", flush=True)
        save(results, out)
        entry.update(speculative_grid(loaded, device, 16 if args.tiny else 64, tokens, r))
        print(f"  plain decoding {entry['plain_tok_s']:.1f} tok/s; speed-up under synthetic acceptance, "
              f"measured (cost model from eager r):")
        print("         " + "".join(f"{f'γ={g}':>17}" for g in GAMMAS))
        for alpha in ALPHAS:
            cells = [entry["grid"][f"a={alpha},g={g}"] for g in GAMMAS]
            print(f"  α={alpha:.1f}: " + "".join(f"{_cell(c):>17}" for c in cells)
                  + ("" if all(c["valid"] for c in cells) else "  INVALID: first difference at token "
                     + ", ".join(str(c["first_difference"]) for c in cells)))
            print("    per round, ms (verify + draft): " + "  ".join(
                f"{c['decode_s'] / c['rounds'] * 1e3:.1f} ({c['verify_s'] / c['rounds'] * 1e3:.1f} + "
                f"{c['draft_s'] / c['rounds'] * 1e3:.1f})" for c in cells))
        entry["seconds"] = time.perf_counter() - started
        save(results, out)
        del loaded
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"\nwrote {out}")
    valid = all(c["valid"] for m in results["models"].values() for c in m["grid"].values())
    return 0 if valid and check["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
