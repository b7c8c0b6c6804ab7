"""Baseline and speculative decoding as one stream of events.

    prefill: the target reads the prompt and picks the first token;
    rounds:  a proposer drafts γ tokens, the target checks them in one pass
             over [last token, drafts], the verifier keeps a prefix and adds one
             token of the target's own, and every cache rolls back to what was kept.

Baseline decoding is the same loop with γ = 0: one target pass, one token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from verispec.errors import ContextOverflowError, VerispecError
from verispec.events import (MAX_TOP_LOGPROBS, Event, Finished, GenerationResult, Logprob, Prompt, SpecStats, Timings,
                             Token)
from verispec.penalties import LogitsRules, Penalties, PenaltyState
from verispec.sampling import SamplingParams, next_token, token_logprob
from verispec.spec.gamma import make_policy
from verispec.spec.prompt_lookup import PromptLookupProposer
from verispec.spec.proposer import Proposer
from verispec.spec.verifier import verify_greedy, verify_sampling
from verispec.structured import request_structure
from verispec.values import is_whole

MAX_GAMMA = 32
# With --adaptive, a draft model reads the context only when it is about to draft, and no
# more than its last READY_LAG unread tokens: before its first round, and before a probe
# after many plain rounds, it skips the older context. A long prompt's full prefill, or a
# draft kept reading while speculation does not pay, would cost a large part of a short
# request, and --adaptive promises never to be much slower than plain decoding.
READY_LAG = 32
# With --adaptive, a draft model's rounds may send prompt lookup's drafts instead, where the
# context has a continuation for its last LOOKUP_NGRAM tokens (longest first): lookup sees the
# whole context for nothing. A single repeated token is too weak a sign to bet a round on; a
# 5-token match is a better copy source than the latest 3-token one (replayed on three hosts'
# costs: summarization 3-4% faster than with 3 first, reasoning up to 3.5%, every other
# category within 0.5%; benchmarks/policy_replay.py --variants current ngram-3).
LOOKUP_NGRAM = (5, 2)
# Positions per prefill pass when every prompt position's logits are kept (prompt
# log-probabilities): a long prompt then holds [PROMPT_CHUNK, vocab] floats at a time, not
# [T, vocab]. On the CPU, 16 to 64 cost the same and more costs more: scoring a 512-token
# prompt took 1.28-1.42x a plain prefill in chunks of 16-64, 1.66x in 128 and 1.87x in 256
# (benchmarks/scoring.py, int8 1.5B).
PROMPT_CHUNK = 64


def policy_lookup() -> PromptLookupProposer:
    """Prompt lookup as --adaptive's policy is offered it: LOOKUP_NGRAM's sizes, and the whole
    continuation (the policy weighs how much of it to send)."""
    return PromptLookupProposer(*LOOKUP_NGRAM, bounded_by_match=False)


class TextAssembler:
    """Turns tokens into printable text pieces, and finds stop strings across token borders.

    Each token costs the same whatever the length of the output: only a short window of
    recent tokens is decoded, never the whole output. A decoder may treat the first token
    of what it decodes apart (SentencePiece drops its leading space), so the window starts
    at the tokens settled one step earlier, and what the newest tokens add to their text is
    the new text (as in vLLM's incremental detokenizer). Text that could still grow into a
    stop string is held back, so a stop string spanning several tokens is never printed.
    Stop strings are looked for once `min_tokens` tokens are in, in the text not handed out.
    """

    def __init__(self, tokenizer, stop: Sequence[str], min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.min_tokens = min_tokens
        self.ids: list[int] = []
        self.window = 0  # ids[window:] are decoded together
        self.settled = 0  # ids[:settled] have given their text
        self.sent: list[str] = []  # pieces handed out
        self.held = ""  # settled text not handed out: it may be the start of a stop string
        self.stopped = False

    @property
    def text(self) -> str:
        """All text so far (up to a stop string), handed out or held back."""
        return "".join(self.sent) + self.held

    def add(self, token_id: int) -> tuple[str, bool]:
        """(new printable text, whether a stop string was completed)."""
        self.ids.append(token_id)
        new = self._new_text()
        if new is None:
            return "", False  # an incomplete UTF-8 sequence: wait for the next token
        return self._take(new)

    def flush(self) -> str:
        """The rest of the text: what was held back, and the text of tokens that end mid-character."""
        if self.stopped:
            return ""
        new = self._new_text(final=True) if self.settled < len(self.ids) else ""
        piece, stopped = self._take(new)
        return piece + ("" if stopped else self._send(self.held, held=""))

    def _take(self, new: str) -> tuple[str, bool]:
        # Every stop string found so far ended the text, so one found now lies in what was
        # held back (which holds every tail that is the start of a stop string) and the new text.
        unsent = self.held + new
        for s in self.stop if len(self.ids) >= self.min_tokens else ():
            at = unsent.find(s)
            if at != -1:
                self.stopped = True
                return self._send(unsent[:at], held=""), True
        hold = self._stop_prefix_len(unsent)
        return self._send(unsent[:len(unsent) - hold], held=unsent[len(unsent) - hold:]), False

    def _send(self, piece: str, held: str) -> str:
        self.sent.append(piece)
        self.held = held
        return piece

    def _new_text(self, final: bool = False) -> str | None:
        """The text the tokens after ids[:settled] add; None while it ends in a partial
        character, unless `final` (no token follows)."""
        decode = self.tokenizer.decode
        before = decode(self.ids[self.window:self.settled])
        after = decode(self.ids[self.window:])
        if after.endswith("\ufffd") and not final:
            return None
        if after.startswith(before):
            new = after[len(before):]
        else:  # the decoder rewrote earlier text: take the whole output's text once
            known = self.text
            full = decode(self.ids)
            new = full[len(known):]
        self.window, self.settled = self.settled, len(self.ids)
        return new

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of text that could still grow into a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if s.startswith(text[-n:]):
                    best = n
                    break
        return best


def encode_prompt(tokenizer, prompt: str | list[int] | list[dict[str, Any]], chat: bool,
                  suffix: str | None = None) -> list[int]:
    """The prompt's token ids; with `suffix`, the fill-in-the-middle prompt for the text
    between the prompt and the suffix."""
    if suffix is not None:
        if chat or not isinstance(prompt, str) or not isinstance(suffix, str):
            raise VerispecError("a suffix fills in the text between a plain text prompt and itself: give both "
                                "as text, without chat")
        return tokenizer.encode_infill(prompt, suffix)
    if isinstance(prompt, (list, tuple)) and all(map(is_whole, prompt)):
        return list(prompt)
    if isinstance(prompt, (list, tuple)) and all(isinstance(p, dict) for p in prompt):
        return tokenizer.encode_chat(list(prompt))
    if not isinstance(prompt, str):
        raise VerispecError("the prompt must be text, a list of token ids, or a list of chat messages "
                            f"({{'role': ..., 'content': ...}}), not {_describe(prompt)}")
    if chat:
        return tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt)


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in value})
        return f"a list of {', '.join(kinds)}"
    return type(value).__name__


def _stop_strings(stop: str | Sequence[str] | None) -> list[str]:
    """A single stop string is one string to stop at, not a set of characters."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise VerispecError(f"stop must be a string or a list of strings, not {_describe(stop)}")
    return list(stop)


def _stop_token_ids(ids: Sequence[int]) -> set[int]:
    if not isinstance(ids, (list, tuple, set)) or not all(is_whole(i) for i in ids):
        raise VerispecError(f"stop token ids must be a list of token ids, not {_describe(ids)}")
    return set(ids)


def make_proposer(draft, target, ngram: tuple[int, int] = (3, 1), draft_vocab: int | str | None = "auto"
                  ) -> Proposer | None:
    """None (baseline), "ngram", a loaded draft model (proposing only the first ids and the
    context's where `draft_vocab` says so: see `draft_vocab_limit`), or any Proposer."""
    is_model = hasattr(draft, "model") and hasattr(draft, "tokenizer")
    if draft_vocab not in (None, "auto") and not is_model:
        raise VerispecError("a draft vocabulary applies to a draft model only, not to "
                            + ("plain decoding" if draft is None else "prompt lookup or another proposer"))
    if draft is None:
        return None
    if draft == "ngram":
        return PromptLookupProposer(max_ngram=ngram[0], min_ngram=ngram[1])
    if is_model:
        from verispec.spec.compat import check_tokenizers
        from verispec.spec.draft_model import DraftModelProposer, pair_vocab_limit
        check_tokenizers(target.tokenizer, draft.tokenizer)
        limit = pair_vocab_limit(draft_vocab, draft, target)
        return DraftModelProposer(draft, vocab_limit=limit or target.config.vocab_size)
    if hasattr(draft, "propose"):
        return draft
    raise VerispecError(f"unknown draft {draft!r}: give a model, 'ngram', or a proposer")


@torch.inference_mode()
def stream(target, prompt: str | list[int] | list[dict[str, Any]], *, draft=None, gamma: int = 4,
           adaptive: bool | str = False, max_tokens: int = 128, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
           stop: str | Sequence[str] | None = (),
           chat: bool = False, ignore_eos: bool = False, ngram: tuple[int, int] = (3, 1),
           draft_vocab: int | str | None = "auto", lookup: bool = True,
           logprobs: int | None = None, prompt_logprobs: int | None = None, presence_penalty: float = 0.0,
           frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
           logit_bias: Mapping[int, float] | None = None, stop_token_ids: Sequence[int] = (),
           min_tokens: int = 0, suffix: str | None = None, json_schema: dict[str, Any] | bool | None = None,
           regex: str | None = None, grammar: str | None = None) -> Iterator[Event]:
    """Decode from `target` (a LoadedModel); with `draft`, speculatively. Yields Token events, then Finished.
    With `logprobs` (0 to MAX_TOP_LOGPROBS), every token carries the target's log-probability
    of it and of its `logprobs` most likely alternatives (`token_logprob`); with
    `prompt_logprobs`, a Prompt event first gives the same for every prompt token, given the
    tokens before it (what scoring a text needs; `max_tokens=0` then decodes nothing).
    The logit bias ({id: -100 to 100}) and the penalties (`verispec.penalties`, as OpenAI and
    vLLM define them) change the target's choices and a draft model's proposals, not the
    log-probabilities reported.
    A draft model proposes only the first `draft_vocab` token ids and the context's; "auto"
    (the default) limits a vocabulary of more than 65,536 ids to the first 32,768, None keeps
    all (`draft_vocab_limit`). With
    `adaptive` (cost-aware) and a draft model, rounds may send prompt lookup's drafts in the
    draft model's place where that promises more; `lookup=False` keeps to the draft model.
    `stop_token_ids` end the text as a stop string does, left out of it, `ignore_eos` or not.
    Before `min_tokens` tokens, nothing ends the text: the end-of-text and stop token ids are
    ruled out of the target's choices and stop strings are not looked for (as vLLM has it).
    With `suffix`, a code model trained for it fills in the middle: it writes the text that
    goes between the prompt and the suffix, and the tokens that end a middle end the text
    as the end-of-text token does (`Tokenizer.infill_end_ids`).
    With `json_schema` (a schema, or True for any JSON object), `regex` or `grammar` (Lark, in
    llguidance's dialect), the output is held to it (`verispec.structured`): every choice,
    plain, verifying or drafting, is made among the ids that keep the text on course, and the
    text ends where the structure does."""
    if not is_whole(max_tokens, 0):
        raise VerispecError(f"max tokens must be a whole number >= 0, got {max_tokens!r}")
    if not is_whole(min_tokens, 0, max_tokens):
        raise VerispecError(f"min tokens must be a whole number from 0 to max tokens ({max_tokens}), "
                            f"got {min_tokens!r}")
    if not is_whole(gamma, 0, MAX_GAMMA):
        raise VerispecError(f"gamma must be a whole number from 0 to {MAX_GAMMA}, got {gamma!r}")
    if draft_vocab not in (None, "auto") and not is_whole(draft_vocab, 1):
        raise VerispecError(f"the draft vocabulary must be a whole number >= 1, 'auto' or None (all of it), "
                            f"got {draft_vocab!r}")
    for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if value is not None and not is_whole(value, 0, MAX_TOP_LOGPROBS):
            raise VerispecError(f"{name} must be a whole number from 0 to {MAX_TOP_LOGPROBS} (the alternatives "
                                f"per token) or None, got {value!r}")
    params = SamplingParams(temperature, top_k, top_p, seed)
    penalties = Penalties(presence_penalty, frequency_penalty, repetition_penalty, logit_bias, min_tokens)
    stop = _stop_strings(stop)
    generator = params.generator() if not params.greedy else None
    tokenizer, model = target.tokenizer, target.model
    prompt_ids = encode_prompt(tokenizer, prompt, chat, suffix)
    if not prompt_ids:
        raise VerispecError("the prompt is empty")
    vocab = target.config.vocab_size
    stop_ids = _stop_token_ids(stop_token_ids)
    outside = next((i for i in [*prompt_ids, *dict(penalties.logit_bias), *stop_ids] if not 0 <= i < vocab), None)
    if outside is not None:
        raise VerispecError(f"token id {outside} is outside the model's vocabulary (0..{vocab - 1})")
    context_size = target.config.max_position_embeddings
    if len(prompt_ids) >= context_size:
        raise ContextOverflowError(
            f"the prompt has {len(prompt_ids):,} tokens but the model's context holds {context_size:,}; "
            f"shorten the prompt")
    proposer = make_proposer(draft, target, ngram, draft_vocab)
    policy = make_policy(gamma, adaptive) if proposer is not None else make_policy(0, False)
    max_tokens = min(max_tokens, context_size - len(prompt_ids))
    max_gamma = getattr(policy, "max_gamma", gamma) if adaptive else gamma
    max_len = min(context_size, len(prompt_ids) + max_tokens + max_gamma + 1)
    device = next(model.parameters()).device

    stats = SpecStats(draft_vocab=getattr(proposer, "limited_to", None))
    eos_ids = set() if ignore_eos else tokenizer.infill_end_ids if suffix is not None else tokenizer.eos_ids
    rules = LogitsRules(PenaltyState(penalties, prompt_ids, eos_ids | stop_ids) if penalties.active else None,
                        request_structure(json_schema, regex, tokenizer, vocab, ignore_eos, min_tokens, grammar))
    if hasattr(proposer, "rules"):
        proposer.rules = rules  # a draft model proposes under the target's rules
    text = TextAssembler(tokenizer, stop, min_tokens)
    out_ids: list[int] = []
    origins: list[str] = []
    out_logprobs: list[Logprob] | None = [] if logprobs is not None else None
    finish = None

    def emit(tokens: list[int], kinds: list[str], round_index: int, rows: torch.Tensor) -> Iterator[Token]:
        """Emit tokens in order until a stop condition; sets `finish` when one is met.
        rows[i]: the target's logits that chose or checked tokens[i]."""
        nonlocal finish
        for i, (token, kind) in enumerate(zip(tokens, kinds)):
            if token in eos_ids:
                finish = "eos"
                return
            if token in stop_ids:
                finish = "stop"
                return
            piece, stopped = text.add(token)
            out_ids.append(token)
            origins.append(kind)
            logprob = None
            if out_logprobs is not None:
                logprob = token_logprob(rows[i], token, logprobs)
                out_logprobs.append(logprob)
            yield Token(token, piece, kind, len(out_ids) - 1, round_index, logprob)
            if stopped:
                finish = "stop"
                return
            if len(out_ids) >= max_tokens:
                finish = "length"
                return

    # prefill: the first token is the target's own (a round with no drafts)
    started = time.perf_counter()
    cache = model.new_cache(max_len)
    logits, scored_prompt = _prefill(model, prompt_ids, cache, device, prompt_logprobs)
    first = next_token(rules.apply(logits[None], [], greedy=params.greedy)[0] if rules else logits, params,
                       generator)
    prefill_s = time.perf_counter() - started
    stats.rounds, stats.plain = 1, 1
    stats.gammas.append(0)
    context = [*prompt_ids, first]
    if scored_prompt is not None:
        yield Prompt(list(prompt_ids), scored_prompt)
    if max_tokens == 0:
        finish = "length"
    else:
        yield from emit([first], ["target"], 0, logits[None])
    if not out_ids:  # the first token was the end of text, or none was asked for
        stats.plain = 0
    if rules:
        rules.add(out_ids)
    decode_started = time.perf_counter()
    lazy = bool(adaptive) and hasattr(proposer, "catch_up")
    weighs_lookup = lookup and lazy and hasattr(policy, "lookup_gamma")
    lookup_proposer = policy_lookup() if weighs_lookup else None
    if proposer is not None and finish is None:
        t0 = time.perf_counter()
        proposer.start(prompt_ids, max_len, **({"prefill": False} if lazy else {}))
        stats.draft_s += time.perf_counter() - t0

    while finish is None:
        remaining = max_tokens - len(out_ids)
        g = min(policy.choose(), remaining - 1, max_len - len(context) - 1) if proposer else 0
        g = max(g, 0)
        drafts, draft_probs, draft_s, draft_steps = [], None, 0.0, None
        looked_up = _look_up(lookup_proposer, policy, context, g,
                             min(remaining - 1, max_len - len(context) - 1)) if lookup_proposer else []
        if looked_up:
            drafts, g = looked_up, 0  # the draft model sits this round out
        if g > 0 and lazy and proposer.lag(context) > 2:
            t0 = time.perf_counter()  # drafting time, but not the cost of drafts the policy weighs
            proposer.catch_up(context, READY_LAG)
            catch_up_s = time.perf_counter() - t0
            stats.draft_s += catch_up_s
            stats.catch_up_s += catch_up_s
        if g > 0:
            t0 = time.perf_counter()
            proposal = proposer.propose(context, g, params, generator)
            draft_s = time.perf_counter() - t0
            drafts, draft_probs, draft_steps = proposal.tokens[:g], proposal.probs, proposal.steps
        t0 = time.perf_counter()
        feed = torch.tensor([[context[-1], *drafts]], device=device)
        logits = model(feed, cache)[0]
        if params.greedy:  # the rules apply to the rows choices are made from; logprobs read the raw rows
            choices = rules.apply(logits, drafts, greedy=True, reuse=True) if rules else logits
            verdict = verify_greedy(choices, drafts)
        else:
            verdict = verify_sampling(rules.as_read(logits, drafts) if rules else logits, drafts, draft_probs,
                                      params, generator)
        kept = len(context) + verdict.accepted
        cache.rollback(kept)
        if proposer is not None:
            proposer.commit(kept)
        verify_s = time.perf_counter() - t0
        stats.draft_s += draft_s
        stats.verify_s += verify_s
        policy.update(len(drafts), verdict.accepted, draft_s, verify_s, draft_steps, lookup=bool(looked_up))
        if looked_up:
            stats.lookup_drafted += len(drafts)
            stats.lookup_accepted += verdict.accepted

        new = verdict.tokens(drafts)
        last_kind = "target" if not drafts else ("bonus" if verdict.bonus else "recovered")
        kinds = ["draft"] * verdict.accepted + [last_kind]
        before = len(out_ids)
        yield from emit(new, kinds, stats.rounds, logits)
        emitted = len(out_ids) - before
        if rules:
            rules.add(out_ids[before:])
        _count(stats, drafts, verdict, emitted)
        context.extend(new)

    decode_s = time.perf_counter() - decode_started
    timings = Timings(target.load_s, prefill_s, decode_s,
                      (len(out_ids) - 1) / decode_s if decode_s > 0 and len(out_ids) > 1 else 0.0)
    tail = text.flush()
    result = GenerationResult(text.text, out_ids, origins, len(prompt_ids), finish, timings,
                              stats if proposer is not None else None, out_logprobs, scored_prompt)
    yield Finished(result, tail=tail)


def _prefill(model, prompt_ids: list[int], cache, device: torch.device, top: int | None
             ) -> tuple[torch.Tensor, list[Logprob | None] | None]:
    """The target reads the prompt: the last position's logits, and with `top` (not None)
    every prompt token's log-probability given those before it (None for the first) with its
    `top` likeliest alternatives. Those are read PROMPT_CHUNK positions a pass. On the CPU
    kernels a position's logits do not depend on how many positions a pass holds, so there
    the chunks leave the cache and the last logits bit for bit as one pass leaves them."""
    if top is None:
        return model(torch.tensor([prompt_ids], device=device), cache, last_only=True)[0, -1], None
    scored: list[Logprob | None] = [None]
    for start in range(0, len(prompt_ids), PROMPT_CHUNK):
        chunk = prompt_ids[start:start + PROMPT_CHUNK]
        logits = model(torch.tensor([chunk], device=device), cache)[0]
        following = prompt_ids[start + 1:start + 1 + len(chunk)]  # row i predicts the token after it
        scored.extend(token_logprob(row, token, top) for row, token in zip(logits, following))
    return logits[-1], scored


def _look_up(lookup: PromptLookupProposer, policy, context: list[int], gamma: int, room: int) -> list[int]:
    """Prompt lookup's drafts for this round, if the policy prefers them to γ of the draft
    model's (or to a plain step); [] otherwise. `room`: the most drafts the round may hold."""
    found = lookup.lookup(context, room) if room > 0 else []
    return found[:policy.lookup_gamma(len(found), gamma)] if found else []


def _count(stats: SpecStats, drafts: list[int], verdict, emitted: int) -> None:
    """Book one round: only emitted tokens count, so tokens = accepted + recovered + bonus + plain."""
    stats.rounds += 1
    stats.gammas.append(len(drafts))
    stats.drafted += len(drafts)
    kept_emitted = min(verdict.accepted, emitted)
    stats.accepted += kept_emitted
    for position in range(len(drafts)):
        stats.record_position(position, position < kept_emitted)
    if emitted > verdict.accepted:
        if not drafts:
            stats.plain += 1
        elif verdict.bonus:
            stats.bonus += 1
        else:
            stats.recovered += 1


def generate(target, prompt, **options) -> GenerationResult:
    """Run `stream` to the end and return its result."""
    for event in stream(target, prompt, **options):
        if isinstance(event, Finished):
            return event.result
    raise AssertionError("stream ended without a Finished event")
