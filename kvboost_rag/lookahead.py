"""Prompt lookup: decode steps that check a few draft tokens copied from the prompt, several tokens per forward.

A RAG answer copies much of itself from its documents: names, figures, option names, whole phrases. After each
token, the longest n-gram (up to MAX_N tokens) that ends the text so far and occurred before, in the prompt or the
answer, proposes the tokens that followed its latest occurrence. The decode step runs the token and those drafts in
one forward (batching.DecodeBatcher.step), whose rows are the next-token logits after each. A draft's row is used
only if greedy decoding chooses that very draft, so the answer is greedy decoding's token for token, each token
chosen from its own logits and judged by the fidelity guard as before; a draft refused leaves K/V past the chosen
token, which the next forward overwrites (nothing attends there first).

Why it pays: a decode step reads every weight for one token, and a forward over three tokens costs little more
(the bundled model in float32, 1.3k-token cache, Intel Xeon: 56.5 ms for one token, 63.0 for two, 66.3 for three,
but 100.6 for four: the matmul kernels change at four rows). Full's own 64-token answers on fidelity_holdout and
man_pages (24 prompts) need 0.50 forwards a token with 2 drafts (EngineConfig.lookahead's default), 0.35 with 7
(docs/method.md).

Greedy requests only: a sampled token would need rejection sampling to keep its distribution; they take one token
per step. Concurrent streams check their drafts in one batched forward (batching.py). The rows of a forward over
several tokens are not bit for bit those of forwards over one (other matmul shapes), so a token at a near-tie can
differ from one-token decoding's, as it can between a lone stream and a batched one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MAX_N = 3  # the longest n-gram looked up


class Drafter:
    """The text so far (prompt and answer tokens) and, per n-gram of up to MAX_N tokens, where the token after its
    latest occurrence is: a dict, so a lookup costs the same at any length."""

    def __init__(self, context: Sequence[int]):
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it last
        for token in context:
            self.add(token)

    def add(self, token: int) -> None:
        self.tokens.append(token)
        end = len(self.tokens) - 1  # the n-grams ending just before `token` are now followed by it
        for n in range(1, MAX_N + 1):
            if end - n >= 0:
                self._after[tuple(self.tokens[end - n:end])] = end

    def draft(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the longest n-gram ending the text, where it occurred last."""
        for n in range(min(MAX_N, len(self.tokens)), 0, -1):
            start = self._after.get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start:start + k]
        return []


class Lookahead:
    """One stream's decode steps with drafts: `next` appends the chosen token and gives the logits [V] after it,
    from a draft's row already computed when the token is that draft, else from a new forward."""

    def __init__(self, prompt_ids: torch.Tensor, drafts: int):
        self.drafts = drafts
        self.drafter = Drafter(prompt_ids.tolist()) if drafts else None
        self._pending: list[tuple[int, torch.Tensor]] = []  # (draft token, logits [V] after it), in order
        self._cache = None  # the cache the pending rows were computed in: a guard's climb replaces it

    def next(self, batcher, cache, token: int, position: int, room: int) -> torch.Tensor:
        """Append `token` at `position` to `cache`: the next-token logits [V]. `room`: how many more tokens after
        this one the answer may still need logits for (drafts past it would be wasted, or past the cache's end)."""
        if self.drafter is None:
            return batcher.step(cache, token, position)
        self.drafter.add(token)
        if self._pending and self._cache is cache and self._pending[0][0] == token:
            batcher.used_draft()
            return self._pending.pop(0)[1]  # its K/V were written by the forward that checked it
        drafts = self.drafter.draft(min(self.drafts, room))
        if not drafts:
            self._pending = []
            return batcher.step(cache, token, position)
        rows = batcher.step(cache, token, position, drafts)  # [1 + D, V]
        self._pending, self._cache = list(zip(drafts, rows[1:], strict=False)), cache
        return rows[0]
