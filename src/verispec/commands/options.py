"""Option types and shared option groups for the command line."""

from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def finite_float(text: str) -> float:
    """A real number; nan and inf are refused here, before they reach arithmetic that would spread them."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def id_and_amount(text: str) -> tuple[int, float]:
    """ID=AMOUNT, as --logit-bias takes it: 13=-100 rules token id 13 out."""
    token, sep, amount = text.partition("=")
    if not sep or not token.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=AMOUNT (as 13=-100), got {text!r}")
    return int(token), finite_float(amount)


def json_schema(text: str) -> dict:
    """A JSON schema, as --json-schema takes it: the JSON itself, or a file that holds it."""
    import json
    from pathlib import Path

    path = Path(text).expanduser()
    try:
        source = path.read_text(encoding="utf-8") if path.is_file() else text
        schema = json.loads(source)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON schema or a file holding one ({exc})") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError("a JSON schema is a JSON object, as {\"type\": \"object\"}")
    return schema


def grammar(text: str) -> str:
    """A Lark grammar, as --grammar takes it: the grammar itself, or a file that holds it."""
    from pathlib import Path

    path = Path(text).expanduser()
    try:
        return path.read_text(encoding="utf-8") if path.is_file() else text
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"could not read the grammar file ({exc})") from None


def non_negative_float(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def probability(text: str) -> float:
    value = non_negative_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {value}")
    return value


WEIGHT_FORMATS = ["float32", "bfloat16", "float16", "int8", "int4", "int4-mixed"]


def add_slack_option(parser: argparse.ArgumentParser) -> None:
    """--slack for the commands that audit: how far timing noise may exceed a physical bound."""
    from verispec.lab.audit import DEFAULT_SLACK

    parser.add_argument("--slack", type=probability, default=DEFAULT_SLACK,
                        help="timing noise allowed above a physical bound before a result is IMPOSSIBLE")


class _NgramSizes(argparse.Action):
    """--ngram MAX MIN, refused when parsed if MIN > MAX (prompt lookup would refuse it later)."""

    def __call__(self, parser, namespace, values, option_string=None):
        longest, shortest = values
        if shortest > longest:
            parser.error(f"argument {option_string}: takes MAX then MIN, with MIN <= MAX; got {longest} {shortest}")
        setattr(namespace, self.dest, (longest, shortest))


def add_ngram_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ngram", type=positive_int, nargs=2, metavar=("MAX", "MIN"), default=(3, 1),
                        action=_NgramSizes, help="n-gram sizes tried by prompt lookup, longest first")


def draft_length(text: str) -> int:
    """γ for the command line: 1..MAX_GAMMA (0 would draft nothing and only look speculative)."""
    from verispec.generate import MAX_GAMMA

    value = positive_int(text)
    if value > MAX_GAMMA:
        raise argparse.ArgumentTypeError(f"expected a number from 1 to {MAX_GAMMA}, got {value}")
    return value


def add_model_options(parser: argparse.ArgumentParser, draft: bool = True) -> None:
    parser.add_argument("--model", "-m", required=True,
                        help="target model: a demo name (see `verispec models`), a GGUF file or a HF folder")
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default=None,
                        help="weight format of the target (default: float32 on CPU)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: all cores)")
    add_kv_cache_option(parser)
    if draft:
        parser.add_argument("--draft", "-d", default=None,
                            help="draft model (name or path), or 'ngram' for prompt lookup")
        parser.add_argument("--draft-weights", choices=WEIGHT_FORMATS, default=None,
                            help="weight format of the draft model (default: the target's --weights)")
        parser.add_argument("--gamma", "-g", type=draft_length, default=4,
                            help="tokens drafted per round")
        parser.add_argument("--adaptive", nargs="?", const="cost", choices=["cost", "heuristic"], default=False,
                            help="choose γ each round: 'cost' (default; from measured acceptance and costs, "
                                 "falls back to plain decoding, and with a draft model sends prompt lookup's "
                                 "drafts instead where they promise more) or 'heuristic' (+2 on full accept, "
                                 "-1 otherwise)")
        parser.add_argument("--no-lookup", action="store_true",
                            help="with --adaptive and a draft model, never send prompt lookup's drafts in the "
                                 "draft model's place")
        add_ngram_option(parser)


def add_kv_cache_option(parser: argparse.ArgumentParser) -> None:
    from verispec.cache import CACHE_DTYPES

    parser.add_argument("--kv-cache", choices=list(CACHE_DTYPES), default=None,
                        help="the type the target's and the draft's caches keep keys and values in (default: "
                             "the activations' type); 16 bits halve the cache and speed up attention over "
                             "long contexts, and round every key and value")


def add_draft_vocab_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft-vocab", type=draft_vocab_choice, default="auto", metavar="N",
                        help="the draft model proposes only the first N token ids and those of the context "
                             "(prompt and answer so far), and its output layer computes only theirs (cheaper "
                             "drafts, a few fewer accepted; the output is unchanged). 'auto' (default): 32768 "
                             "for a vocabulary of more than 65536 ids, else all; 'all': the whole vocabulary")


def draft_vocab_choice(text: str) -> int | str | None:
    """A draft vocabulary: 'auto', 'all' (None) or a number of first token ids."""
    if text in ("auto", "all"):
        return None if text == "all" else text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a number of token ids, 'auto' or 'all', got {text!r}") from None


def default_dtype(device: str, weights: str | None) -> str:
    """Activation dtype: the weight format's own float type, else float32 on CPU, bfloat16 on GPU."""
    if weights in ("bfloat16", "float16", "float32"):
        return weights
    return "bfloat16" if device.startswith("cuda") else "float32"


def check_draft_options(args) -> None:
    """Options that only a draft gives a meaning to are refused without one, before any model
    loads, rather than ignored: a user who asked for them believes something else ran."""
    from verispec.errors import VerispecError

    draft = getattr(args, "draft", None)
    if getattr(args, "draft_weights", None) and draft in (None, "ngram"):
        raise VerispecError("--draft-weights sets a draft model's weight format, but "
                            + ("there is no --draft" if draft is None else "prompt lookup loads no model"))
    if getattr(args, "adaptive", False) and draft is None:
        raise VerispecError("--adaptive chooses how many tokens a draft proposes, but there is no --draft "
                            "(a draft model, or ngram for prompt lookup)")
    no_model = draft in (None, "ngram")
    if getattr(args, "no_lookup", False) and (no_model or getattr(args, "adaptive", False) != "cost"):
        raise VerispecError("--no-lookup keeps --adaptive's rounds to the draft model, but "
                            + ("there is no draft model" if no_model else "--adaptive cost is not on"))
    if getattr(args, "draft_vocab", "auto") != "auto" and no_model:
        raise VerispecError("--draft-vocab limits a draft model's vocabulary, but "
                            + ("there is no --draft" if draft is None else "prompt lookup has none"))


def load_target_and_draft(args) -> tuple:
    """Load --model (and --draft) with their formats, applying --threads first."""
    import torch

    from verispec.config import draft_format
    from verispec.loading import load_model

    check_draft_options(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    kv_cache = getattr(args, "kv_cache", None)
    target = load_model(args.model, default_dtype(args.device, args.weights), args.device, args.weights, kv_cache)
    draft = getattr(args, "draft", None)
    if draft and draft != "ngram":
        fmt = draft_format(args.weights, args.draft_weights)
        draft = load_model(draft, default_dtype(args.device, fmt), args.device, fmt, kv_cache)
    return target, draft
