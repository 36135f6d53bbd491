"""The engine: ingest documents as stored KV chunks, answer prompts assembled from them.

    engine = KVBoost.from_pretrained()                 # bundled SmolLM2-135M-Instruct
    engine.ingest(["doc one ...", "doc two ..."])
    out = engine.generate(prompt, max_new_tokens=64, strategy="cacheblend")

A request: split the prompt into fixed text and ingested documents, plan where each chunk's KV
comes from (exact prefix hit, approximate content hit, or compute), assemble the cache, run the
strategy's prefill (which decides what to recompute), then decode. `ttft_ms` covers all of it up
to the first token's logits.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash
from tqdm.auto import tqdm

from . import drift, models
from . import keys as keyring
from .adapter import ModelAdapter
from .assembly import (
    COMPUTE,
    EXACT,
    Plan,
    TokenizedPrompt,
    assemble,
    plan,
    segments_text,
    tokenize_context,
    tokenize_prompt,
)
from .calibration import document_spans, retrieval_heads, template_suffix_tokens
from .chunking import chunk_document
from .config import EngineConfig, check_doc_context, check_for_model, check_strategy
from .documents import Document, DocumentIndex
from .generation import SamplingParams, TextStream, choose_token
from .kvcache import KVBuffers
from .repair.cacheblend import cacheblend_prefill
from .repair.queryaware import check_config, move_last, queryaware_prefill, rank_documents, top_documents
from .repair.selective import selective_positions
from .store import make_store
from .store.base import KVEntry, KVStore

Messages = Sequence[dict]

# doc_context "passage": what a document is encoded after, so that its KV looks like a later document's.
# Written for kvboost-rag: neutral prose with no entity, number or name a question could ask about.
CONTEXT_PASSAGE = ("The notes below were gathered from several sources and arranged for easy reading. Each part "
                   "describes one subject on its own, in plain language, and the parts may be read in any order. "
                   "Some details were checked against older records, while others come from people who knew the "
                   "subject well. Where sources disagreed, the more recent account was kept. Small changes to "
                   "spelling and wording were made so that the parts read alike.")


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

    @property
    def prompt_tokens(self) -> int:
        return self.plan.num_tokens

    @property
    def reused_tokens(self) -> int:
        return self.prompt_tokens - self.recomputed_tokens

    @property
    def exact_tokens(self) -> int:
        return self.plan.count(EXACT)


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

    @property
    def generated_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class StreamPiece:
    text: str  # new text since the previous piece
    token_id: int | None
    result: Generation | None = None  # set on the last piece only


class KVBoost:
    def __init__(self, loaded: models.LoadedModel, config: EngineConfig | None = None,
                 store: KVStore | None = None):
        self.config = config = config or EngineConfig()
        self.tokenizer = loaded.tokenizer
        self.adapter = ModelAdapter(loaded.model)
        check_for_model(config.repair, self.adapter.num_layers)
        self.model_id = loaded.model_id
        self._bos_ids = _bos_ids(self.tokenizer)
        self._special_ids = frozenset(i for i, tok in self.tokenizer.added_tokens_decoder.items() if tok.special)
        self._doc_context = self._context_chunks(config.chunking.doc_context)
        self.fingerprint = keyring.model_fingerprint(
            model_id=loaded.model_id, weights_digest=loaded.weights_digest,
            config_digest=models.config_digest(loaded.model.config), dtype=models.dtype_name(self.adapter.dtype),
            tokenizer_digest=_tokenizer_digest(self.tokenizer),
            encoding={"chunking": dataclasses.asdict(config.chunking),
                      "context": [list(tokens) for tokens, _ in self._doc_context]})
        self.store = store if store is not None else make_store(config.store, self.fingerprint)
        disk_dir = config.store.disk_dir
        self.documents = DocumentIndex(Path(disk_dir) / f"documents-{self.fingerprint[:16]}.jsonl"
                                       if disk_dir else None, file_mode=config.store.file_mode)
        self._eos_ids = _eos_ids(loaded.model, self.tokenizer)
        self._context_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # see _context_kv
        self._blended = None
        # One forward at a time: the model and the store's write-back are shared by all callers.
        self.lock = threading.RLock()
        # What the engine did, for callers and tests: documents computed or found stored, chunks written back.
        self.counters: collections.Counter[str] = collections.Counter()
        # Drift maps fitted on this corpus (fit_drift), read back from the disk tier's folder when saved there.
        self.drift_path = Path(disk_dir) / f"drift-{self.fingerprint[:16]}.safetensors" if disk_dir else None
        self.drift = None
        if self.drift_path is not None and self.drift_path.exists():
            self.drift = drift.load(self.drift_path, self.fingerprint, self.adapter)
            if self.drift is None:
                warnings.warn(f"ignoring drift maps {self.drift_path}: not this model's, from an older kvboost-rag, "
                              "or damaged; refit them with fit_drift()", stacklevel=2)

    @classmethod
    def from_pretrained(cls, name_or_path: str | None = None, *, dtype: str = "float32",
                        config: EngineConfig | None = None, **config_overrides) -> KVBoost:
        """The bundled SmolLM2-135M-Instruct when no name is given; else a local folder or hub id."""
        config = config or EngineConfig(dtype=dtype)
        if config_overrides:
            config = dataclasses.replace(config, **config_overrides)
        return cls(models.load(name_or_path, dtype=config.dtype), config)

    # ---- ingestion -------------------------------------------------------------------------

    def ingest(self, texts: Sequence[str], *, pin: bool = False, progress: bool | None = None) -> list[str]:
        """Precompute and store the KV of each document; returns their ids. Idempotent."""
        if isinstance(texts, str):
            raise TypeError("ingest takes a list of documents; wrap a single one: ingest([text])")
        ids = []
        bar = tqdm(texts, desc="ingest", unit="doc", disable=not progress if progress is not None else None)
        for i, text in enumerate(bar):
            ids.append(self._ingest_one(text, i, pin).doc_id)
        return ids

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

    def _ingest_one(self, text: str, index: int, pin: bool) -> Document:
        try:
            doc = self.document(text)
        except ValueError as e:
            raise ValueError(f"document {index}: {e}") from None
        context = self._doc_context
        keys = keyring.chain(self.fingerprint, [tokens for tokens, _ in context] + doc.chunk_tokens())
        offset = sum(len(tokens) for tokens, _ in context)
        ends = list(itertools.accumulate(len(tokens) for tokens, _ in context))
        spans = list(zip([0, *ends], ends, strict=False)) + [(offset + c.start, offset + c.end) for c in doc.chunks]
        with self.lock:
            stored = all(self.store.contains(pkey) for pkey, _ in keys)
            self.counters["documents_stored" if stored else "documents_computed"] += 1
            cache = None if stored else self._encode_after_context(doc)
            # Stored only once every chunk is computed: nothing half-computed is ever stored. The context
            # chunks every document shares are written once, not once per document.
            pinned: list[bytes] = []
            try:
                for (start, end), (pkey, ckey) in zip(spans, keys, strict=True):
                    if self.store.contains(pkey):
                        if not pin or self.store.is_pinned(pkey):
                            continue
                        if self.store.pin(pkey):  # stored, not pinned yet: pinned as it is stored
                            pinned.append(pkey)
                            continue
                    if cache is None:  # listed as stored, but gone or unreadable since
                        cache = self._encode_after_context(doc)
                    k, v = cache[1].read(start, end)
                    self.store.put(KVEntry(k, v, tuple(cache[0][start:end].tolist()), start, pkey, ckey), pin=pin)
                    if pin:
                        pinned.append(pkey)
            except ValueError:
                # A pin that does not fit the budget: this document pins nothing rather than its first chunks.
                for pkey in pinned:
                    self.store.unpin(pkey)
                raise
            self.documents.add(doc)
        return doc

    def _encode_after_context(self, doc: Document) -> tuple[torch.Tensor, KVBuffers]:
        """The form a content hit is re-rotated from: the document after its ingestion context.
        Returns (token ids [N], their K/V). The context is the same for every document: its K/V are computed
        once per engine and the document's tokens attend to them, a third of an ingestion's compute saved."""
        context_ids = [t for tokens, _ in self._doc_context for t in tokens]
        ids = torch.tensor(context_ids + list(doc.token_ids))
        n, offset = ids.shape[0], len(context_ids)
        cache = self.adapter.new_buffers(n)
        with torch.inference_mode():
            if offset:
                cache.write(0, *self._context_kv(context_ids))
            self.adapter.run_layers(self.adapter.embed(ids[offset:]), torch.arange(offset, n), cache,
                                    range(self.adapter.num_layers), n)
        return ids, cache

    def _context_kv(self, context_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The ingestion context's K/V, [L, H_kv, C, D] each, computed on first use."""
        if self._context_cache is None:
            c = len(context_ids)
            cache = self.adapter.new_buffers(c)
            self.adapter.run_layers(self.adapter.embed(torch.tensor(context_ids)), torch.arange(c), cache,
                                    range(self.adapter.num_layers), c)
            self._context_cache = cache.read(0, c)
        return self._context_cache

    def _context_chunks(self, doc_context: str) -> list[tuple[tuple[int, ...], bool]]:
        """The chunks a document is encoded after at ingestion (see ChunkingConfig.doc_context)."""
        if check_doc_context(doc_context) == "none":
            return []
        marker = "\x00kvboost-doc\x00"
        try:
            rendered = self.render([{"role": "user", "content": marker}])
            opening = rendered[: rendered.index(marker)]
        except ValueError:
            opening = ""  # no chat template: nothing to encode after, or the passage alone (after BOS)
        if doc_context == "template" and not opening:
            return []
        segments = [opening] if opening else []
        if doc_context == "passage":
            segments += [CONTEXT_PASSAGE, "\n\n"]  # each its own chunk, as a prompt's documents and separators
        # Followed by a word, as a document follows them in a prompt (its text is stripped: no space first).
        return tokenize_context(segments, "Document", self.tokenizer, self.config.chunking.max_chunk_tokens,
                                self._bos_ids, self._special_ids)

    def close(self) -> None:
        """Flush and release the store (the disk tier's index is written here), and write any document
        record a full or read-only folder held back."""
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
        check_strategy(strategy)
        chunks = self.tokenize(self.render(prompt)).chunks
        if not chunks:
            raise ValueError("empty prompt: give some text to answer")
        use_exact = strategy != "full"
        use_approx = strategy in ("naive", "selective", "cacheblend")
        return plan(chunks, self.fingerprint, self.store, use_exact, use_approx)

    @torch.inference_mode()
    def prefill(self, prompt: str | Messages, strategy: str = "cacheblend", *, max_new_tokens: int = 0,
                write_back: bool = True, repair=None) -> Prefill:
        """Assemble and prefill the prompt's cache with room for `max_new_tokens` more tokens."""
        started = time.perf_counter()
        repair = check_for_model(repair or self.config.repair, self.adapter.num_layers)
        with self.lock:
            # queryaware reuses what naive reuses (exact and content hits), then repairs its own way.
            p = self.plan(prompt, "naive" if strategy == "queryaware" else strategy)
            n = p.num_tokens
            if n + max_new_tokens > self.adapter.max_context:
                raise ValueError(f"prompt of {n} tokens plus {max_new_tokens} new tokens exceeds the model's "
                                 f"context window ({self.adapter.max_context}); shorten the prompt or retrieve "
                                 "fewer documents")
            # cacheblend repairs the mapped K/V; queryaware ranks over the stored ones (relevance_last maps its own).
            cache = assemble(p, self.adapter, n + max_new_tokens,
                             drift=self._drift_maps(repair) if strategy == "cacheblend" else None)
            if strategy == "cacheblend":
                blend = cacheblend_prefill(self.adapter, cache, p, repair)
                hidden, recomputed = blend.hidden, blend.recomputed_tokens
            elif strategy == "queryaware" and repair.qa_order == "relevance_last":
                p, cache, hidden, recomputed = self._relevance_last(prompt, p, cache, repair, max_new_tokens)
            elif strategy == "queryaware":
                hidden, recomputed = self._queryaware_in_place(p, cache, repair)
            else:
                # selective: the heads of reused chunks too; full, prefix, naive: the tokens without stored KV
                positions = (selective_positions(p, repair.boundary_tokens) if strategy == "selective"
                             else p.computed_positions())
                hidden = self.adapter.run_layers(self.adapter.embed(p.token_ids[positions]), positions,
                                                 cache, range(self.adapter.num_layers), n)[:, -1:]
                recomputed = int(positions.numel())
            logits = self.adapter.logits(hidden)[-1]
            ttft_ms = (time.perf_counter() - started) * 1e3
            if write_back and strategy != "full":
                self._write_back(p, cache)
        return Prefill(p, cache, logits, recomputed, strategy, started, ttft_ms)

    @torch.inference_mode()
    def reference_prefill(self, p: Plan, *, max_new_tokens: int = 0) -> Prefill:
        """A full prefill of exactly `p`'s tokens, nothing reused: the truth to compare a strategy
        with, including one that rewrote the prompt (queryaware's relevance_last)."""
        started, n = time.perf_counter(), p.num_tokens
        with self.lock:
            cache = self.adapter.new_buffers(n + max_new_tokens)
            positions = torch.arange(n)
            hidden = self.adapter.run_layers(self.adapter.embed(p.token_ids), positions, cache,
                                             range(self.adapter.num_layers), n)
            logits = self.adapter.logits(hidden[:, -1:])[-1]
        return Prefill(p, cache, logits, n, "full", started, (time.perf_counter() - started) * 1e3)

    def _retrieval_heads(self, repair):
        """This engine's calibrated retrieval heads (see `calibration.retrieval_heads`)."""
        return retrieval_heads(self, max_heads=repair.qa_heads, items=repair.qa_calib_items)

    def _drift_maps(self, repair) -> drift.DriftMaps | None:
        """The engine's fitted drift maps, at `repair.drift_strength`, when `repair.drift` asks for them; None
        when off or never fitted."""
        drift.check_strength(repair.drift_strength)
        if not repair.drift or self.drift is None:
            return None
        if repair.drift_strength == 1.0:
            return self.drift
        held = self._blended  # (maps, strength, blended): one request's blend serves the next
        if held is None or held[0] is not self.drift or held[1] != repair.drift_strength:
            self._blended = held = (self.drift, repair.drift_strength, drift.blend(self.drift, repair.drift_strength))
        return held[2]

    def fit_drift(self, texts: Sequence[str] | None = None, *, prompts: int = 24, per_prompt: int = 8,
                  seed: int = 0, layout: Callable[[list[str]], str | Messages] | None = None,
                  places: int = drift.PLACES) -> drift.DriftMaps:
        """Fit drift maps on this corpus (see `drift.py`) and use them from now on: `prompts` prompts of
        `per_prompt` documents drawn from `texts` (ingested first), or from every ingested document, each laid
        out by `layout` (documents -> the application's prompt: its system text and template; the default is
        the documents alone as one user message), with one map per place for a prompt's first `places`
        documents (the last serving every later one). Costs about one full prefill per prompt; saved next to
        the disk tier, where the next engine finds them."""
        pool = list(texts) if texts is not None else self.documents.texts()
        if texts is not None:
            self.ingest(pool, progress=False)
        if len(pool) < 2:
            raise ValueError(f"fit_drift needs at least two ingested documents, got {len(pool)}: ingest the "
                             "corpus first")
        with self.lock:
            maps = drift.fit(self, drift.calibration_prompts(self, pool, prompts, per_prompt, seed,
                                                             layout or drift.bare_layout), places)
            self.drift = maps
            if self.drift_path is not None:
                drift.save(maps, self.drift_path, self.fingerprint, mode=self.config.store.file_mode)
        return maps

    def _queryaware_in_place(self, p: Plan, cache: KVBuffers, repair) -> tuple[torch.Tensor, int]:
        """queryaware with the documents where they are: (last hidden, tokens run through every layer)."""
        hidden, positions = queryaware_prefill(self.adapter, cache, p, repair, self._retrieval_heads(repair),
                                               template_suffix_tokens(self))
        return hidden, int(positions.numel())

    def _relevance_last(self, prompt: str | Messages, p: Plan, cache: KVBuffers, repair,
                        max_new_tokens: int) -> tuple[Plan, KVBuffers, torch.Tensor, int]:
        """queryaware with qa_order="relevance_last": rank the documents over the naive cache, move
        the chosen ones after the others (a new prompt), then recompute them and the uncached tokens
        through every layer, and repair the other documents as `cacheblend` does (`recompute_ratio`)."""
        check_config(repair)
        heads = list(self._retrieval_heads(repair).heads[:max(repair.qa_heads, 1)])
        spans = document_spans(p)
        segments = self.tokenize(self.render(prompt)).segments
        if not spans or repair.qa_docs <= 0 or len(spans) != sum(isinstance(s, Document) for s in segments):
            # Documents back to back (no text between them) share a span: keep the prompt's order.
            return p, cache, *self._queryaware_in_place(p, cache, repair)
        scores, _, _ = rank_documents(self.adapter, cache, p, spans, heads, template_suffix_tokens(self))
        chosen = top_documents(scores, repair.qa_docs)
        moved = plan(self.tokenize(segments_text(move_last(segments, chosen))).chunks, self.fingerprint, self.store,
                     True, True)
        if len(document_spans(moved)) != len(spans):
            # A moved document no longer sits on its own token boundaries: keep the prompt's order.
            return p, cache, *self._queryaware_in_place(p, cache, repair)
        p = moved
        cache = assemble(p, self.adapter, p.num_tokens + max_new_tokens, drift=self._drift_maps(repair))
        k, spans = len(spans), document_spans(p)
        # The chosen documents, now the last ones, run every layer; the others get CacheBlend's repair.
        pinned = torch.cat([torch.arange(*spans[i]) for i in range(k - len(chosen), k)])
        blend = cacheblend_prefill(self.adapter, cache, p, repair, pinned=pinned)
        return p, cache, blend.hidden, blend.recomputed_tokens

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
        """Append one token at `position`; returns the next-token logits [V]."""
        with self.lock:
            hidden = self.adapter.embed(torch.tensor([token_id]))
            hidden = self.adapter.run_layers(hidden, torch.tensor([position]), cache,
                                             range(self.adapter.num_layers), position + 1)
            return self.adapter.logits(hidden)[-1]

    @torch.inference_mode()
    def continuation_logits(self, pre: Prefill, token_ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced: logits after each of `token_ids` appended to the prompt. [T, V] fp32.

        Needs the prefill made with max_new_tokens >= len(token_ids)."""
        n, t = pre.prompt_tokens, len(token_ids)
        positions = torch.arange(n, n + t)
        with self.lock:
            hidden = self.adapter.run_layers(self.adapter.embed(torch.tensor(list(token_ids))), positions,
                                             pre.cache, range(self.adapter.num_layers), n + t)
            return self.adapter.logits(hidden)

    def stream(self, prompt: str | Messages, *, max_new_tokens: int = 64, strategy: str = "cacheblend",
               temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, stop: Sequence[str] = (),
               seed: int | None = None, repair=None, write_back: bool = True) -> Iterator[StreamPiece]:
        """Prefill with `strategy`, then decode; yields text as it comes, the figures on the last piece."""
        params = SamplingParams(max_new_tokens, temperature, top_p, top_k, stop, seed)
        pre = self.prefill(prompt, strategy, max_new_tokens=max_new_tokens, repair=repair, write_back=write_back)
        return self.stream_from(pre, params)

    def stream_from(self, pre: Prefill, params: SamplingParams) -> Iterator[StreamPiece]:
        """Decode from a prefilled cache (made with room for params.max_new_tokens)."""
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        text = TextStream(self.tokenizer, params.stop)
        logits, position, finish = pre.logits, pre.prompt_tokens, "length"
        # The lock is taken per step, never across a yield: async callers resume us from other threads.
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
                logits = self.decode_step(pre.cache, token, position)
                position += 1
        tail = text.flush()
        result = Generation(
            text=text.text, token_ids=tuple(text.token_ids), finish_reason=finish, strategy=pre.strategy,
            ttft_ms=pre.ttft_ms, total_ms=(time.perf_counter() - pre.started) * 1e3,
            prompt_tokens=pre.prompt_tokens, reused_tokens=pre.reused_tokens, exact_tokens=pre.exact_tokens,
            recomputed_tokens=pre.recomputed_tokens)
        yield StreamPiece(tail, None, result)

    def generate(self, prompt: str | Messages, **kwargs) -> Generation:
        """Run `stream` to the end; see it for the arguments."""
        for piece in self.stream(prompt, **kwargs):
            if piece.result is not None:
                return piece.result
        raise AssertionError("stream ended without a result")



def _tokenizer_digest(tokenizer) -> str:
    """A hash of everything that decides token ids: the whole tokenizer (vocabulary, merges, normalizer,
    pre-tokenizer, added tokens) where it can be serialized, else its vocabulary and added tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        described = backend.to_str()
    else:
        described = repr((sorted(tokenizer.get_vocab().items()), sorted(tokenizer.added_tokens_decoder)))
    return xxhash.xxh3_128_hexdigest(f"{type(tokenizer).__name__}:{described}".encode())


def check_text(text: object, what: str) -> str:
    """`text` when it is a str a tokenizer can take; else a ValueError that says what to pass instead."""
    if isinstance(text, (bytes, bytearray)):
        raise ValueError(f"{what} is bytes, not text: decode it first, e.g. data.decode('utf-8')")
    if not isinstance(text, str):
        raise ValueError(f"{what} is {type(text).__name__}, not text: pass a str (a document's or prompt's text)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} holds a lone surrogate ({text[e.start]!r} at character {e.start}), which is not "
                         "valid Unicode: repair the text, e.g. text.encode('utf-8', 'replace').decode()") from None
    return text


def _bos_ids(tokenizer) -> tuple[int, ...]:
    """Special tokens the tokenizer puts before any text (Llama's <s>); none for SmolLM2 or Qwen."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    special = tokenizer("a", add_special_tokens=True)["input_ids"]
    return tuple(special[: len(special) - len(plain)]) if special[-len(plain):] == plain else ()


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return ids
