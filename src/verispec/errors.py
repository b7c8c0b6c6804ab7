"""User-facing errors: the CLI and server print these as one clear message, no traceback."""


class VerispecError(Exception):
    """A mistake in the user's input or environment, explained in the message."""


class ModelNotFoundError(VerispecError):
    pass


class UnsupportedArchitectureError(VerispecError):
    pass


class CorruptModelError(VerispecError):
    pass


class ContextOverflowError(VerispecError):
    pass


class TokenizerMismatchError(VerispecError):
    pass


class RollbackError(VerispecError):
    """State that cannot be rolled back was asked to roll back."""
