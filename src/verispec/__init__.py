"""verispec: speculative decoding that never changes the answer.

    from verispec.loading import load_model
    from verispec.generate import generate, stream
"""

import os
import sys
import warnings

__version__ = "0.1.0"

# After each of torch's own parallel operations (an argmax over the vocabulary, say), its
# OpenMP threads spin for a while, holding the core that verispec's kernel threads need for
# the very next pass: on two cores a draft step right after one ran a third slower. Passive
# waiting puts them to sleep at once. OpenMP reads this when torch is first imported.
if "OMP_WAIT_POLICY" not in os.environ:
    if "torch" in sys.modules:
        warnings.warn("torch was imported before verispec, so its threads keep spinning between operations "
                      "and decoding runs slower; import verispec first or set OMP_WAIT_POLICY=PASSIVE",
                      stacklevel=2)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

# Decoding streams gigabytes of weights per second; with 4 KB pages every few kilobytes
# cost a TLB miss, and the weight kernels read 2 MB pages 1.06-1.24x as fast (two threads,
# benchmarks/weight_streams.py). PyTorch asks the kernel for transparent huge pages on its
# large CPU buffers when this is set (Linux only, and only where THP is "madvise" or "always").
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
