"""verispec: speculative decoding that never changes the answer.

    from verispec.loading import load_model
    from verispec.generate import generate, stream
"""

__version__ = "0.1.0"
