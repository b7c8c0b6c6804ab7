"""Target 7: framework overhead, the time of one decoding step when the weights cost nothing.

    python benchmarks/overhead.py [--quick]

A 2-layer model with hidden size 64 reads a few kilobytes of weights, so its step time is
what the engine itself costs per step: Python, dispatch, allocation, kernel launches.
Measured for the plain PyTorch forward and for the packed fast path, on one thread (more
threads only add wake-up cost at this size).

Also the greedy choice every step, verification and draft step makes: the argmax of one row
of Qwen2.5's 151,936 logits, by torch.argmax and by verispec's `greedy_tokens` (NumPy),
taking turns, at the usual thread count; the draw of a sampled token from those
probabilities, by torch.multinomial and by verispec's `sample` (an inverse-CDF search); and
the warp that makes probabilities of logits (temperature, top-p, top-k), by torch's
operations and by verispec's CPU path (the compiled kernel's softmax where no top-k applies,
top-p sorting only the ids that hold its mass), and by that path with the kernels off (the
softmax in NumPy's operations).

And the log-probabilities a request may ask for with each token (`token_logprob`: the
target's log-softmax at the token and its likeliest ids), against torch's log_softmax and
topk on the same row.

And the text every token adds to a streamed output (`TextAssembler`, with a byte-level
tokenizer): its cost per token at 256 and at 4,096 tokens of output, against one decode
of the whole 4,096-token output (what each token would cost if the whole output were
decoded again every time).

And prompt lookup's cost per round at 256 and at 4,096 tokens of context without a repeated
n-gram (its worst case), against scanning the 4,096-token context back once per n-gram size
(what each round cost before the lookup kept an index).
"""

from __future__ import annotations

import argparse
import sys
import time

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import machine_load, median, save, verdict, warn_if_busy


def tiny_model(layers: int = 2):
    from verispec.config import ModelConfig
    from verispec.models import build_model

    config = ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         attention_bias=True, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = build_model(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model


@torch.inference_mode()
def step_time(model, steps: int, rounds: int = 5) -> float:
    """Median over rounds of the mean time of one single-token step at ~100 cached positions."""
    cache = model.new_cache(100 + steps * (rounds + 1) + 1)
    model(torch.arange(100).view(1, -1) % 512, cache)
    token = torch.tensor([[7]])
    results = []
    for round_index in range(rounds + 1):
        started = time.perf_counter()
        for _ in range(steps):
            model(token, cache)
        if round_index:
            results.append((time.perf_counter() - started) / steps)
    return median(results)


def argmax_times(vocab: int = 151_936, calls: int = 200, rounds: int = 5) -> dict[str, float]:
    """Median over rounds of the mean seconds per row: torch.argmax against greedy_tokens."""
    from verispec.sampling import greedy_tokens

    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0))
    ways = {"torch.argmax": lambda: logits.argmax(-1).tolist(), "greedy_tokens": lambda: greedy_tokens(logits)}
    return taking_turns(ways, calls, rounds)


def draw_times(vocab: int = 151_936, calls: int = 200, rounds: int = 5) -> dict[str, float]:
    """Median over rounds of the mean seconds per draw of one token from a row of probabilities
    (random logits at temperature 0.7): torch.multinomial against verispec's sample()."""
    from verispec.sampling import SamplingParams, probabilities, sample

    generator = torch.Generator().manual_seed(0)
    probs = probabilities(3 * torch.randn(vocab, generator=generator), SamplingParams(temperature=0.7))
    ways = {"torch.multinomial": lambda: int(torch.multinomial(probs, 1, generator=generator)),
            "sample": lambda: sample(probs, generator)}
    return taking_turns(ways, calls, rounds)


def zipf_logits(vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Logits of a language model's usual shape: probability falling as rank^-1.1 (Zipf's law),
    the ranks shuffled over the ids."""
    ranks = torch.randperm(vocab, generator=generator).double() + 1
    return (-1.1 * ranks.log()).float()


WARPS = {"temperature 0.7": ({"temperature": 0.7}, "zipf"),
         "top-p 0.95": ({"temperature": 0.7, "top_p": 0.95}, "zipf"),
         "top-p 0.95, flat logits": ({"temperature": 0.7, "top_p": 0.95}, "normal"),
         "top-k 50": ({"temperature": 0.7, "top_k": 50}, "zipf")}


def warp_times(vocab: int = 151_936, calls: int = 50, rounds: int = 5) -> dict[str, dict[str, float]]:
    """Per warp of WARPS, the median over rounds of the mean seconds per row of the warp
    (sampling.probabilities) on one row of logits: torch's operations (the accelerator path),
    the CPU path ("cpu") and the CPU path with the kernels off ("numpy"). `zipf` logits have a
    nucleus of a few hundred ids; `normal` ones (3 times a standard normal) one of tens of
    thousands, where top-p's head search grows."""
    from verispec.sampling import SamplingParams, _warp_with_torch, probabilities

    generator = torch.Generator().manual_seed(0)
    shapes = {"zipf": zipf_logits(vocab, generator), "normal": 3 * torch.randn(vocab, generator=generator)}
    times = {}
    for name, (warp, shape) in WARPS.items():
        params, logits = SamplingParams(**warp), shapes[shape]
        times[name] = taking_turns({"torch": lambda: _warp_with_torch(logits, params),
                                    "cpu": lambda: probabilities(logits, params),
                                    "numpy": lambda: kernels_off(probabilities, logits, params)}, calls, rounds)
    return times


def logprob_times(vocab: int = 151_936, calls: int = 50, rounds: int = 5) -> dict[str, float]:
    """Median over rounds of the mean seconds per token of its log-probabilities with 0, 5 and
    20 alternatives, and of torch's log_softmax and topk(5) on the same row of Zipf logits."""
    from verispec.sampling import token_logprob

    logits = zipf_logits(vocab, torch.Generator().manual_seed(0))
    ways = {f"top {k}": (lambda k=k: token_logprob(logits, 7, k)) for k in (0, 5, 20)}
    ways["torch"] = lambda: torch.log_softmax(logits, -1).topk(5, -1)
    return taking_turns(ways, calls, rounds)


def kernels_off(function, *args):
    """function(*args) with verispec's compiled CPU kernels switched off."""
    from verispec import kernels

    with kernels.switched_off():
        return function(*args)


def taking_turns(ways: dict, calls: int, rounds: int) -> dict[str, float]:
    """Median over rounds of the mean seconds per call of each way, the ways taking turns."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for round_index in range(rounds + 1):
        for name, way in ways.items():
            started = time.perf_counter()
            for _ in range(calls):
                way()
            if round_index:  # the first round warms up
                times[name].append((time.perf_counter() - started) / calls)
    return {name: median(t) for name, t in times.items()}


def byte_tokenizer():
    """Byte-level BPE with no merges: one token per byte, as text in the worst case."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def text_times(lengths=(256, 4096), rounds: int = 5) -> dict[str, float]:
    """Median seconds per token of TextAssembler.add over outputs of each length, and of
    one decode of the longest output."""
    from verispec.generate import TextAssembler

    tok = byte_tokenizer()
    ids = tok.encode("def merge(a, b):\n    return sorted(a + b)  # naïve 😀\n" * (max(lengths) // 40 + 1)).ids
    times: dict[str, list[float]] = {}
    for round_index in range(rounds + 1):
        for n in lengths:
            text = TextAssembler(tok, ["<|stop|>"])
            started = time.perf_counter()
            for token_id in ids[:n]:
                text.add(token_id)
            times.setdefault(f"add@{n}", []).append((time.perf_counter() - started) / n)
        started = time.perf_counter()
        tok.decode(ids[:max(lengths)])
        times.setdefault(f"whole@{max(lengths)}", []).append(time.perf_counter() - started)
    return {name: median(t[1:]) for name, t in times.items()}


def lookup_times(lengths=(256, 4096), rounds: int = 5, calls: int = 50) -> dict[str, float]:
    """Median seconds per prompt-lookup round at each context length (no n-gram repeats), and
    of one backward scan of the longest context for n = 3, 2, 1."""
    from verispec.spec.prompt_lookup import PromptLookupProposer

    times: dict[str, list[float]] = {}
    for round_index in range(rounds + 1):
        for n in lengths:
            lookup = PromptLookupProposer()
            context = list(range(n))
            lookup.lookup(context, 4)
            started = time.perf_counter()
            for i in range(calls):
                context.append(1_000_000 + i)
                lookup.lookup(context, 4)
            times.setdefault(f"round@{n}", []).append((time.perf_counter() - started) / calls)
        context = list(range(max(lengths)))
        started = time.perf_counter()
        for size in (3, 2, 1):
            suffix = context[len(context) - size:]
            for start in range(len(context) - size - 1, -1, -1):
                if context[start:start + size] == suffix:
                    break
        times.setdefault(f"scan@{max(lengths)}", []).append(time.perf_counter() - started)
    return {name: median(t[1:]) for name, t in times.items()}


def embedding_times(rows: int = 8192, hidden: int = 1536, calls: int = 200, rounds: int = 5) -> dict[str, float]:
    """Median seconds to look one token up in an embedding kept in GGUF Q4_K blocks (the
    1.5B demo model's width): a token not met before (decoded by gguf) and one met before."""
    import numpy as np
    from gguf import GGMLQuantizationType

    from verispec.quant import GgufEmbedding

    blocks = np.random.default_rng(0).integers(0, 256, size=(rows, hidden // 256, 144), dtype=np.uint8)
    blocks[..., :4] = np.full((rows, hidden // 256, 2), 0.01, np.float16).view(np.uint8)  # d and dmin
    blocks = blocks.reshape(rows, -1)
    times: dict[str, list[float]] = {}
    for _ in range(rounds + 1):
        embedding = GgufEmbedding(torch.from_numpy(blocks), int(GGMLQuantizationType.Q4_K), torch.float32)
        started = time.perf_counter()
        for i in range(calls):
            embedding(torch.tensor([[i]]))
        times.setdefault("new", []).append((time.perf_counter() - started) / calls)
        started = time.perf_counter()
        for i in range(calls):
            embedding(torch.tensor([[i % 16]]))
        times.setdefault("seen", []).append((time.perf_counter() - started) / calls)
    return {name: median(t[1:]) for name, t in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from verispec.quant import quantize_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    print(f"framework overhead: 2-layer tiny model, 1 thread, {machine_load()}")
    warn_if_busy()
    steps = 50 if args.quick else 300
    plain = step_time(tiny_model(), steps)
    fast_model = quantize_model(tiny_model(), "float32")
    fast = step_time(fast_model, steps) if fast_model.fast_path is not None else float("nan")
    print(f"  plain PyTorch forward: {plain * 1e3:.3f} ms/step")
    print(f"  packed fast path:      {fast * 1e3:.3f} ms/step")
    met = fast < 1e-3
    print(verdict("7 framework overhead", f"{fast * 1e3:.3f} ms per step (< 1 ms)", met))
    torch.set_num_threads(threads)
    argmax = argmax_times(calls=50 if args.quick else 200)
    print(f"  greedy choice over 151,936 logits, {threads} threads: torch.argmax {argmax['torch.argmax'] * 1e6:.1f} µs, "
          f"greedy_tokens {argmax['greedy_tokens'] * 1e6:.1f} µs "
          f"({argmax['torch.argmax'] / argmax['greedy_tokens']:.1f}x less)")
    draws = {vocab: draw_times(vocab, calls=50 if args.quick else 200) for vocab in (151_936, 32_768)}
    for vocab, draw in draws.items():
        print(f"  sampled token from {vocab:,} probabilities, {threads} threads: torch.multinomial "
              f"{draw['torch.multinomial'] * 1e6:.1f} µs, sample {draw['sample'] * 1e6:.1f} µs "
              f"({draw['torch.multinomial'] / draw['sample']:.1f}x less)")
    warps = warp_times(calls=10 if args.quick else 50, rounds=2 if args.quick else 5)
    for name, warp in warps.items():
        print(f"  warp of 151,936 logits, {name}, {threads} threads: torch {warp['torch'] * 1e6:.1f} µs, "
              f"verispec {warp['cpu'] * 1e6:.1f} µs ({warp['torch'] / warp['cpu']:.1f}x less; "
              f"{warp['numpy'] * 1e6:.1f} µs with the kernels off)")
    logprobs = logprob_times(calls=10 if args.quick else 50, rounds=2 if args.quick else 5)
    print(f"  log-probabilities of one token over 151,936 logits, {threads} threads: "
          + ", ".join(f"{name} {logprobs[name] * 1e6:.1f} µs" for name in ("top 0", "top 5", "top 20"))
          + f" (torch's log_softmax and topk(5): {logprobs['torch'] * 1e6:.1f} µs)")
    text = text_times(rounds=2 if args.quick else 5)
    print(f"  streamed text per token: {text['add@256'] * 1e6:.1f} µs at 256 tokens, {text['add@4096'] * 1e6:.1f} µs "
          f"at 4,096; decoding the whole 4,096-token output once: {text['whole@4096'] * 1e6:.1f} µs")
    lookup = lookup_times(rounds=2 if args.quick else 5)
    print(f"  prompt lookup per round: {lookup['round@256'] * 1e6:.1f} µs at 256 tokens of context, "
          f"{lookup['round@4096'] * 1e6:.1f} µs at 4,096; scanning the 4,096 tokens back: "
          f"{lookup['scan@4096'] * 1e6:.1f} µs")
    embedding = embedding_times(calls=50 if args.quick else 200, rounds=2 if args.quick else 5)
    print(f"  token embedding in GGUF Q4_K blocks, one token: {embedding['new'] * 1e6:.1f} µs not met before, "
          f"{embedding['seen'] * 1e6:.1f} µs met before ({embedding['new'] / embedding['seen']:.1f}x less)")
    save("overhead" + ("_quick" if args.quick else ""),
         {"plain_s": plain, "fast_s": fast, "argmax_s": argmax, "draw_s": draws, "warp_s": warps,
          "logprob_s": logprobs, "text_s": text,
          "lookup_s": lookup, "embedding_s": embedding})
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
