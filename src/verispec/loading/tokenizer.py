"""Tokenizers from a Hugging Face folder or a GGUF file, with the chat template they carry."""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from verispec.errors import CorruptModelError, VerispecError


class ChatTemplateError(VerispecError):
    """A chat template that does not parse, or that refuses the messages (raise_exception)."""


class InfillError(VerispecError):
    """A suffix (fill in the middle) for a model whose tokenizer has no tokens for it."""


# The special tokens that frame a fill-in-the-middle prompt, by model family, in the order
# prefix, suffix, middle: the model reads the text before and after the gap, then writes
# the gap. Qwen2.5-Coder and Qwen3-Coder; StarCoder and the models that took its
# tokenizer; DeepSeek-Coder.
INFILL_MARKS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"),
)
# What a model writes when the gap is filled, besides its end-of-text token: an instruct
# model's end-of-text is the end of a chat turn, and its pretraining ended a middle with
# the document's end, padding or the start of the next file.
INFILL_ENDS = ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<fim_pad>", "<file_sep>",
               "<|EOT|>")


class Tokenizer:
    def __init__(self, backend: BackendTokenizer, eos_ids: set[int], bos_token: str | None = None,
                 eos_token: str | None = None, chat_template: str | None = None,
                 add_bos: bool = False, bos_id: int | None = None):
        self.backend = backend
        self.eos_ids = set(eos_ids)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.bos_id = bos_id

    # -- ids and text
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of text one token stands for, which may be part of a character (a
        byte-level BPE token, or a SentencePiece byte such as <0xE4>); special tokens are
        their own text. Decoding a lone token would give U+FFFD for a partial character."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode()
        if self._byte_level:
            try:
                return bytes(BYTE_LEVEL_CHARS[ch] for ch in piece)
            except KeyError:  # not in the byte alphabet: a token added as plain text
                return piece.encode()
        byte = SENTENCEPIECE_BYTE.fullmatch(piece)
        if byte:
            return bytes([int(byte[1], 16)])
        return piece.replace(SENTENCEPIECE_SPACE, " ").encode()

    # -- filling in the middle
    @cached_property
    def infill_marks(self) -> tuple[int, int, int] | None:
        """The ids of the prefix, suffix and middle marks, or None if the model has none."""
        for marks in INFILL_MARKS:
            ids = tuple(self.vocab.get(mark) for mark in marks)
            if None not in ids:
                return ids
        return None

    def encode_infill(self, prefix: str, suffix: str) -> list[int]:
        """The prompt that asks the model for the text between `prefix` and `suffix`."""
        if self.infill_marks is None:
            raise InfillError("this model's tokenizer has no fill-in-the-middle tokens (such as <|fim_prefix|>), "
                              "so it cannot take a suffix; use a code model trained to fill in the middle")
        before, after, middle = self.infill_marks
        ids = [before, *self.encode(prefix, add_special_tokens=False), after,
               *self.encode(suffix, add_special_tokens=False), middle]
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    @property
    def infill_end_ids(self) -> set[int]:
        """The ids that end a filled-in middle, the end-of-text ids among them."""
        return self.eos_ids | {self.vocab[t] for t in INFILL_ENDS if t in self.vocab}

    @property
    def special_ids(self) -> set[int]:
        """The ids of the tokens added to the vocabulary (special tokens among them), which
        stand for their own text, never for what their characters would encode to."""
        return self._added_ids

    @cached_property
    def _added_ids(self) -> set[int]:
        return set(self.backend.get_added_tokens_decoder())

    @cached_property
    def hidden_ids(self) -> set[int]:
        """The added ids that decoding leaves out of the text (the special ones, <|im_end|>
        say); the others (Qwen2.5's <tool_call>) are part of it."""
        return {i for i, token in self.backend.get_added_tokens_decoder().items() if token.special}

    @cached_property
    def _byte_level(self) -> bool:
        decoder = self.backend.decoder
        return decoder is not None and '"ByteLevel"' in decoder.__getstate__().decode()

    # -- chat
    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as the chat template writes it; `tools` (OpenAI's function
        definitions) go to templates that describe them to the model."""
        if not self.chat_template:
            raise VerispecError("this model has no chat template; run without --chat")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, indent=indent, ensure_ascii=False)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            template = env.from_string(self.chat_template)
            extra = {"tools": tools} if tools else {}
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        except TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template failed on these messages: {exc}") from None

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.encode(self.render_chat(messages, tools=tools), add_special_tokens=False)


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): printable bytes stand for themselves, the other
    bytes for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in chars.values()]
    chars.update({chr(256 + i): b for i, b in enumerate(others)})
    return chars


BYTE_LEVEL_CHARS = _byte_level_chars()
SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
SENTENCEPIECE_SPACE = "\u2581"


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def from_hf_folder(folder: Path, config_eos: set[int]) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise VerispecError(f"{folder}: no tokenizer.json")
    try:
        backend = BackendTokenizer.from_file(str(path))
    except Exception as exc:
        raise CorruptModelError(f"{path}: unreadable tokenizer ({exc})") from None
    settings: dict[str, Any] = {}
    settings_path = folder / "tokenizer_config.json"
    if settings_path.is_file():
        try:
            settings = json.loads(settings_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CorruptModelError(f"{settings_path}: invalid JSON ({exc})") from None
        if not isinstance(settings, dict):
            raise CorruptModelError(f"{settings_path}: expected a JSON object of settings")
    template = settings.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    bos, eos = _token_content(settings.get("bos_token")), _token_content(settings.get("eos_token"))
    eos_ids = set(config_eos)
    if eos and backend.token_to_id(eos) is not None:
        eos_ids.add(backend.token_to_id(eos))
    bos_id = backend.token_to_id(bos) if bos else None
    return Tokenizer(backend, eos_ids, bos, eos, template, bool(settings.get("add_bos_token", False)), bos_id)


def from_gguf(path: Path, meta: dict[str, Any]) -> Tokenizer:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer, get_gguf_tokenizer)

    try:
        architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(path))
        backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    except Exception as exc:
        raise CorruptModelError(f"{path}: the embedded tokenizer could not be read ({exc})") from None
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    eos_ids = {int(eos_id)} if eos_id is not None else set()
    return Tokenizer(
        backend,
        eos_ids,
        bos_token=backend.id_to_token(bos_id) if bos_id is not None else None,
        eos_token=backend.id_to_token(eos_id) if eos_id is not None else None,
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        bos_id=bos_id,
    )
