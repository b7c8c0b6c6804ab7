"""The AMX trial: int4 panel products over several rows on Intel AMX tiles, against AVX-512 VNNI.

    python benchmarks/amx_products.py      # builds benchmarks/variants/amx_int4_tiles.patch

The trial (not part of the kernels) multiplies each group of 32 inputs on AMX (`tdpbsud`: R
rows of int8 activations by the group's nibbles unpacked to bytes) and keeps the AVX-512
tiles' float work per group, so its rows have the same bits as one-row products. This
builds it as its own module (as stack_ab.py builds a variant), checks that both ways give
bit-identical outputs, and times them on the 1.5B's shapes with random weights, one thread,
as nanoseconds per panel and group of 32 inputs (a panel: 16 output columns). It needs a
processor with AMX, and Linux's permission for the tiles' state.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import verispec  # noqa: F401  (first: it sets how torch's threads wait)
import torch

from perf_common import has_amx, machine_load, median, processor, save, warn_if_busy
from stack_ab import build_variant, patched

PATCH = Path(__file__).resolve().parent / "variants" / "amx_int4_tiles.patch"
SHAPES = {"o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}  # (n, k)
ROWS = (1, 2, 5, 9, 16, 17, 33)


def per_group(kernels, x, panels, n: int, k: int, repeats: int) -> float:
    kernels.linear_int4_panels(x, panels, None, None)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        kernels.linear_int4_panels(x, panels, None, None)
        times.append(time.perf_counter() - started)
    return median(times) * 1e9 / (n // 16 * k // 32)


def main() -> int:
    if not has_amx():
        print("this processor has no AMX tiles")
        return 1
    with tempfile.TemporaryDirectory() as scratch:
        kernels, _ = build_variant(patched(PATCH, Path(scratch)))
    if not kernels.amx_available():
        print("Linux did not grant this process the AMX tiles' state")
        return 1
    torch.set_num_threads(1)
    print(f"AMX trial: {processor()['name']}, 1 thread, {machine_load()}")
    warn_if_busy()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        scales = (torch.randn(n, k // 32, 2, generator=gen) * 0.01).half()
        panels = kernels.int4_to_panels(q, scales)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen)
            outputs, ns = {}, {}
            for way, on in (("avx512", False), ("amx", True)):
                kernels.set_amx(on)
                outputs[way] = kernels.linear_int4_panels(x, panels, None, None)
                ns[way] = per_group(kernels, x, panels, n, k, repeats=40 if n * k < 1e7 else 10)
            if not torch.equal(outputs["avx512"], outputs["amx"]):
                raise SystemExit(f"{name}, m = {m}: AMX and AVX-512 outputs differ")
            print(f"  {name:>7} {n}x{k}, m = {m:>2}: AVX-512 {ns['avx512']:5.1f} ns, AMX {ns['amx']:5.1f} ns "
                  f"per panel and group ({ns['avx512'] / ns['amx']:.2f}x as fast)")
            rows.append({"product": name, "n": n, "k": k, "m": m, "ns_per_panel_group": ns})
    kernels.set_amx(True)
    save("amx_products", {"patch": PATCH.name, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
