"""A smaller language model drafts tokens autoregressively over its own cache."""

from __future__ import annotations

import torch

from verispec.sampling import SamplingParams, greedy_token, probabilities, sample
from verispec.spec.proposer import DraftProbs, Proposal

MAX_CONTEXT_IDS = 4096  # context ids a draft limited to the first ids may propose too, at most
AUTO_DRAFT_VOCAB = 32768  # the first ids "auto" keeps, for a vocabulary of more than twice as many
# Markdown as chat models write it: its marks (a code fence above all) are rare in the text a
# BPE is trained on, so it numbers them late (Qwen2.5's ``` is 73594), while answers use them
MARKDOWN_SAMPLE = ("Here is the code:\n\n```python\ndef f(x):\n    return x\n```\n\n"
                   "1. Run it:\n   ```bash\n   python f.py\n   ```\n2. **Note:** `f` returns *x*.\n"
                   "```json\n{}\n```\n```javascript\n```\n```cpp\n```\n```java\n```\n```sql\n```\n"
                   "### Example\n- item\n> quote\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"
                   "1. **Step**: first\n")
# and the LaTeX that answers write their math in: \frac, \[ and \boxed lie above the first
# 32,768 ids too, and with a list item's "**:" were the marks that answers to more than one
# Spec-Bench prompt needed before their context had them (benchmarks/missed_draft_ids.py)
MATH_SAMPLE = ("\\[\n\\frac{a}{b} = \\boxed{c}\n\\]\n\\[ \\frac{x}{y} \\]\n"
               "so \\( x \\cdot y \\approx z \\)\n")


def markdown_ids(tokenizer) -> list[int]:
    """The ids of Markdown's marks in `tokenizer`'s vocabulary, its math's included, as
    MARKDOWN_SAMPLE and MATH_SAMPLE spell them."""
    return list(dict.fromkeys(tokenizer.encode(MARKDOWN_SAMPLE + MATH_SAMPLE, add_special_tokens=False)))


def draft_vocab_limit(choice: int | str | None, vocab_size: int) -> int | None:
    """The first ids a draft model of `vocab_size` ids proposes (with the context's), or None
    for all of them, for a choice of `draft_vocab`: a number, None (all), or "auto", which
    keeps AUTO_DRAFT_VOCAB where the vocabulary is more than twice as large. There the output
    layer is a large share of a small draft's weights, and the ids it drops are rare: with
    the context's ids the demo pair keeps nearly as many drafts at a fifth less per draft step
    (benchmarks/draft_vocab.py); a smaller vocabulary would save too little."""
    if choice == "auto":
        return AUTO_DRAFT_VOCAB if vocab_size > 2 * AUTO_DRAFT_VOCAB else None
    if choice is None or choice >= vocab_size:
        return None
    return choice


def pair_vocab_limit(choice: int | str | None, draft, target) -> int | None:
    """`draft_vocab_limit` for a loaded draft and target: over the ids both know, since a
    draft never proposes an id past the target's vocabulary, whatever the choice."""
    return draft_vocab_limit(choice, min(draft.config.vocab_size, target.config.vocab_size))


class ColumnMap:
    """A draft's logits' columns, for its first `limit` ids and then the context's: a token
    id's column (None where it has none), and the id of each column."""

    def __init__(self, limit: int, extra_ids: list[int], extra_columns: dict[int, int]):
        self.limit, self.extra_ids, self.extra_columns = limit, extra_ids, extra_columns

    def __call__(self, token: int) -> int | None:
        return token if token < self.limit else self.extra_columns.get(token)

    def ids(self, width: int) -> torch.Tensor:
        """The token ids of the first `width` columns."""
        return torch.cat([torch.arange(min(width, self.limit)),
                          torch.tensor(self.extra_ids[:max(0, width - self.limit)], dtype=torch.long)])


class DraftModelProposer:
    """Drafts γ tokens one step at a time.

    The draft cache holds every token it has been fed. A round feeds only what
    the cache lacks: normally the target's last token, or after a fully kept
    round the last draft plus the bonus token together, in one pass rather
    than an extra one. The γ-th draft is never fed: if it is kept, it is fed
    together with the next round's first token.

    The draft may also skip the past (`catch_up`) and read only the last tokens
    of the context: its cache then starts `offset` tokens into it.

    With `vocab_limit` the draft proposes only token ids below it, and its output layer
    computes only their logits. A byte-level BPE numbers its tokens in the order of its
    merges, so the first ids are the most frequent ones: the output layer of a small
    draft is a large part of its weights (28% of the 0.5B's), and tokens it cannot
    propose only cost acceptance where the target would have chosen one. Most of the
    target's tokens above the limit are words of the prompt or of the answer so far, so
    with `context_ids` the draft may propose every id of the context too: the output
    layer's rows of those ids (at most MAX_CONTEXT_IDS of them) are gathered once and
    multiplied apart, a few hundred rows where the limit saves a hundred thousand. So may it
    propose Markdown's marks, its math's LaTeX included (`markdown`), which a chat answer uses
    before its context has them: the first code fence or \\frac of an answer, say.
    Verification stays exact whatever the draft proposes (under sampling, the draft's
    distribution is zero on the ids it cannot propose).
    """

    def __init__(self, loaded, name: str | None = None, vocab_limit: int | None = None, context_ids: bool = True,
                 markdown: bool = True):
        self.loaded = loaded
        # never draft a padding row the target has no embedding for
        self.vocab_limit = min(vocab_limit or loaded.config.vocab_size, loaded.config.vocab_size)
        # a target with more embedding rows can choose an id the draft cannot read (a padding
        # row, for a trained model almost never); the draft then drafts nothing from there on
        self.rows = loaded.config.vocab_size
        # the output layer's rows to compute, asked for only where they are fewer than all
        self.outputs = {"outputs": self.vocab_limit} if self.vocab_limit < self.rows else {}
        self.model = loaded.model
        # the context's ids at or above the limit that the draft may propose too, in the order
        # of their logits' columns, and their output rows [len, hidden]; `scanned`: the context
        # tokens looked at for them so far
        self.context_ids = context_ids and bool(self.outputs)
        self.extra_ids: list[int] = []
        self.extra_columns: dict[int, int] = {}  # each of extra_ids -> its column in the logits
        self.extra_rows: torch.Tensor | None = None
        self.scanned = 0
        # ids every request may propose above the limit, before its context holds them
        self.standing_ids = markdown_ids(loaded.tokenizer) if self.context_ids and markdown else []
        self.name = name or loaded.name
        self.cache = None
        self.offset = 0  # context tokens before the draft's cache starts, never read
        # (context length, logits) that catch_up left for the first draft of the next round
        self.ready: tuple[int, torch.Tensor] | None = None
        self.device = loaded.device
        # the request's rules on the logits (verispec.penalties.LogitsRules: penalties, a
        # structure's mask), which generate() sets and keeps up to date: the draft applies them
        # as the target does, to propose its tokens
        self.rules = None

    @property
    def limited_to(self) -> int | None:
        """The first ids this draft proposes (with the context's), or None where it proposes all."""
        return self.vocab_limit if self.outputs else None

    @torch.inference_mode()
    def start(self, prompt_ids: list[int], max_len: int, prefill: bool = True) -> None:
        """Prefill the prompt, so that the first round pays only for drafting. Without
        `prefill` the draft reads the prompt later, in its first round or through `catch_up`."""
        self.cache = self.model.new_cache(max_len)
        self.offset, self.ready = 0, None
        self.extra_ids, self.extra_columns, self.extra_rows, self.scanned = [], {}, None, 0
        self._add_ids(self.standing_ids)
        if prefill and self._readable(prompt_ids):
            self.model(torch.tensor([prompt_ids], device=self.device), self.cache, last_only=True, **self.outputs)

    def lag(self, context: list[int]) -> int:
        """How many tokens of the context the draft has not read yet."""
        return len(context) - self.offset - self.cache.length

    @torch.inference_mode()
    def catch_up(self, context: list[int], window: int) -> None:
        """Read the context not read yet, at most `window` tokens: further behind, the draft
        forgets what it read and starts over on the last `window` tokens. Rotary positions are
        relative, so it continues the recent text as it would in the full one, only without
        the older context; the target's verification keeps the output exact either way. The
        last position's logits are kept for the next round's first draft, which then costs
        no pass of its own (a one-position pass reads all the draft's weights; one more row in
        this pass costs only its arithmetic)."""
        if self.lag(context) > window:
            self.offset = max(0, len(context) - window)
            self.cache.rollback(0)
        start, end = self.offset + self.cache.length, len(context)
        self.ready = None
        self._take_context_ids(context)
        if end > start and self._readable(context[start:end]):
            self.ready = (end, self._logits(torch.tensor([context[start:end]], device=self.device)))

    @torch.inference_mode()
    def propose(self, context: list[int], gamma: int, params: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        pending = context[self.offset + self.cache.length:]
        ready, self.ready = self.ready, None
        if not pending and (ready is None or ready[0] != len(context)):
            self.cache.rollback(self.cache.length - 1)  # read the last token again, for its logits
            pending = context[-1:]
        if not self._readable(pending):
            return Proposal([], None)  # a plain round: the target decodes on its own
        self._take_context_ids(context)
        feed = torch.tensor([pending], device=self.device) if pending else None
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        column_of = ColumnMap(self.vocab_limit, self.extra_ids, self.extra_columns) if self.rules else None
        for i in range(gamma):
            if feed is None:  # the first draft, from the logits catch_up left
                logits = ready[1]
            else:
                logits = self._logits(feed)
            if self.rules:
                logits = self.rules.apply(logits[None], before=tokens, column_of=column_of,
                                          greedy=params.greedy)[0]
            if params.greedy:
                token = self._token(greedy_token(logits))
            else:
                probs = probabilities(logits, params)
                token = self._draw(probs, generator)
                rows.append(probs)
            tokens.append(token)
            if i + 1 < gamma:
                feed = torch.tensor([[token]], device=self.device)
        return Proposal(tokens, self._draft_probs(rows), steps=gamma - 1 if pending == [] else None)

    def _logits(self, feed: torch.Tensor) -> torch.Tensor:
        """The last position's logits: the first vocab_limit ids', then extra_ids' if any."""
        extra = {} if self.extra_rows is None else {"extra_rows": self.extra_rows}
        return self.model(feed, self.cache, last_only=True, **self.outputs, **extra)[0, -1]

    def _token(self, index: int) -> int:
        """The token id of a column of the logits."""
        return index if index < self.vocab_limit else self.extra_ids[index - self.vocab_limit]

    def _draw(self, probs: torch.Tensor, generator: torch.Generator) -> int:
        """A token id drawn from probabilities over the logits' columns, there: a row of the
        whole vocabulary would be longer (4.6x with the default draft vocabulary)."""
        return self._token(sample(probs, generator))

    def _draft_probs(self, rows: list[torch.Tensor]) -> DraftProbs | None:
        """A sampled proposal's distributions over the logits' columns: the first ids, then the
        context's. A row computed before the last context ids were added lacks their columns
        (zero: it could not propose them)."""
        if not rows:
            return None
        width = max(row.shape[-1] for row in rows)
        stacked = torch.stack([torch.nn.functional.pad(row, (0, width - row.shape[-1])) for row in rows])
        return DraftProbs(stacked, self.extra_ids[:width - self.vocab_limit] if self.context_ids else ())

    def _take_context_ids(self, context: list[int]) -> None:
        """Add the ids of the context not scanned yet that lie at or above the limit."""
        if not self.context_ids or self.scanned >= len(context):
            return
        self._add_ids(context[self.scanned:])
        self.scanned = len(context)

    def _add_ids(self, ids: list[int]) -> None:
        """Let the draft propose these ids too, where they lie at or above the limit."""
        new = [t for t in dict.fromkeys(ids) if self.vocab_limit <= t < self.rows and t not in self.extra_columns]
        new = new[:MAX_CONTEXT_IDS - len(self.extra_ids)]
        if new:
            rows = self.model.output_rows(torch.tensor(new, device=self.device))
            self.extra_rows = rows if self.extra_rows is None else torch.cat([self.extra_rows, rows])
            self.extra_columns.update((t, self.vocab_limit + len(self.extra_ids) + i) for i, t in enumerate(new))
            self.extra_ids.extend(new)

    def _readable(self, ids: list[int]) -> bool:
        return all(i < self.rows for i in ids)

    def commit(self, length: int) -> None:
        length -= self.offset
        if self.cache.length > length:
            self.cache.rollback(length)
