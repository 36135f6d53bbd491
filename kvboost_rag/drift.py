"""Drift correction: affine maps from a document's K/V encoded alone to its K/V inside a prompt.

A stored document was encoded from position 0 with nothing before it; inside a prompt the same tokens
would have attended to the text before them, so their K/V at every layer after the first have drifted.
Part of that drift is shared by the documents of a corpus: the tokens attended to their own first token
(an attention sink) instead of the prompt's, and to nothing of the kind of text that usually comes before
them. An affine map per layer and KV head, fitted by ridge least squares from stale to true K/V on prompts
made of the corpus's own documents, removes that shared part before repair; what is left is the
prompt-specific drift that CacheBlend's recompute is for. Keys are mapped in the unrotated frame, where a
token's key does not depend on its position.

The maps belong to a corpus, not only to a model: maps fitted on the synthetic look-alike documents
make CPython documentation passages worse (docs/quality.md, round 4), maps fitted on other passages of
the same documentation improve them. So they are fitted on what the engine has ingested
(`KVBoost.fit_drift`, typically at the end of an ingestion job) and saved next to the store's disk tier.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .assembly import APPROX, assemble

VERSION = 1
RIDGE = 1e-2  # keeps the normal equations well posed for channels that barely vary


@dataclass(frozen=True)
class DriftMaps:
    keys: torch.Tensor  # [L, H_kv, D + 1, D] fp32: unrotated stale key (and a 1) -> unrotated true key
    values: torch.Tensor  # [L, H_kv, D + 1, D] fp32
    prompts: int  # calibration prompts fitted on


def _affine(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [H, N, D] @ w: [H, D + 1, D] (the last row is the bias) -> [H, N, D], in fp32."""
    return torch.baddbmm(w[:, -1:], x.float(), w[:, :-1])


def _unrotate(adapter, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(keys * cos, adapter._rotate_half(keys), sin, value=-1)  # RoPE's inverse: angle -> -angle


def _rotate(adapter, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(keys * cos, adapter._rotate_half(keys), sin)


def correct(adapter, cache, positions: torch.Tensor, maps: DriftMaps) -> None:
    """Map the stale K/V at `positions` [P] in `cache`, in place, at every layer after the first (layer 0's
    K/V do not depend on context)."""
    if positions.numel() == 0:
        return
    cos, sin = (t[0].float() for t in adapter.rope(positions, cache.keys[0]))  # [P, D]
    # Layer by layer: one layer's K/V (~1 MB) stay in cache across the few passes; all layers at once
    # (tens of MB per pass) measured 4x slower on this CPU.
    for layer in range(1, adapter.num_layers):
        keys = _unrotate(adapter, cache.keys[layer][0, :, positions].float(), cos, sin)
        keys = _rotate(adapter, _affine(keys, maps.keys[layer]), cos, sin)
        cache.keys[layer][0].index_copy_(1, positions, keys.to(cache.keys[layer].dtype))
        values = _affine(cache.values[layer][0, :, positions], maps.values[layer])
        cache.values[layer][0].index_copy_(1, positions, values.to(cache.values[layer].dtype))


def calibration_prompts(engine, texts: Sequence[str], count: int, per_prompt: int, seed: int = 0) -> list:
    """`count` prompts of `per_prompt` documents drawn at random from `texts` (ingested), in random order,
    as one user message each; fewer documents where a prompt would not fit the context window."""
    rng, texts = random.Random(seed), list(texts)
    room = engine.adapter.max_context - 64  # room for the template around the documents
    prompts = []
    for _ in range(count):
        group = rng.sample(texts, min(per_prompt, len(texts)))
        sizes = [len(engine.document(t).token_ids) + 2 for t in group]  # + the separator
        while len(group) > 1 and sum(sizes) > room:
            group.pop()
            sizes.pop()
        prompts.append([{"role": "user", "content": "\n\n".join(group)}])
    return prompts


@torch.inference_mode()
def fit(engine, prompts: Sequence) -> DriftMaps:
    """Ridge-fit the maps on `prompts` (whose documents the engine has ingested): each prompt's stored
    documents as assembled (stale) against the model's own forward over the whole prompt (true)."""
    adapter = engine.adapter
    d = adapter.head_dim
    shape = (2, adapter.num_layers, adapter.num_kv_heads)
    xtx = torch.zeros(*shape, d + 1, d + 1, dtype=torch.float64)  # normal equations, K then V
    xty = torch.zeros(*shape, d + 1, d, dtype=torch.float64)
    used = 0
    for prompt in tqdm(prompts, desc="fitting drift maps", unit="prompt", disable=None):
        p = engine.plan(prompt, "naive")
        positions = p.positions(APPROX)
        if positions.numel() == 0 or p.num_tokens > adapter.max_context:
            continue
        stale = assemble(p, adapter, p.num_tokens)
        true_keys, true_values = adapter.reference_kv(p.token_ids)  # [L, H_kv, N, D]
        cos, sin = (t[0].float() for t in adapter.rope(positions, true_keys))
        for layer in range(adapter.num_layers):
            pairs = ((_unrotate(adapter, stale.keys[layer][0, :, positions].float(), cos, sin),
                      _unrotate(adapter, true_keys[layer][:, positions].float(), cos, sin)),
                     (stale.values[layer][0, :, positions], true_values[layer][:, positions]))
            for which, (x, y) in enumerate(pairs):
                x = torch.cat([x, torch.ones_like(x[..., :1])], -1).double()  # [H, N, D + 1]
                xtx[which, layer] += x.transpose(1, 2) @ x
                xty[which, layer] += x.transpose(1, 2) @ y.double()
        used += 1
    if used == 0:
        raise ValueError("no calibration prompt had stored documents within the context window: ingest the "
                         "documents first (fit_drift needs at least two)")
    maps = torch.linalg.solve(xtx + RIDGE * torch.eye(d + 1, dtype=torch.float64), xty).float()
    return DriftMaps(maps[0].contiguous(), maps[1].contiguous(), used)


def save(maps: DriftMaps, path: Path, fingerprint: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({"keys": maps.keys, "values": maps.values}, str(tmp),
              metadata={"fingerprint": fingerprint, "version": str(VERSION), "prompts": str(maps.prompts)})
    tmp.replace(path)


def load(path: Path, fingerprint: str, adapter) -> DriftMaps | None:
    """The saved maps when they are this engine's and whole; else None (a foreign, old or damaged file is
    never used: the caller serves the stored K/V as they are)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            keys, values = f.get_tensor("keys"), f.get_tensor("values")
    except Exception:  # noqa: BLE001 - any unreadable file counts as absent
        return None
    shape = (adapter.num_layers, adapter.num_kv_heads, adapter.head_dim + 1, adapter.head_dim)
    if (meta.get("fingerprint") != fingerprint or meta.get("version") != str(VERSION)
            or tuple(keys.shape) != shape or tuple(values.shape) != shape
            or not (torch.isfinite(keys).all() and torch.isfinite(values).all())):
        return None
    return DriftMaps(keys.float(), values.float(), int(meta.get("prompts", 0)))
