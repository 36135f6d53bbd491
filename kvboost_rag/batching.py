"""Step-level batching of concurrent decodes: one forward for every stream waiting on a decode step.

A decode step reads every weight of the model to make one token, so eight one-token forwards cost nearly eight
times one forward over eight tokens. Concurrent streams (KVBoost.stream_from, stepped on serving's worker
threads) therefore hand their steps to the engine's `DecodeBatcher`, a group commit: the first caller while no
batch runs leads. It waits briefly for the rest of the round (until every stream registered as decoding has
submitted, or WINDOW_S, whichever comes first), takes the engine lock, runs one forward over every pending step
(adapter.decode_rows: each sequence at its own position in its own cache) and hands each caller its rows'
logits. The others wait on a Condition meanwhile; those who come during a batch form the next one.

Each step carries its token and its draft tokens (lookahead.py), all in the same forward: a lone stream's batch
runs exactly as KVBoost.decode_step runs it; in a batch of several, a stream with fewer drafts than another pads
its row (the padding is written nowhere). An error in a batch's forward reaches every caller of that batch, and
the next batch runs as usual.

A registered stream that is not stepping (its consumer is slow, or steps several streams from one thread) costs
the others at most WINDOW_S per step.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .kvcache import KVBuffers

# How long a leader waits for the rest of a round: a few ms against a decode step's tens, and a round's streams
# resubmit within a fraction of that (they were all answered at once).
WINDOW_S = 0.003


@torch.inference_mode()
def decode(adapter, caches: Sequence[KVBuffers], tokens: Sequence[int], positions: Sequence[int],
           drafts: Sequence[Sequence[int]] = ()) -> list[torch.Tensor]:
    """Append tokens[b] at positions[b] to caches[b], then drafts[b] after it (lookahead.py; none by default), for
    each of B sequences in one forward: per sequence the logits after its token and after each draft, fp32
    [1 + D_b, V]."""
    drafts = list(drafts) or [()] * len(caches)
    if len(caches) == 1:  # one request: the single-sequence path as it always ran (no padding, its own masks)
        token_ids = torch.tensor([tokens[0], *drafts[0]])
        at = torch.arange(positions[0], positions[0] + len(token_ids))
        hidden = adapter.run_layers(adapter.embed(token_ids), at, caches[0], range(adapter.num_layers), int(at[-1]) + 1)
        return [adapter.logits(hidden)]
    counts = [1 + len(d) for d in drafts]
    width = max(counts)
    rows = []
    for token, row_drafts in zip(tokens, drafts, strict=True):
        row = [token, *row_drafts]
        rows.append(row + row[-1:] * (width - len(row)))  # padding repeats the last token; RowsCache writes none
    hidden = adapter.embed(torch.tensor(rows).flatten())  # [1, B * Q, H]
    hidden = adapter.decode_rows(hidden.view(len(rows), width, -1), torch.tensor(list(positions)), list(caches),
                                 counts)  # [B, Q, H]
    own = torch.cat([hidden[b, :n] for b, n in enumerate(counts)])  # the LM head for the rows that mean something
    return list(adapter.logits(own[None]).split(counts))


class EngineLock:
    """The engine's re-entrant lock, which can tell whether the calling thread holds it (threading.RLock keeps
    that to itself): a step taken under it must not wait for a leader that waits for it."""

    def __init__(self):
        self._lock = threading.RLock()
        self._owner: int | None = None  # read without the lock: only the owner ever sees its own ident there
        self._depth = 0
        # Entries holding or waiting for the lock, so that background work (shadow.py) can tell an idle engine.
        self._wanted = 0
        self._count = threading.Lock()

    def __enter__(self) -> EngineLock:
        with self._count:
            self._wanted += 1
        self._lock.acquire()
        self._owner, self._depth = threading.get_ident(), self._depth + 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
        self._lock.release()
        with self._count:
            self._wanted -= 1

    @property
    def wanted(self) -> int:
        """How many entries hold the lock or wait for it (0: nobody needs the engine now)."""
        return self._wanted

    @property
    def others(self) -> int:
        """`wanted`, less this thread's own entries."""
        return self._wanted - (self._depth if self.held_here() else 0)

    @contextmanager
    def released(self) -> Iterator[None]:
        """Let go of the lock wholly, however deeply this thread holds it, and take it back as deeply after."""
        depth = self._depth if self.held_here() else 0
        for _ in range(depth):
            self.__exit__()
        try:
            yield
        finally:
            for _ in range(depth):
                self.__enter__()

    def held_here(self) -> bool:
        return self._owner == threading.get_ident()


@dataclass(eq=False)
class _Step:
    cache: KVBuffers
    token: int
    position: int
    drafts: tuple[int, ...] = ()
    logits: torch.Tensor | None = None  # [1 + D, V], once done
    error: BaseException | None = None
    done: bool = False

    def result(self) -> torch.Tensor:
        """The caller's logits: [V] for a step without drafts, [1 + D, V] for one with (DecodeBatcher.step)."""
        if self.error is not None:
            raise self.error
        return self.logits if self.drafts else self.logits[0]


class DecodeBatcher:
    """Group commit of decode steps over one engine's adapter, under its lock (see the module docstring)."""

    def __init__(self, adapter, lock: EngineLock, window_s: float = WINDOW_S):
        self.adapter, self.lock, self.window_s = adapter, lock, window_s
        self._changed = threading.Condition()
        self._pending: list[_Step] = []
        self._leading = False  # a leader is gathering or running a batch
        self._decoders = 0
        # "batches" run, "rows" decoded in them, "largest": the most rows one batch had; "drafted": draft tokens
        # checked (lookahead.py), "drafts_used": of those, the ones decoding chose, whose forward was saved.
        self.counters: collections.Counter[str] = collections.Counter()

    @property
    def decoders(self) -> int:
        """Streams decoding now (between their steps too)."""
        return self._decoders

    @contextmanager
    def decoding(self) -> Iterator[None]:
        """Count the caller's stream as decoding while inside: a leader waits for its step (up to the window)."""
        with self._changed:
            self._decoders += 1
        try:
            yield
        finally:
            with self._changed:
                self._decoders -= 1
                self._changed.notify_all()  # a leader waiting for this stream stops waiting

    def used_draft(self) -> None:
        """A draft's row served a token (lookahead.py): counted for /metrics."""
        with self._changed:
            self.counters["drafts_used"] += 1

    def step(self, cache: KVBuffers, token: int, position: int, drafts: Sequence[int] = ()) -> torch.Tensor:
        """Append `token` at `position` to `cache` in the next batch: the next-token logits [V] fp32. With `drafts`
        (lookahead.py), [1 + D, V]: the rows after the token and after each draft, appended after it."""
        mine = _Step(cache, token, position, tuple(drafts))
        if self.lock.held_here():
            # The caller holds the engine lock already (calibration decodes under it): a leader would wait for
            # that lock while this caller waited for the leader. It runs alone, at once.
            with self.lock:
                (mine.logits,) = decode(self.adapter, [cache], [token], [position], [mine.drafts])
            return mine.result()
        with self._changed:
            self._pending.append(mine)
            self._changed.notify_all()
            while self._leading and not mine.done:
                self._changed.wait()
            if mine.done:  # a leader took it
                return mine.result()
            self._leading = True
            deadline = time.monotonic() + self.window_s
            while len(self._pending) < self._decoders and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(left)
            batch, self._pending = self._pending, []
        try:
            with self.lock:
                logits = decode(self.adapter, [s.cache for s in batch], [s.token for s in batch],
                                [s.position for s in batch], [s.drafts for s in batch])
                for s, rows in zip(batch, logits, strict=True):
                    s.logits = rows
        except BaseException as e:  # every caller of the batch gets it; the batcher goes on
            for s in batch:
                s.error = e
        finally:
            with self._changed:
                for s in batch:
                    s.done = True
                self._leading = False
                self.counters["batches"] += 1
                self.counters["rows"] += len(batch)
                self.counters["largest"] = max(self.counters["largest"], len(batch))
                self.counters["drafted"] += sum(len(s.drafts) for s in batch)
                self._changed.notify_all()
        return mine.result()
