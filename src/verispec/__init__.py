"""verispec: speculative decoding that never changes the answer."""

__version__ = "0.1.0"
