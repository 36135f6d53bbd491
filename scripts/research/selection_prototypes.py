"""Research harness (issue #6): prototype selection rules for repairing reused KV, side by side.

Each variant repairs the same assembled (naive) cache of a bench item; reported per variant: first-token
and continuation KL to a full prefill (teacher-forced on full's 16-token greedy output), `cost` (tokens
run per layer summed over layers, over n * layers: the compute fraction) and `t` (wall time over full's).
Variants are `name:key=value+key=value`, name one of the v_* functions below. These are prototypes: the
winner ships as `kvboost_rag/repair/cacheblend.py` (progressive:start_ratio=0.4+ratio=0.05+alpha=1.0 is
close to the shipped default recompute_ratio=0.15, taper=8, recency=1). docs/quality.md has the results.

    python scripts/research/selection_prototypes.py kvboost_rag/bench/synthetic_calib.jsonl 24 40 \
        out/store_calib out/prototypes.json "naive,cacheblend,progressive:start_ratio=0.4+ratio=0.05+alpha=1.0"
"""
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from kvboost_rag import EngineConfig, KVBoost
from kvboost_rag.assembly import APPROX, assemble
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import kl, render_prompt
from kvboost_rag.calibration import document_spans
from kvboost_rag.config import StoreConfig
from kvboost_rag.repair.cacheblend import kv_deviation

data, start, end = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store, outp, variants = sys.argv[4], sys.argv[5], sys.argv[6].split(",")
e = KVBoost.from_pretrained(config=EngineConfig(store=StoreConfig(disk_dir=Path(store))))
A = e.adapter
L = A.num_layers
T = 16


def full_ref(p):
    n = p.num_tokens
    cache = A.new_buffers(n + T)
    h = A.run_layers(A.embed(p.token_ids), torch.arange(n), cache, range(L), n)
    return cache, A.logits(h[:, -1:])[-1]


def greedy(cache, logits, n):
    toks = []
    for i in range(T):
        t = int(logits.argmax())
        toks.append(t)
        if t in e._eos_ids:
            break
        hidden = A.run_layers(A.embed(torch.tensor([t])), torch.tensor([n + i]), cache, range(L), n + i + 1)
        logits = A.logits(hidden)[-1]
    return toks


def cont(cache, logits, n, toks):
    if len(toks) <= 1:
        return logits[None]
    t = len(toks) - 1
    h = A.run_layers(A.embed(torch.tensor(toks[:-1])), torch.arange(n, n + t), cache, range(L), n + t)
    return torch.cat([logits[None], A.logits(h)])


def first_pass(p, cache, upto):
    """All non-exact tokens through layers 0..upto; returns (first, hidden, deviation per layer list)."""
    n = p.num_tokens
    uncached = p.computed_positions()
    reused = p.positions(APPROX)
    first = torch.unique(torch.cat([uncached, reused]))
    hidden = A.embed(p.token_ids[first])
    devs = []
    for layer in range(upto + 1):
        old = (cache.keys[layer][:, :, first].clone(), cache.values[layer][:, :, first].clone())
        hidden = A.run_layers(hidden, first, cache, range(layer, layer + 1), n)
        devs.append(kv_deviation((cache.keys[layer][:, :, first], cache.values[layer][:, :, first]), old))
    is_reused = torch.isin(first, uncached, invert=True)
    return first, hidden, devs, is_reused


def topk_keep(score, is_reused, ratio):
    count = math.ceil(ratio * int(is_reused.sum()))
    cand = torch.nonzero(is_reused).flatten()
    picked = cand[torch.topk(score[cand], min(count, cand.numel())).indices]
    return torch.sort(torch.cat([torch.nonzero(~is_reused).flatten(), picked])).values


def v_cacheblend(p, cache, ratio=0.15, check=1, score="dev"):
    n = p.num_tokens
    first, hidden, devs, is_reused = first_pass(p, cache, check)
    s = devs[check]
    if score == "devsum":
        s = sum(d / d[is_reused].mean() for d in devs)
    keep = topk_keep(s, is_reused, ratio)
    cost = len(first) * (check + 1) + len(keep) * (L - check - 1)
    h = A.run_layers(hidden[:, keep], first[keep], cache, range(check + 1, L), n)
    return h[:, -1:], cost


def v_progressive(p, cache, ratio=0.15, check=1, start_ratio=0.5, alpha=0.0, sched="geom", rel=0):
    """Start with start_ratio after the check layer; at each later layer drop the tokens whose KV moved least,
    shrinking geometrically to `ratio` by the last layer."""
    n = p.num_tokens
    first, hidden, devs, is_reused = first_pass(p, cache, check)
    w = ((first.float() + 1) / n) ** alpha
    s0 = devs[check] * w
    if rel:
        s0 = sum(d / d[is_reused].mean() for d in devs[1:]) * w
    keep = topk_keep(s0, is_reused, start_ratio)
    w = w[keep]
    pos, hid, reused_mask = first[keep], hidden[:, keep], is_reused[keep]
    nre = int(is_reused.sum())
    cost = len(first) * (check + 1)
    layers = list(range(check + 1, L))
    for j, layer in enumerate(layers):
        old = (cache.keys[layer][:, :, pos].clone(), cache.values[layer][:, :, pos].clone())
        hid = A.run_layers(hid, pos, cache, range(layer, layer + 1), n)
        cost += len(pos)
        if j + 1 < len(layers):
            frac = (j + 1) / (len(layers) - 1)
            target = (start_ratio * (ratio / start_ratio) ** frac if sched == "geom"
                      else start_ratio + (ratio - start_ratio) * frac)
            count = math.ceil(target * nre)
            if count < int(reused_mask.sum()):
                d = kv_deviation((cache.keys[layer][:, :, pos], cache.values[layer][:, :, pos]), old) * w
                cand = torch.nonzero(reused_mask).flatten()
                picked = cand[torch.topk(d[cand], count).indices]
                k2 = torch.sort(torch.cat([torch.nonzero(~reused_mask).flatten(), picked])).values
                pos, hid, reused_mask, w = pos[k2], hid[:, k2], reused_mask[k2], w[k2]
    return hid[:, -1:], cost


def v_naive(p, cache):
    n = p.num_tokens
    unc = p.computed_positions()
    h = A.run_layers(A.embed(p.token_ids[unc]), unc, cache, range(L), n)
    return h[:, -1:], len(unc) * L


def v_selective(p, cache, b=16):
    n = p.num_tokens
    from kvboost_rag.repair.selective import selective_positions
    pos = selective_positions(p, b)
    h = A.run_layers(A.embed(p.token_ids[pos]), pos, cache, range(L), n)
    return h[:, -1:], len(pos) * L


def v_lastdocs(p, cache, ratio=0.15, check=1, tail=1):
    """cacheblend, plus the last `tail` documents recomputed whole."""
    n = p.num_tokens
    first, hidden, devs, is_reused = first_pass(p, cache, check)
    spans = document_spans(p, APPROX)
    s = devs[check].clone()
    for a, b in spans[-tail:]:
        s[(first >= a) & (first < b)] = float("inf")
    count_extra = sum(b - a for a, b in spans[-tail:])
    keep = topk_keep(s, is_reused, ratio + count_extra / int(is_reused.sum()))
    cost = len(first) * (check + 1) + len(keep) * (L - check - 1)
    h = A.run_layers(hidden[:, keep], first[keep], cache, range(check + 1, L), n)
    return h[:, -1:], cost


def v_posweight(p, cache, ratio=0.15, check=1, alpha=1.0):
    """cacheblend with deviation weighted towards later positions (recency)."""
    n = p.num_tokens
    first, hidden, devs, is_reused = first_pass(p, cache, check)
    w = ((first.float() + 1) / n) ** alpha
    keep = topk_keep(devs[check] * w, is_reused, ratio)
    cost = len(first) * (check + 1) + len(keep) * (L - check - 1)
    h = A.run_layers(hidden[:, keep], first[keep], cache, range(check + 1, L), n)
    return h[:, -1:], cost


def v_attn(p, cache, ratio=0.15, check=1, upto=None, alpha=1.0, mode="mul"):
    """cacheblend with deviation times the question's attention (all heads, layers 0..check, fresh pass)."""
    n = p.num_tokens
    uncached = p.computed_positions()
    reused = p.positions(APPROX)
    first = torch.unique(torch.cat([uncached, reused]))
    is_reused = torch.isin(first, uncached, invert=True)
    # question rows: uncached tokens after the last document
    spans = document_spans(p, APPROX)
    last_end = spans[-1][1] if spans else 0
    rows = torch.nonzero(first >= last_end).flatten()
    hidden = A.embed(p.token_ids[first])
    devs = []
    attn = torch.zeros(n)
    for layer in range(check + 1):
        old = (cache.keys[layer][:, :, first].clone(), cache.values[layer][:, :, first].clone())
        hidden, probes = A.run_layers_probed(hidden, first, cache, range(layer, layer + 1), n, {layer}, rows)
        attn += probes[layer].mean(dim=(0, 1))
        devs.append(kv_deviation((cache.keys[layer][:, :, first], cache.values[layer][:, :, first]), old))
    a = attn[first]
    if mode == "mul":
        s = devs[check] * (a ** alpha)
    else:
        s = devs[check] / devs[check][is_reused].mean() + alpha * a / a[is_reused].mean()
    keep = topk_keep(s, is_reused, ratio)
    cost = len(first) * (check + 1) + len(keep) * (L - check - 1)
    h = A.run_layers(hidden[:, keep], first[keep], cache, range(check + 1, L), n)
    return h[:, -1:], cost


def parse(v):
    name, _, args = v.partition(":")
    kw = {}
    for pair in filter(None, args.split("+")):
        k, _, val = pair.partition("=")
        try:
            kw[k] = int(val)
        except ValueError:
            try:
                kw[k] = float(val)
            except ValueError:
                kw[k] = val
    return globals()["v_" + name], kw


rows = []
items = load_items(data)[start:end]
for it in items:
    e.ingest(list(it.documents), progress=False)
    with torch.inference_mode():
        p = e.plan(render_prompt(it), "naive")
        n = p.num_tokens
        t0 = time.perf_counter()
        rcache, rlog = full_ref(p)
        tfull = time.perf_counter() - t0
        toks = greedy(rcache, rlog, n)
        ref = cont(rcache, rlog, n, toks)
        row = {"id": it.id, "n": n}
        for v in variants:
            fn, kw = parse(v)
            cache = assemble(p, A, n + T)
            t0 = time.perf_counter()
            h, cost = fn(p, cache, **kw)
            logits = A.logits(h)[-1]
            dt = time.perf_counter() - t0
            per = kl(ref, cont(cache, logits, n, toks))
            row[v] = {"first": float(per[0]), "cont": float(per.mean()), "cost": cost / (L * n), "t": dt / tfull}
    rows.append(row)
    print(it.id, {v: (round(row[v]["cont"], 3), round(row[v]["cost"], 3)) for v in variants}, flush=True)

summ = {v: {k: statistics.fmean(r[v][k] for r in rows) for k in ("first", "cont", "cost", "t")} for v in variants}
base = summ.get("naive", {}).get("cont")
for v, s in summ.items():
    print(f"{v:45s} cont {s['cont']:.4f} ({s['cont'] / base if base else 0:.2f} naive) first {s['first']:.4f} "
          f"cost {s['cost']:.3f} t {s['t']:.3f}")
Path(outp).write_text(json.dumps({"summary": summ, "rows": rows}, indent=1))
