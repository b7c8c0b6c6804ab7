"""`verispec serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import socket

from verispec.commands.options import add_draft_vocab_option, add_model_options, load_target_and_draft, positive_int
from verispec.errors import VerispecError


def register(sub) -> None:
    parser = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                            description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
                                        "/metrics (Prometheus). Requests are decoded one at a time.")
    add_model_options(parser)
    add_draft_vocab_option(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=port_number, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="the model name responses and /v1/models report (default: the model's own name)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.set_defaults(func=run)


def port_number(text: str) -> int:
    import argparse

    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number up to 65535, got {value}")
    return value


def check_port_free(host: str, port: int) -> None:
    """Fail before loading gigabytes of weights if the address cannot be listened on."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        raise VerispecError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def run(args) -> int:
    import uvicorn

    from verispec.server import create_app

    check_port_free(args.host, args.port)
    target, draft = load_target_and_draft(args)
    app = create_app(target, draft=draft, gamma=args.gamma, adaptive=args.adaptive, ngram=tuple(args.ngram),
                     served_model_name=args.served_model_name, draft_vocab=args.draft_vocab,
                     lookup=not args.no_lookup)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
