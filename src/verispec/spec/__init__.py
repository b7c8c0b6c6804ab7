"""Speculative decoding: proposers draft, the verifier decides, policies choose γ."""
