"""Draft/target compatibility: the two tokenizers must give the same ids to the same tokens."""

from __future__ import annotations

from verispec.errors import TokenizerMismatchError


def check_tokenizers(target, draft) -> None:
    """Raise TokenizerMismatchError naming the first differing token.

    Only the tokenizers are compared: embedding matrices padded to different
    sizes (Qwen's 151,936 vs 152,064 rows) are fine, since padding rows are no tokens.
    """
    t_vocab = {i: s for s, i in target.vocab.items()}
    d_vocab = {i: s for s, i in draft.vocab.items()}
    for token_id in sorted(set(t_vocab) | set(d_vocab)):
        t, d = t_vocab.get(token_id), d_vocab.get(token_id)
        if t != d:
            raise TokenizerMismatchError(
                f"the draft's tokenizer does not match the target's: token id {token_id} is "
                f"{t!r} for the target but {d!r} for the draft "
                f"(target vocabulary {len(t_vocab):,} tokens, draft {len(d_vocab):,})")
