"""Research harness (issue 41, Gemma's global layers): can a stored document's stale K/V at a deep layer be corrected by
the error its tokens show at an early layer, carried along the residual stream?

Gemma 3 270M's reused cache is far from a full prefill because of its three global layers' stale K/V (docs/method.md,
"Where Gemma's error lives": the truth in those layers alone takes naive reuse's first-token KL from 0.53 to 0.06),
and recomputing tokens cannot fix it (they attend to the stale rest). Every reused token runs the layers up to the
check layer exactly, so its input to layer c+1 is known, true, at no extra cost. If the stored document also kept its
hidden state at that layer and at the global layers' inputs (a few more vectors a token), the global layers' K/V
could be projected from

    h_g(estimated) = h_g(stored) + alpha * (h_c(true) - h_c(stored))

instead of kept stale. Here, per item, on naive reuse (no repair, no drift maps): every reused token's K/V at the
chosen layers replaced by (a) the truth (the bound), (b) the carried estimate, and the uncached tokens then run over
the cache; scored as research/oracle_layers.py scores (first-token KL, and mean KL over 16 teacher-forced tokens of
full's greedy answer). `--layers global` (default) replaces the layers of global attention; `all`: every layer after c.
`--carry-from c`: the delta read at layer c's input, every layer below c true in every variant ("naive" included).

    .venv/bin/python research/delta_carry.py research/data/package_pages.jsonl 0 8 --model gemma-3-270m \
        --json out/delta_gemma.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from oracle_layers import TOKENS, true_at, truth  # research/oracle_layers.py

from kvboost_rag import EngineConfig, KVBoost, RepairConfig
from kvboost_rag.assembly import APPROX, assemble
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.run import continued_logits, kl, render_prompt
from kvboost_rag.engine import Prefill


def hidden_states(adapter, token_ids: list[int]) -> torch.Tensor:
    """The input of every layer over `token_ids` from position 0, the model's own forward: [L, S, H]."""
    out = adapter.model(input_ids=torch.tensor(token_ids)[None], output_hidden_states=True, use_cache=False)
    return torch.stack(out.hidden_states[: adapter.num_layers])[:, 0]


def stored_hidden(engine, p) -> dict[int, torch.Tensor]:
    """Per reused position of plan `p`, its hidden state at every layer's input as its document was encoded (after
    the ingestion context): position -> [L, H]."""
    adapter, context = engine.adapter, [t for tokens, _ in engine._doc_context for t in tokens]
    docs = {}  # document tokens -> their hidden states after the context
    by_position = {}
    for chunk in p.chunks:
        if chunk.source != APPROX:
            continue
        tokens = chunk.token_ids
        doc, at = next((d, i) for d in p.segments if not isinstance(d, str) and (i := _find(d.token_ids, tokens)) >= 0)
        if doc.token_ids not in docs:
            docs[doc.token_ids] = hidden_states(adapter, context + list(doc.token_ids))[:, len(context):]
        for k in range(len(tokens)):
            by_position[chunk.start + k] = docs[doc.token_ids][:, at + k]
    return by_position


def _find(haystack: tuple[int, ...], needle: tuple[int, ...]) -> int:
    n = len(needle)
    return next((i for i in range(len(haystack) - n + 1) if haystack[i:i + n] == needle), -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data")
    parser.add_argument("start", type=int)
    parser.add_argument("end", type=int)
    parser.add_argument("--model")
    parser.add_argument("--layers", choices=["global", "all"], default="global")
    parser.add_argument("--carry-from", type=int, help="c: the layer whose input the delta is read at (default: the "
                        "check layer's next, what the engine computes for every token); every layer below c is given "
                        "its true K/V in every variant, as a repair that runs all tokens through them would have")
    parser.add_argument("--json")
    args = parser.parse_args()
    engine = KVBoost.from_pretrained(args.model, config=EngineConfig(calibrate=False, repair=RepairConfig(
        fidelity="fast", drift=False)))
    adapter = engine.adapter
    L = adapter.num_layers
    c = args.carry_from or engine.config.repair.check_layer + 1  # every token's input to layer c is true
    kinds = [layer.attention for layer in adapter.layer_plan]
    layers = [g for g in range(c, L) if args.layers == "all" or kinds[g] == "full_attention"]
    variants = ["naive", "truth", "carry 1", "carry 0.5", "stored (check)"]
    rows = []
    for item in load_items(args.data)[args.start:args.end]:
        engine.ingest(list(item.documents), progress=False)
        prompt = render_prompt(item)
        with torch.inference_mode():
            full, greedy, reference = truth(engine, prompt)
            p = engine.plan(prompt, "naive")
            n = p.num_tokens
            reused, uncached = p.positions(APPROX), p.computed_positions()
            true_h = hidden_states(adapter, p.token_ids.tolist())  # [L, N, H]
            by_position = stored_hidden(engine, p)
            stored_h = torch.stack([by_position[int(i)] for i in reused], dim=1)  # [L, R, H]
            delta = true_h[c, reused] - stored_h[c]  # [R, H]
            stale, scratch = assemble(p, adapter, n + TOKENS), adapter.new_buffers(n + TOKENS)
            exact = {g: reused for g in range(c if args.carry_from else 0)}  # layers below c, true in every variant
            row = {"id": item.id}
            for name in variants:
                cache = true_at(full.cache, stale, exact | ({g: reused for g in layers} if name == "truth" else {}),
                                scratch)
                if name not in ("naive", "truth"):
                    alpha = 0.0 if name.startswith("stored") else float(name.split()[1])
                    for g in layers:
                        keys, values = adapter.project_kv(g, (stored_h[g] + alpha * delta)[None], reused)
                        cache.keys[g][:, :, reused] = keys
                        cache.values[g][:, :, reused] = values
                hidden = adapter.run_layers(adapter.embed(p.token_ids[uncached]), uncached, cache, range(L), n)
                pre = Prefill(p, cache, adapter.logits(hidden[:, -1:])[-1], uncached.numel(), name, 0.0, 0.0)
                per_token = kl(reference, continued_logits(engine, pre, pre.logits[None], greedy)[: len(reference)])
                row[name] = {"first": float(per_token[0]), "cont": float(per_token.mean())}
        rows.append(row)
        print(item.id, {k: round(v["first"], 3) for k, v in row.items() if k != "id"}, flush=True)
    summary = {name: {k: statistics.fmean(r[name][k] for r in rows) for k in ("first", "cont")} for name in variants}
    for name, s in summary.items():
        print(f"{name:16s} first {s['first']:.4f} cont {s['cont']:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"layers": layers, "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
