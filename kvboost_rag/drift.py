"""Drift correction: affine maps from a document's K/V as stored to its K/V inside a prompt.

A stored document was encoded after its ingestion context (ChunkingConfig.doc_context: nothing, or a
neutral passage) instead of the prompt's own text; inside a prompt the same tokens would have attended to
that text, so their K/V at every layer after the first have drifted. Part of that drift is shared by the
documents of a corpus: the tokens attended to their own first token (an attention sink, when encoded
alone) or to the passage, instead of the prompt's text before them. An affine map per layer and KV head,
fitted by ridge least squares from stale to true K/V on prompts made of the corpus's own documents,
removes that shared part before repair; what is left is the prompt-specific drift that CacheBlend's
recompute is for. Keys are mapped in the unrotated frame, where a token's key does not depend on its
position.

The drift depends on the document's place: the first document of a prompt follows only the template,
the eighth follows seven documents. One map for every place is pulled towards the later places (most of
the calibration tokens) and misplaces the first document: the question then barely reads it, and answers
held there were lost (0 of 37 held-out items right, where a full prefill gets 12). So there is one map per
place, the i-th reused chunk of a prompt (the last map takes every chunk after it): 9 of 37 right
(research/notebook.md, round 7). Same cost per request: one map per chunk either way.

The maps belong to a corpus, not only to a model: maps fitted on the synthetic look-alike documents
make CPython documentation passages worse (research/notebook.md, round 4), maps fitted on other passages of
the same documentation improve them. So they are fitted on what the engine has ingested
(`KVBoost.fit_drift`, typically at the end of an ingestion job) and saved next to the store's disk tier,
and in its Redis tier when it has one (calibrate.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import safetensors.torch
import torch
from tqdm.auto import tqdm

from .store.files import safetensors_metadata

VERSION = 2
RIDGE = 1e-2  # keeps the normal equations well posed for channels that barely vary
MIN_ROWS = 4  # calibration tokens a place's own map needs, per input (D + 1 of them): else it overfits
PLACES = 8  # maps per place fitted by default: about the documents a retriever returns per prompt


@dataclass(frozen=True)
class DriftMaps:
    keys: torch.Tensor  # [P, L, H_kv, D + 1, D] fp32: unrotated stale key (and a 1) -> unrotated true key
    values: torch.Tensor  # [P, L, H_kv, D + 1, D] fp32
    prompts: int  # calibration prompts fitted on

    def to(self, device: torch.device) -> DriftMaps:
        """The maps on `device` (the model's), where `place` uses them."""
        return DriftMaps(self.keys.to(device), self.values.to(device), self.prompts)

    @property
    def places(self) -> int:
        """How many maps per layer and head: one for each of the first P - 1 reused chunks of a prompt, in
        order, and one for every chunk after them."""
        return self.keys.shape[0]


def _slot(index: int, places: int) -> int:
    """Which of `places` maps serves the `index`-th reused chunk of a prompt (fitting and serving alike)."""
    return min(index, places - 1)


def _affine(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [B, N, D] @ w: [B, D + 1, D] (the last row is the bias) -> [B, N, D], in fp32."""
    return torch.baddbmm(w[:, -1:], x.float(), w[:, :-1])


def _frame(adapter, start: int, count: int, layers: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos, sin for positions start .. start + count - 1, per layer (a model's layers may differ: local
    and global bases, layers without RoPE): [L' or 1, 1, count, R] fp32, broadcast over heads."""
    return adapter.rope_frame(torch.arange(start, start + count), layers)


# RoPE at per-token positions (the adapter's rotate_keys moves every token by one shift).
def _unrotate(adapter, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return adapter.apply_rope(keys, cos, sin, inverse=True)  # RoPE's inverse: angle -> -angle


def place(adapter, cache, entry, start: int, maps: DriftMaps, index: int = 0) -> None:
    """Write a stored chunk's K/V into `cache` at `start`, mapped by the maps of the `index`-th reused chunk of
    the prompt (layer 0's K/V do not depend on context: only moved). Done per chunk while the prompt is
    assembled, all mapped layers in one batched product over contiguous memory, written straight into the
    cache: gathering the reused positions from the assembled cache afterwards, layer by layer, cost 2.6 times
    as much (research/notebook.md, round 5)."""
    device = cache.all_keys.device  # stored K/V live in host memory; the maps are on the model's device
    keys = entry.keys.to(device, non_blocking=True)  # [L, H_kv, S, D]
    values = entry.values.to(device, non_blocking=True)
    layers, heads, count, dim = keys.shape
    slot = _slot(index, maps.places)
    key_maps, value_maps = maps.keys[slot], maps.values[slot]
    cached_keys, cached_values = cache.span(start, start + count)  # views: [L, H_kv, S, D]
    adapter.rotate_keys(keys[:1], start - entry.start, slice(0, 1), out=cached_keys[:1])
    cached_values[0] = values[0]
    # fp32 from the first product on (the frames are fp32); the last rotation writes straight into the cache
    unrotated = _unrotate(adapter, keys[1:], *_frame(adapter, entry.start, count, slice(1, None)))
    mapped = _affine(unrotated.flatten(0, 1), key_maps[1:].flatten(0, 1)).view(layers - 1, heads, count, dim)
    adapter.apply_rope(mapped, *_frame(adapter, start, count, slice(1, None)), out=cached_keys[1:])
    cached_values[1:] = _affine(values[1:].flatten(0, 1), value_maps[1:].flatten(0, 1)).view_as(mapped)


def bare_layout(documents: list[str]) -> list[dict]:
    """The documents as one user message (the chat template's default system text before them)."""
    return [{"role": "user", "content": "\n\n".join(documents)}]


def calibration_prompts(texts: Sequence[str], num_tokens: Callable[[str], int], room: int, count: int,
                        per_prompt: int, seed: int = 0,
                        layout: Callable[[list[str]], str | list[dict]] = bare_layout) -> list:
    """`count` prompts of `per_prompt` documents drawn at random from `texts`, in random order, laid out by
    `layout`; fewer documents where their `num_tokens` would not fit in `room` tokens.

    The layout is the application's prompt around the documents (its system text, its template): what comes
    before a document is what it drifts towards, so maps fitted in the layout they serve fit best."""
    rng, texts = random.Random(seed), list(texts)
    prompts = []
    for _ in range(count):
        group = rng.sample(texts, min(per_prompt, len(texts)))
        sizes = [num_tokens(t) + 2 for t in group]  # + the separator
        while len(group) > 1 and sum(sizes) > room:
            group.pop()
            sizes.pop()
        prompts.append(layout(group))
    return prompts


@dataclass
class NormalEquations:
    """The ridge fit's running sums, K then V: xtx [2, P, L, H_kv, D + 1, D + 1], xty [2, P, L, H_kv, D + 1, D]
    (float64, on the host), over `prompts` prompts."""

    xtx: torch.Tensor
    xty: torch.Tensor
    prompts: int = 0

    @classmethod
    def empty(cls, adapter, places: int) -> NormalEquations:
        if places < 1:
            raise ValueError(f"places must be >= 1, got {places}")
        d, shape = adapter.head_dim, (2, places, adapter.num_layers, adapter.num_kv_heads)
        return cls(torch.zeros(*shape, d + 1, d + 1, dtype=torch.float64), torch.zeros(*shape, d + 1, d,
                                                                                      dtype=torch.float64))


@torch.inference_mode()
def add_prompt(adapter, sums: NormalEquations, reused: Sequence, true_keys: torch.Tensor,
               true_values: torch.Tensor) -> None:
    """Add one prompt to the sums: its reused chunks (assembly.PlannedChunk with an entry: the stored, stale K/V)
    against the K/V a full prefill of the whole prompt gives (true_keys, true_values: [L, H_kv, N, D]), keys
    unrotated; the i-th reused chunk goes to place i (the last place takes all after)."""
    if not reused:
        return
    places = sums.xtx.shape[1]
    for i, c in enumerate(reused):
        count = len(c.token_ids)
        stale = c.entry.keys.to(adapter.device).float()  # stored in host memory
        stale_keys = _unrotate(adapter, stale, *_frame(adapter, c.entry.start, count))
        keys = _unrotate(adapter, true_keys[:, :, c.start:c.end].float(), *_frame(adapter, c.start, count))
        pairs = ((stale_keys, keys), (c.entry.values.to(adapter.device), true_values[:, :, c.start:c.end]))
        for which, (x, y) in enumerate(pairs):
            x = x.double()  # [L, H_kv, S, D]
            x = torch.cat([x, torch.ones_like(x[..., :1])], -1)
            # The normal equations are summed on the host: one small copy per chunk.
            sums.xtx[which, _slot(i, places)] += (x.transpose(-1, -2) @ x).cpu()
            sums.xty[which, _slot(i, places)] += (x.transpose(-1, -2) @ y.double()).cpu()
    sums.prompts += 1


def solve(sums: NormalEquations) -> DriftMaps:
    """The maps the sums give. A place too few calibration tokens reached (prompts cut short by the context
    window) takes the map fitted on every place: a map solved from almost nothing would wipe the K/V it maps."""
    if sums.prompts == 0:
        raise ValueError("no calibration prompt had stored documents within the context window: ingest the "
                         "documents first (fit_drift needs at least two)")
    xtx, xty = sums.xtx.clone(), sums.xty.clone()
    d = xtx.shape[-1] - 1
    thin = xtx[0, :, 0, 0, -1, -1] < MIN_ROWS * (d + 1)  # [P] the bias input's own product counts the tokens
    xtx[:, thin], xty[:, thin] = xtx.sum(1, keepdim=True), xty.sum(1, keepdim=True)
    maps = torch.linalg.solve(xtx + RIDGE * torch.eye(d + 1, dtype=torch.float64), xty).float()
    return DriftMaps(maps[0].contiguous(), maps[1].contiguous(), sums.prompts)


def fit(adapter, samples: Sequence[tuple[torch.Tensor, Sequence]], places: int = 1,
        progress: bool | None = None) -> DriftMaps:
    """Ridge-fit the maps on `samples`: per prompt, its token ids [N] and its reused chunks, against the model's
    own forward over the whole prompt (see add_prompt); with `places` > 1, one map per place."""
    sums = NormalEquations.empty(adapter, places)
    quiet = not progress if progress is not None else None
    for token_ids, reused in tqdm(samples, desc="fitting drift maps", unit="prompt", disable=quiet):
        if reused:
            add_prompt(adapter, sums, reused, *adapter.reference_kv(token_ids))
    return solve(sums)


def to_bytes(maps: DriftMaps, fingerprint: str) -> bytes:
    """The maps as safetensors, their metadata naming the model (fingerprint) and format version: what
    calibrate.save keeps beside the engine's store (a file, a Redis value)."""
    meta = {"fingerprint": fingerprint, "version": str(VERSION), "prompts": str(maps.prompts)}
    return safetensors.torch.save({"keys": maps.keys, "values": maps.values}, metadata=meta)


def from_bytes(data: bytes, fingerprint: str, adapter) -> DriftMaps | None:
    """The maps in `data` when they are this engine's and whole; else None (foreign, old or damaged maps are
    never used: the caller serves the stored K/V as they are)."""
    try:
        meta = safetensors_metadata(data)
        tensors = safetensors.torch.load(bytes(data))
        keys, values = tensors["keys"], tensors["values"]
    except Exception:  # noqa: BLE001 - safetensors raises its own error type for every kind of damage
        return None
    shape = (adapter.num_layers, adapter.num_kv_heads, adapter.head_dim + 1, adapter.head_dim)
    if (meta.get("fingerprint") != fingerprint or meta.get("version") != str(VERSION)
            or keys.dim() != 5 or tuple(keys.shape[1:]) != shape or keys.shape != values.shape
            or not (torch.isfinite(keys).all() and torch.isfinite(values).all())):
        return None
    return DriftMaps(keys.float(), values.float(), int(meta.get("prompts", 0)))

