"""Target 2: how often each weight format picks the same greedy token as float32.

    python benchmarks/agreement.py            # the demo pair, 10 Spec-Bench prompts x 64 tokens
    python benchmarks/agreement.py --quick    # the 0.5B draft, 3 prompts x 16 tokens

Two figures per format, both against float32's greedy output:
  same next token   the format's argmax at each of the 640 positions, fed float32's own
                    tokens before it (teacher forcing: one disagreement does not spoil the rest)
  same text         how many of the 10 free-running outputs are identical to float32's,
                    and the mean length of the identical prefix
"""

from __future__ import annotations

import argparse
import sys

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import free, machine_load, save, verdict

FORMATS = ("bfloat16", "int8", "int4", "int4-mixed")


@torch.inference_mode()
def next_token_agreement(model, prompt_ids: list[int], reference: list[int]) -> int:
    """How many of reference's tokens the model predicts, given the prompt and reference before each."""
    cache = model.new_cache(len(prompt_ids) + len(reference) + 1)
    logits = model(torch.tensor([prompt_ids + reference[:-1]]), cache)[0, len(prompt_ids) - 1:]
    return int((logits.argmax(-1) == torch.tensor(reference)).sum())


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None)
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    models = args.models or (["qwen2.5-coder-0.5b"] if args.quick else ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
    count = args.prompts or (3 if args.quick else 10)
    tokens = args.tokens or (16 if args.quick else 64)

    from verispec.generate import encode_prompt, generate
    from verispec.lab.prompts import load_prompts
    from verispec.loading import load_model

    prompts = load_prompts("spec-bench", limit=count)
    print(f"greedy agreement with float32: {count} prompts x {tokens} tokens, {machine_load()}")
    record = {}
    for name in models:
        reference_model = load_model(name, "float32", weights="float32")
        cases = []
        for prompt in prompts:
            ids = encode_prompt(reference_model.tokenizer, prompt.text, chat=True)
            cases.append((ids, generate(reference_model, ids, max_tokens=tokens, ignore_eos=True).token_ids))
        free(reference_model)
        for fmt in args.formats:
            loaded = load_model(name, "bfloat16" if fmt == "bfloat16" else "float32", weights=fmt)
            agree = sum(next_token_agreement(loaded.model, ids, ref) for ids, ref in cases)
            outputs = [generate(loaded, ids, max_tokens=tokens, ignore_eos=True).token_ids for ids, _ in cases]
            identical = sum(out == ref for out, (_, ref) in zip(outputs, cases))
            prefix = sum(common_prefix(out, ref) for out, (_, ref) in zip(outputs, cases)) / len(cases)
            total = sum(len(ref) for _, ref in cases)
            record[f"{name}/{fmt}"] = {"next_token": agree / total, "identical": identical, "prefix": prefix}
            print(verdict(f"2 agreement, {name} {fmt}",
                          f"same next token {agree}/{total} = {agree / total:.1%}; "
                          f"identical outputs {identical}/{len(cases)}, mean identical prefix {prefix:.1f} tokens",
                          None))
            free(loaded)
    save("agreement" + ("_quick" if args.quick else "") + ("" if args.formats == list(FORMATS) else "_" + "_".join(args.formats)),
         {"prompts": count, "tokens": tokens, "results": record})
    return 0


if __name__ == "__main__":
    sys.exit(main())
