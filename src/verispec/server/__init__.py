"""The OpenAI-compatible HTTP server: `create_app(target, draft=...)` returns a FastAPI app."""

from verispec.server.app import create_app

__all__ = ["create_app"]
