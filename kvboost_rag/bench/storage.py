"""The store's own benchmark: bytes per token, disk load against recompute, and what quantization
does to answers (against the unquantized store, on the same prompts and strategy)."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import keys as keyring
from ..config import EngineConfig, StoreConfig
from ..engine import KVBoost
from ..generation import SamplingParams
from ..store.disk import DiskStore
from .data import BenchItem
from .run import correct, kl, render_prompt


def disk_vs_recompute(engine: KVBoost, texts: list[str], disk_dir: Path) -> dict:
    """Median seconds to compute a document's KV vs to load it back from a freshly opened disk tier."""
    compute_s, load_s = [], []
    for text in texts:
        doc = engine.document(text)
        ids = torch.tensor(doc.token_ids)
        started = time.perf_counter()
        with torch.inference_mode():
            cache = engine.adapter.new_buffers(len(ids))
            engine.adapter.run_layers(engine.adapter.embed(ids), torch.arange(len(ids)), cache,
                                      range(engine.adapter.num_layers), len(ids))
        compute_s.append(time.perf_counter() - started)
    engine.ingest(texts, progress=False)
    engine.close()
    disk = DiskStore(disk_dir, engine.fingerprint, kv_bits=engine.config.store.kv_bits,
                     group_size=engine.config.store.group_size)
    for text in texts:
        keys = keyring.chain(engine.fingerprint, engine.document(text).chunk_tokens())
        started = time.perf_counter()
        entries = [disk.get(pkey) for pkey, _ in keys]
        load_s.append(time.perf_counter() - started)
        if any(e is None for e in entries):
            raise RuntimeError(f"{disk_dir}: a just-written entry could not be read back")
    ratios = [c / max(ld, 1e-9) for c, ld in zip(compute_s, load_s, strict=True)]
    return {"compute_ms": 1e3 * statistics.median(compute_s), "load_ms": 1e3 * statistics.median(load_s),
            "load_speedup": statistics.median(ratios)}


def bytes_per_token(engine: KVBoost, texts: list[str]) -> float:
    engine.ingest(texts, progress=False)
    tokens = sum(len(engine.document(t).token_ids) for t in texts)
    return engine.store.nbytes / tokens


def quantization_quality(reference: KVBoost, quantized: KVBoost, items: list[BenchItem], strategy: str,
                         max_new_tokens: int) -> dict:
    """Accuracy of both, and KL(reference store || quantized store) over the reference's greedy output."""
    params = SamplingParams(max_new_tokens=max_new_tokens)
    first, cont, acc_ref, acc_q = [], [], [], []
    for item in items:
        prompt = render_prompt(item)
        runs = []
        for engine in (reference, quantized):
            engine.ingest(list(item.documents), progress=False)
            pre = engine.prefill(prompt, strategy, max_new_tokens=max_new_tokens, write_back=False)
            runs.append((pre, list(engine.stream_from(pre, params))[-1].result))
        (pre_r, out_r), (pre_q, out_q) = runs
        tokens = list(out_r.token_ids)
        dists = []
        for engine, pre in ((reference, pre_r), (quantized, pre_q)):
            rest = engine.continuation_logits(pre, tokens[:-1]) if len(tokens) > 1 else pre.logits[None][:0]
            dists.append(torch.cat([pre.logits[None], rest]))
        per_token = kl(dists[0], dists[1])
        first.append(float(per_token[0]))
        cont.append(float(per_token.mean()))
        if item.answers:
            acc_ref.append(correct(out_r.text, item.answers))
            acc_q.append(correct(out_q.text, item.answers))
    return {"first_token_kl": statistics.fmean(first), "continuation_kl": statistics.fmean(cont),
            "accuracy_reference": statistics.fmean(acc_ref) if acc_ref else None,
            "accuracy": statistics.fmean(acc_q) if acc_q else None}


def run_storage_bench(loaded, base: EngineConfig, items: list[BenchItem], *, strategy: str, bits: list[int],
                      max_new_tokens: int = 16, progress: bool = True) -> dict:
    texts = list(dict.fromkeys(d.strip() for item in items for d in item.documents))
    report: dict = {"documents": len(texts), "items": len(items), "strategy": strategy, "bits": {}}

    def engine_for(kv_bits: int, disk: Path | None = None) -> KVBoost:
        return KVBoost(loaded, EngineConfig(dtype=base.dtype, chunking=base.chunking, repair=base.repair,
                                            store=StoreConfig(kv_bits=kv_bits, disk_dir=disk,
                                                              group_size=base.store.group_size)))

    reference = engine_for(16)
    dense_bytes = bytes_per_token(reference, texts)
    # What a bf16 store takes, whatever the compute dtype: the baseline the targets are stated against.
    bf16_bytes = dense_bytes * 2 / reference.adapter.dtype.itemsize
    for b in tqdm(bits, desc="kv bits", disable=not progress):
        with tempfile.TemporaryDirectory() as tmp:
            row = disk_vs_recompute(engine_for(b, Path(tmp)), texts, Path(tmp))
        engine = engine_for(b)
        row["bytes_per_token"] = bytes_per_token(engine, texts)
        row["bytes_vs_bf16"] = row["bytes_per_token"] / bf16_bytes
        if b != 16:
            row.update(quantization_quality(reference, engine, items, strategy, max_new_tokens))
        report["bits"][str(b)] = row
    return report


def table(report: dict) -> str:
    lines = [f"{report['documents']} documents, {report['items']} items, strategy {report['strategy']}", "",
             "| kv_bits | bytes/token | vs bf16 | compute ms | disk load ms | load speed-up | accuracy "
             "(16-bit store) | KL first | KL cont |", "|---|---|---|---|---|---|---|---|---|"]
    def f(r, key, fmt):
        return "-" if r.get(key) is None else fmt.format(r[key])

    for b, r in report["bits"].items():
        acc = "-" if r.get("accuracy") is None else f"{r['accuracy']:.3f} ({r['accuracy_reference']:.3f})"
        lines.append(f"| {b} | {r['bytes_per_token']:.0f} | {r['bytes_vs_bf16']:.3f} | {r['compute_ms']:.1f} | "
                     f"{r['load_ms']:.2f} | {r['load_speedup']:.1f}x | {acc} | {f(r, 'first_token_kl', '{:.4f}')} | "
                     f"{f(r, 'continuation_kl', '{:.4f}')} |")
    return "\n".join(lines)
