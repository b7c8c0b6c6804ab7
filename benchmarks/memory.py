"""Resident memory of a loaded model against the bytes of the tensors it holds, per format.

    python benchmarks/memory.py                          # the three demo models, every format
    python benchmarks/memory.py --models qwen2.5-coder-0.5b --formats float32
    python benchmarks/memory.py --fresh      # decode the GGUF files instead of using the weight cache

Each model loads in a fresh process and decodes a few tokens, so that every layer has
switched to the layout its kernel reads. The process then reports its resident set
(VmRSS) above what it was before loading, its peak while loading (VmHWM, including the
pages of the file it read), and the distinct tensors the model holds. A
model should hold each weight once: resident / held near 1 (the rest is the KV cache, the
tokenizer, and allocator slack). `weights read per step` is what a decoding step streams:
the models also hold their embedding, a lookup table kept in the GGUF file's own blocks
where the output layer has weights of its own, so they hold a little more than they read.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from perf_common import save

MODELS = ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "smollm2-135m")  # SmolLM2 ties its output layer
FORMATS = ("float32", "bfloat16", "int8", "int4")


def resident_bytes(field: str = "VmRSS") -> int:
    """This process's resident set (VmRSS), or its peak so far (VmHWM), in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(model_name: str, fmt: str) -> dict:
    """Load, decode 8 tokens, and count; run in a process of its own."""
    import verispec  # noqa: F401
    import torch

    from verispec.generate import generate
    from verispec.loading import load_model

    before = resident_bytes()
    loaded = load_model(model_name, "bfloat16" if fmt == "bfloat16" else "float32", weights=fmt)
    peak = resident_bytes("VmHWM") - before
    generate(loaded, "def add(a, b):", max_tokens=8, ignore_eos=True)
    model = loaded.model
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for name, t in list(model.named_parameters()) + list(model.named_buffers()) if "rope" not in name}
    return {"model": model_name, "format": fmt, "resident": resident_bytes() - before, "peak_loading": peak,
            "held": sum(held.values()), "read_per_step": loaded.weight_bytes(), "torch": torch.__version__}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--formats", nargs="+", default=list(FORMATS))
    parser.add_argument("--fresh", action="store_true", help="load without the weight cache (VERISPEC_WEIGHT_CACHE=0)")
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "FORMAT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one)))
        return 0
    print("memory: resident set after loading and decoding, against the tensors the model holds"
          + (" (decoded from the files, no weight cache)" if args.fresh else ""))
    env = {**os.environ, "VERISPEC_WEIGHT_CACHE": "0"} if args.fresh else None
    rows = []
    for model_name in args.models:
        for fmt in args.formats:
            done = subprocess.run([sys.executable, __file__, "--one", model_name, fmt],
                                  capture_output=True, text=True, env=env)
            if done.returncode != 0:
                print(f"  {model_name} {fmt}: failed\n{done.stderr.strip()[-2000:]}")
                return 1
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"  {model_name:>20} {fmt:>8}: peak while loading {row['peak_loading'] / 1e9:5.2f} GB, "
                  f"resident {row['resident'] / 1e9:5.2f} GB, holds "
                  f"{row['held'] / 1e9:5.2f} GB of tensors (resident / held {row['resident'] / row['held']:.2f}), "
                  f"weights read per step {row['read_per_step'] / 1e9:5.2f} GB")
    save("memory_fresh" if args.fresh else "memory", {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
