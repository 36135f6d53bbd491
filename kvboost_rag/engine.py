"""The engine: ingest documents as stored KV chunks, answer prompts assembled from them.

    engine = KVBoost.from_pretrained()                 # bundled SmolLM2-135M-Instruct
    engine.ingest(["doc one ...", "doc two ..."])
    out = engine.generate(prompt, max_new_tokens=64, strategy="cacheblend")

A request: split the prompt into fixed text and ingested documents, plan where each chunk's KV
comes from (exact prefix hit, approximate content hit, or compute), assemble the cache, run the
strategy's prefill (which decides what to recompute), then decode; concurrent streams' decode steps
run as one forward (batching.py). `ttft_ms` covers all of it up to the first token's logits.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import batching, drift, fidelity, ingestion, lookahead, matching, models, shadow
from . import calibrate as calibration
from . import keys as keyring
from .adapter import ModelAdapter
from .assembly import (
    COMPUTE,
    EXACT,
    Plan,
    TokenizedPrompt,
    ingestion_context,
    plan,
    tokenize_prompt,
)
from .chunking import chunk_document
from .config import EngineConfig, RepairConfig, check_doc_context, check_for_model
from .generation import SamplingParams, TextStream, choose_token
from .kvcache import KVBuffers
from .repair import get_strategy, guard, routes
from .store import make_index, make_store
from .store.base import KVEntry, KVStore
from .store.documents import Document
from .tokens import bos_ids, check_text, eos_ids, tokenizer_digest

Messages = Sequence[dict]

@dataclass(frozen=True)
class Prefill:
    """A prompt's cache after the strategy's prefill, ready to decode from."""

    plan: Plan
    cache: KVBuffers
    logits: torch.Tensor  # [V] fp32, the next-token distribution after the prompt
    recomputed_tokens: int
    strategy: str
    started: float  # perf_counter at the call
    ttft_ms: float  # from the call to these logits, everything included
    # The fidelity guard (fidelity.py): what the request is held to (a risk per answer, or its level's floor
    # curve; None: the cache is exact, nothing to guard; inf: "fast", measured but never acted on), the risk its
    # first token took, and whether the prefill fell back to a full one (in float32 or, guard.HALF, bf16) because
    # that first token was not trusted.
    target: float | fidelity.Predictor | None = None
    risk: float = 0.0
    fell_back: bool = False
    curve: fidelity.Predictor | None = None  # the guard's flip curve, for this request's recompute budget
    # The recompute budget the served cache was repaired at (a guarded strategy's: its level's or recompute_ratio,
    # larger when the guard escalated, 1.0 when it fell back to a full prefill); None for the other strategies.
    recompute_budget: float | None = None
    # The step of the guard's ladder that serves the first token (guard.Served), and what the stream needs to go
    # on guarding: the request's policy (None: unguarded) and how to build its cache again.
    served: tuple[guard.Served, ...] = ()
    policy: guard.Policy | None = None
    builder: guard.Builder | None = None
    judged: tuple[guard.Judged, ...] = ()  # the guard's judgments so far, for a shadow check (shadow.py)

    @property
    def prompt_tokens(self) -> int:
        return self.plan.num_tokens

    @property
    def reused_tokens(self) -> int:
        return self.prompt_tokens - self.recomputed_tokens

    @property
    def exact_tokens(self) -> int:
        """Reused tokens that were exact prefix hits (a hit the strategy computed again is not reused)."""
        return min(self.plan.count(EXACT), self.reused_tokens)


@dataclass(frozen=True)
class Generation:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" (eos or a stop string) or "length"
    strategy: str
    ttft_ms: float
    total_ms: float
    prompt_tokens: int
    reused_tokens: int  # prompt tokens whose KV came from the store and was not recomputed
    exact_tokens: int  # of those, exact prefix hits
    # prompt tokens computed through every layer in this request (cacheblend: tokens run per repaired
    # layer, averaged over those layers, since its set shrinks layer by layer)
    recomputed_tokens: int
    # The fidelity guard (fidelity.py): the predicted chance that this answer differs from a full prefill's
    # (0 when every token came from an exact cache), whether the prefill fell back to a full one, and from
    # which generated token on the answer came from an exact cache (None: never).
    fidelity_estimate: float = 0.0
    fell_back: bool = False
    exact_from: int | None = None
    recompute_budget: float | None = None  # Prefill.recompute_budget: the served repair's budget (1.0: fell back)
    # The own tokens of the ingested documents found in the prompt's text, and how many of them came from the
    # store (seam tokens fused with the text around a document, and evicted chunks, are computed instead).
    document_tokens: int = 0
    document_tokens_reused: int = 0
    # Which step of the guard's ladder served each range of the answer's tokens, in order (repair/guard.py): a
    # step serves from its first_token to the next one's.
    served: tuple[guard.Served, ...] = ()
    fidelity: str | float | None = None  # the level it was held to (guard.held_to), None: unguarded

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class StreamPiece:
    text: str  # new text since the previous piece
    token_id: int | None
    result: Generation | None = None  # set on the last piece only


def _elapsed_ms(started: float, logits: torch.Tensor) -> float:
    """Milliseconds since `started` (perf_counter) once `logits` are computed: a GPU runs behind the host."""
    if logits.is_cuda:
        torch.cuda.synchronize(logits.device)
    return (time.perf_counter() - started) * 1e3


class KVBoost:
    def __init__(self, loaded: models.LoadedModel, config: EngineConfig | None = None,
                 store: KVStore | None = None):
        self.config = config = config or EngineConfig()
        self.tokenizer = loaded.tokenizer
        self.adapter = ModelAdapter(models.to_device(loaded.model, config.device), config.transposed_weights)
        check_for_model(config.repair, self.adapter.num_layers)
        self.model_id = loaded.model_id
        self._bos_ids = bos_ids(self.tokenizer)
        self._special_ids = frozenset(i for i, tok in self.tokenizer.added_tokens_decoder.items() if tok.special)
        self._doc_context = self._context_chunks(config.chunking.doc_context)
        self.fingerprint = keyring.model_fingerprint(
            model_id=loaded.model_id, weights_digest=loaded.weights_digest,
            config_digest=models.config_digest(loaded.model.config), dtype=models.dtype_name(self.adapter.dtype),
            tokenizer_digest=tokenizer_digest(self.tokenizer),
            encoding={"chunking": dataclasses.asdict(config.chunking),
                      "context": [list(tokens) for tokens, _ in self._doc_context]})
        self.store = store if store is not None else make_store(config.store, self.fingerprint)
        # A file beside the disk tier, shared through Redis when the store has a Redis tier (store/redis_documents.py).
        self.documents = make_index(config.store, self.fingerprint, self.store)
        disk_dir = config.store.disk_dir
        self._eos_ids = eos_ids(loaded.model, self.tokenizer)
        self._context_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # the ingestion context K/V
        # One forward at a time: the model and the store's write-back are shared by all callers.
        self.lock = batching.EngineLock()
        # Concurrent streams' decode steps, one forward per round (batching.py); a lone stream is a batch of one.
        self.batcher = batching.DecodeBatcher(self.adapter, self.lock)
        # What the engine did, for callers and tests: documents computed or found stored, chunks written back.
        self.counters: collections.Counter[str] = collections.Counter()
        # Drift maps fitted on this corpus and the fidelity guard's predictor (fidelity.py), fitted together by
        # `calibrate`: read back from the file beside the disk tier, else from the Redis tier (see calibrate.py).
        self.fidelity_path = Path(disk_dir) / f"fidelity-{self.fingerprint[:16]}.safetensors" if disk_dir else None
        self.drift_path = Path(disk_dir) / f"drift-{self.fingerprint[:16]}.safetensors" if disk_dir else None
        self.predictor = calibration.saved(self, "fidelity")
        self.drift = calibration.saved(self, "drift")
        self._warned_small = False
        self._warned_lost: set[str] = set()  # documents whose lost tokens were warned about
        # Online calibration: a share of the guarded answers checked against a full prefill in the background.
        self.shadow = shadow.Shadow(self, config.shadow_share, config.shadow_share_young, config.shadow_queue)
        # Which steps of the guard's ladder pay for themselves on this machine (repair/routes.py), as last saved.
        self.routes = routes.restored(self.predictor and self.predictor.routes, enabled=config.ladder_costs)
        self.accounts = {"balanced": fidelity.Account(config.floor_credit)}  # levels held on average (fidelity.py)
        self._half: ModelAdapter | bool | None = None  # the model in bf16 (half_adapter); False: there is none

    @classmethod
    def from_pretrained(cls, name_or_path: str | None = None, *, dtype: str = "float32",
                        config: EngineConfig | None = None, **config_overrides) -> KVBoost:
        """The bundled SmolLM2-135M-Instruct when no name is given; else a local folder or hub id. Loaded in
        `config.dtype` on `config.device` (EngineConfig fields, also given as keywords: device="cuda")."""
        config = config or EngineConfig(dtype=dtype)
        if config_overrides:
            config = dataclasses.replace(config, **config_overrides)
        return cls(models.load(name_or_path, dtype=config.dtype, device=config.device), config)

    # ---- ingestion -------------------------------------------------------------------------

    def ingest(self, texts: Sequence[str], *, pin: bool = False, progress: bool | None = None,
               calibrate: bool | None = None, layout: str | None = None) -> list[str]:
        """Precompute and store the KV of each document; returns their ids. Idempotent.

        With `calibrate` (None: EngineConfig.calibrate, True by default), once the engine knows enough documents,
        and again whenever the corpus has doubled (by 32 documents at least), the drift maps and the fidelity
        guard are fitted on it (see calibrate.py), on prompts laid out by `layout` (prompts.LAYOUTS; None:
        EngineConfig.calibration_layout)."""
        calibrate = self.config.calibrate if calibrate is None else calibrate
        if isinstance(texts, str):
            raise TypeError("ingest takes a list of documents; wrap a single one: ingest([text])")
        docs = []
        for i, text in enumerate(texts):
            try:
                docs.append(self.document(text))
            except ValueError as e:
                raise ValueError(f"document {i}: {e}") from None
        bar = tqdm(total=len(docs), desc="ingest", unit="doc", disable=not progress if progress is not None else None)
        for batch in ingestion.batches(docs, self.config.ingest_batch_tokens):
            with self.lock:
                keys = {doc.doc_id: self._chunk_keys(doc) for doc in batch}
                todo = {doc.doc_id: doc for doc in batch
                        if not all(self.store.contains(pkey) for _, (pkey, _) in keys[doc.doc_id])}
                encoded = dict(zip(todo, self._encode_after_context(list(todo.values())), strict=True))
                for doc in batch:
                    self._store_document(doc, keys[doc.doc_id], pin, encoded.pop(doc.doc_id, None))
            bar.update(len(batch))
        bar.close()
        ids = [doc.doc_id for doc in docs]
        if calibrate and calibration.due(self):
            self.calibrate(progress=progress, layout=layout)
        elif calibrate and self.predictor is None and not self._warned_small:
            self._warned_small = True
            warnings.warn(f"kvboost-rag: {len(self.documents)} documents are too few to calibrate on (it takes "
                          f"{calibration.MIN_DOCUMENTS}); the fidelity guard uses the model's default curve until "
                          "the corpus is large enough", stacklevel=2)
        return ids

    def calibrate(self, texts: Sequence[str] | None = None, **options) -> fidelity.Predictor:
        """Fit the drift maps and the fidelity guard on the corpus now (see calibrate.calibrate)."""
        if texts is not None:
            self.ingest(list(texts), progress=False, calibrate=False)
        return calibration.calibrate(self, texts, **options)

    def half_adapter(self) -> ModelAdapter | None:
        """The model in bf16, for the guard's HALF step and the dtype floor (repair/guard.py); made when first asked."""
        if self._half is None:
            self._half = (self.config.bf16_step and guard.half_adapter(self.adapter)) or False
        return self._half or None

    def set_drift(self, maps: drift.DriftMaps) -> None:
        """Use these drift maps from now on, and save them beside the store (disk tier's folder, Redis tier)."""
        self.drift = maps.to(self.adapter.device)
        calibration.save(self, "drift", drift.to_bytes(maps, self.fingerprint))

    def set_predictor(self, predictor: fidelity.Predictor) -> None:
        """Use this fidelity predictor from now on; save it, with the ladder's routes so far, beside the store."""
        self.predictor = predictor
        calibration.save(self, "fidelity", fidelity.to_bytes(predictor, self.fingerprint, self.routes.to_json()))

    def document(self, text: str) -> Document:
        """The ingested form of a document's text (tokens and chunks), made if needed; not stored."""
        if not check_text(text, "the document").strip():
            raise ValueError("empty document: every document needs some text; drop empty ones before ingesting")
        text = text.strip()
        known = self.documents.get(text)
        if known is not None:
            return known
        token_ids, chunks = chunk_document(text, self.tokenizer, self.config.chunking.max_chunk_tokens)
        if len(token_ids) > self.adapter.max_context:
            raise ValueError(f"document of {len(token_ids)} tokens exceeds the model's context window "
                             f"({self.adapter.max_context}); split it into smaller documents")
        doc_id = keyring.content_key(self.fingerprint, token_ids).hex()
        return Document(doc_id, text, tuple(token_ids), tuple(chunks))

    def _store_document(self, doc: Document, chunk_keys: list, pin: bool,
                        encoded: ingestion.Encoded | None) -> None:
        """Store `doc`'s chunks (`chunk_keys`, from _chunk_keys) from `encoded` (its tokens after the context and a
        reader of their K/V; None when it was found stored). Stored only once every chunk is computed: nothing
        half-computed is ever stored. The context chunks every document shares are written once, not once each."""
        self.counters["documents_computed" if encoded is not None else "documents_stored"] += 1
        pinned: list[bytes] = []
        try:
            for (start, end), (pkey, ckey) in chunk_keys:
                if self.store.contains(pkey):
                    if not pin or self.store.is_pinned(pkey):
                        continue
                    if self.store.pin(pkey):  # stored, not pinned yet: pinned as it is stored
                        pinned.append(pkey)
                        continue
                if encoded is None:  # listed as stored, but gone or unreadable since
                    encoded = self._encode_after_context([doc])[0]
                ids, read = encoded
                k, v = read(start, end)
                self.store.put(KVEntry(k, v, tuple(ids[start:end].tolist()), start, pkey, ckey), pin=pin)
                if pin:
                    pinned.append(pkey)
        except ValueError:
            # A pin that does not fit the budget: this document pins nothing rather than its first chunks.
            for pkey in pinned:
                self.store.unpin(pkey)
            raise
        self.documents.add(doc)

    def _encode_after_context(self, docs: list[Document]) -> list[ingestion.Encoded]:
        """The documents' K/V after the ingestion context (see ingestion.encode_after_context)."""
        context_ids = [t for tokens, _ in self._doc_context for t in tokens]
        if self._context_cache is None and context_ids:
            self._context_cache = ingestion.encode_context(self.adapter, context_ids)
        return ingestion.encode_after_context(self.adapter, docs, context_ids, self._context_cache)

    def _chunk_keys(self, doc: Document) -> list[tuple[tuple[int, int], tuple[bytes, bytes]]]:
        return ingestion.chunk_keys(self.fingerprint, self._doc_context, doc)

    def _context_chunks(self, doc_context: str) -> list[tuple[tuple[int, ...], bool]]:
        """The chunks a document is encoded after at ingestion (see ChunkingConfig.doc_context)."""
        return ingestion_context(check_doc_context(doc_context), self.render, self.tokenizer,
                                 self.config.chunking.max_chunk_tokens, self._bos_ids, self._special_ids)

    def close(self) -> None:
        """Flush and release the store (the disk tier's index is written here), and write any document
        record a full or read-only folder held back."""
        self.shadow.close()
        self.documents.flush()
        self.store.close()

    def __enter__(self) -> KVBoost:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- prompts ---------------------------------------------------------------------------

    def render(self, prompt: str | Messages) -> str:
        """A chat (list of {"role", "content"}) through the model's chat template; a string as it is."""
        if isinstance(prompt, (str, bytes, bytearray)):
            return check_text(prompt, "the prompt")  # bytes are refused there, with what to do
        for message in prompt:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, (str, bytes, bytearray)):
                check_text(content, "a message's content")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{self.model_id} has no chat template: pass the prompt as a plain string")
        return self.tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)

    def tokenize(self, text: str) -> TokenizedPrompt:
        """A rendered prompt's chunks, with the ingested documents it holds on its own token boundaries."""
        return tokenize_prompt(text, self.documents, self.tokenizer, self.config.chunking.max_chunk_tokens,
                               self._bos_ids, self._special_ids)

    def plan(self, prompt: str | Messages, strategy: str) -> Plan:
        """Where each of the prompt's chunks comes from, by what `strategy` (a registered name) reuses."""
        reuses = get_strategy(strategy)
        tokenized = self.tokenize(self.render(prompt))
        if not tokenized.chunks:
            raise ValueError("empty prompt: give some text to answer")
        matching.warn_lost(tokenized.matches, tokenized.prompt_ids, self.tokenizer, self._warned_lost)
        return plan(tokenized.chunks, self.fingerprint, self.store, reuses.reuse_exact, reuses.reuse_content,
                    tokenized.sources, tokenized.document_tokens, tokenized.segments)

    @torch.inference_mode()
    def prefill(self, prompt: str | Messages, strategy: str = "cacheblend", *, max_new_tokens: int = 0,
                write_back: bool = True, repair: RepairConfig | None = None) -> Prefill:
        """Assemble and prefill the prompt's cache with room for `max_new_tokens` more tokens."""
        started = time.perf_counter()
        settings = check_for_model(repair or self.config.repair, self.adapter.num_layers)
        chosen = get_strategy(strategy)
        # Rendered, tokenized and planned before the lock, which guards the forwards: the tokenizer, the document index
        # and the store are thread-safe, and a long prompt's preparation must not delay other requests' prefills and
        # decode steps (issue 40).
        p = self.plan(prompt, strategy)
        settings, n = guard.held_to(settings, p, self.config.strict_likeness), p.num_tokens  # likeness.py
        if n + max_new_tokens > self.adapter.max_context:
            raise ValueError(f"prompt of {n} tokens plus {max_new_tokens} new tokens exceeds the model's "
                             f"context window ({self.adapter.max_context}); shorten the prompt or retrieve "
                             "fewer documents")
        with self.lock:
            maps = self.drift if chosen.maps_drift and settings.drift else None
            builder = guard.Builder(self.adapter, p, chosen, settings, maps, n + max_new_tokens, self.lock, self.routes,
                                    self.half_adapter, [] if self.shadow.on else None)
            policy = guard.policy(chosen, settings, p, self.predictor, self.config.store.kv_bits,
                                  self.config.escalate_to, self.accounts)
            built, watch, served = guard.start(builder, policy)
            ttft_ms = _elapsed_ms(started, built.logits)
            if write_back and (chosen.reuse_exact or chosen.reuse_content):
                self._write_back(p, built.cache)
        fell_back = served[0].step in (guard.HALF, guard.FULL)  # a full prefill, in either dtype
        return Prefill(p, built.cache, built.logits, built.recomputed_tokens, strategy, started, ttft_ms,
                       None if policy is None else policy.target, 0.0 if watch is None else watch.risk, fell_back,
                       None if policy is None else policy.curve(policy.budget), served[-1].budget, served, policy,
                       builder, () if watch is None else tuple(watch.judged))

    @torch.inference_mode()
    def reference_prefill(self, p: Plan, *, max_new_tokens: int = 0) -> Prefill:
        """A full prefill of exactly `p`'s tokens, nothing reused: the truth to compare a strategy with."""
        started, n = time.perf_counter(), p.num_tokens
        cache, logits = guard.exact_cache(self.adapter, self.lock, p.token_ids, n + max_new_tokens)
        return Prefill(p, cache, logits, n, "full", started, _elapsed_ms(started, logits))

    def fit_drift(self, texts: Sequence[str] | None = None, *, prompts: int = 24, per_prompt: int = 8,
                  seed: int = 0, layout: Callable[[list[str]], str | Messages] | None = None,
                  places: int = drift.PLACES) -> drift.DriftMaps:
        """Fit drift maps alone on this corpus and use them from now on (see calibrate.fit_drift); `calibrate`,
        which ingestion runs by itself, fits them with the fidelity guard."""
        return calibration.fit_drift(self, texts, prompts=prompts, per_prompt=per_prompt, seed=seed, layout=layout,
                                     places=places)

    def _write_back(self, p: Plan, cache: KVBuffers) -> None:
        """Store the chunks this request computed with exact context under their prefix keys."""
        for chunk in p.chunks:
            if chunk.source == COMPUTE and chunk.exact_context and not self.store.contains(chunk.prefix_key):
                k, v = cache.read(chunk.start, chunk.end)
                self.store.put(KVEntry(k, v, chunk.token_ids, chunk.start, chunk.prefix_key, chunk.content_key))
                self.counters["chunks_written_back"] += 1

    # ---- generation ------------------------------------------------------------------------

    @torch.inference_mode()
    def decode_step(self, cache: KVBuffers, token_id: int, position: int) -> torch.Tensor:
        """Append one token at `position`, alone (streams decode through `batcher`); the next-token logits [V]."""
        with self.lock:
            return batching.decode(self.adapter, [cache], [token_id], [position])[0][0]

    @torch.inference_mode()
    def continuation_logits(self, pre: Prefill, token_ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced: logits after each of `token_ids` appended to the prompt. [T, V] fp32.

        Needs the prefill made with max_new_tokens >= len(token_ids)."""
        with self.lock:
            return self.adapter.logits(guard.appended(self.adapter, pre.cache, pre.prompt_tokens, token_ids))

    def stream(self, prompt: str | Messages, *, max_new_tokens: int = 64, strategy: str = "cacheblend",
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, stop: Sequence[str] = (),
               seed: int | None = None, repair=None, write_back: bool = True) -> Iterator[StreamPiece]:
        """Prefill with `strategy`, then decode; yields text as it comes, the figures on the last piece."""
        params = SamplingParams(max_new_tokens, temperature, top_p, top_k, stop, seed)  # checked at the call
        get_strategy(strategy)
        return self._prefill_then_decode(prompt, strategy, params, repair, write_back)

    def _prefill_then_decode(self, prompt, strategy, params, repair, write_back) -> Iterator[StreamPiece]:
        # A generator: the prefill runs at the first next(), so that a caller stepping the stream on a worker
        # thread (serving.astream_pieces) runs it there too, not on its event loop.
        yield from self.stream_from(self.prefill(prompt, strategy, max_new_tokens=params.max_new_tokens,
                                                 repair=repair, write_back=write_back), params)

    def stream_from(self, pre: Prefill, params: SamplingParams) -> Iterator[StreamPiece]:
        """Decode from a prefilled cache (made with room for params.max_new_tokens)."""
        generator = (torch.Generator(self.adapter.device).manual_seed(params.seed) if params.seed is not None
                     else None)
        text = TextStream(self.tokenizer, params.stop)
        logits, position, finish, cache = pre.logits, pre.prompt_tokens, "length", pre.cache
        # The guard goes on where the prefill left it: every token from a reused cache adds its risk, and before one
        # would pass the target the request climbs its ladder (repair/guard.py) to a cache it can trust.
        watch = guard.resume(pre.policy, pre.builder, pre.served, pre.risk, pre.judged, pre.logits)
        ahead = lookahead.Lookahead(pre.plan.token_ids, self.config.lookahead if params.temperature == 0 else 0)
        # The lock is taken per step (by the batcher), never across a yield: async callers resume us from
        # other threads. While it decodes, the stream is counted so that a batch waits for its step.
        with self.batcher.decoding():
            for step in range(params.max_new_tokens):
                token = choose_token(logits, params, generator)
                if token in self._eos_ids:
                    finish = "stop"
                    break
                delta = text.add(token)
                if text.stopped:
                    finish = "stop"
                    if delta:
                        yield StreamPiece(delta, token)
                    break
                yield StreamPiece(delta, token)
                if step + 1 < params.max_new_tokens:
                    logits = ahead.next(self.batcher, cache, token, position, params.max_new_tokens - step - 2)
                    position += 1
                    if watch is not None and not watch.trusts(logits):
                        built = watch.climb(text.token_ids)
                        cache, logits = built.cache, built.logits
        if watch is not None:
            watch.finish()
        served = pre.served if watch is None else tuple(watch.served)
        risk = pre.risk if watch is None else watch.risk
        tail = text.flush()
        if pre.policy is not None and pre.policy.acts:  # queued only; run once the engine is idle (shadow.py)
            self.shadow.offer(shadow.Check(pre.plan.token_ids, tuple(text.token_ids),
                                           pre.judged if watch is None else tuple(watch.judged), risk,
                                           tuple(pre.plan.segments), pre.builder.due(), pre.builder), pre.curve)
        result = Generation(
            text=text.text, token_ids=tuple(text.token_ids), finish_reason=finish, strategy=pre.strategy,
            ttft_ms=pre.ttft_ms, total_ms=(time.perf_counter() - pre.started) * 1e3,
            prompt_tokens=pre.prompt_tokens, reused_tokens=pre.reused_tokens, exact_tokens=pre.exact_tokens,
            recomputed_tokens=pre.recomputed_tokens, fidelity_estimate=risk,
            fell_back=pre.fell_back, exact_from=next((s.first_token for s in served if s.step == guard.FULL), None),
            recompute_budget=pre.recompute_budget, served=served, fidelity=pre.policy and pre.policy.fidelity,
            document_tokens=pre.plan.document_tokens, document_tokens_reused=pre.plan.document_tokens_reused)
        yield StreamPiece(tail, None, result)

    def generate(self, prompt: str | Messages, **kwargs) -> Generation:
        """Run `stream` to the end; see it for the arguments."""
        for piece in self.stream(prompt, **kwargs):
            if piece.result is not None:
                return piece.result
        raise AssertionError("stream ended without a result")
