import math

import torch

from kvboost_rag import RepairConfig
from kvboost_rag.assembly import APPROX, assemble
from kvboost_rag.repair.cacheblend import cacheblend_prefill, layer_fractions


def test_tail_chunks_keep_one_set_while_the_rest_tapers(make_tiny_engine, docs, rag_prompt):
    engine = make_tiny_engine(num_hidden_layers=8)
    engine.ingest(docs)
    plan = engine.plan(rag_prompt(docs[::-1], "Who founded the company?"), "cacheblend")
    config = RepairConfig(check_layer=1, recompute_ratio=0.25, taper=4.0, size_multiple=0, tail_chunks=2)
    cache = assemble(plan, engine.adapter, plan.num_tokens)
    with torch.inference_mode():
        sets = cacheblend_prefill(engine.adapter, cache, plan, config).layer_positions
    approx = [c for c in plan.chunks if c.source == APPROX]
    tail = torch.cat([torch.arange(c.start, c.end) for c in approx[-2:]])
    rest = plan.positions(APPROX)[~torch.isin(plan.positions(APPROX), tail)]
    fractions = layer_fractions(0.25, 4.0, len(sets))
    print(len(approx), tail.numel(), rest.numel(), [s.numel() for s in sets])
    for j, positions in enumerate(sets):
        in_tail = positions[torch.isin(positions, tail)]
        assert in_tail.numel() == math.ceil(0.25 * tail.numel())
        assert torch.equal(in_tail, sets[0][torch.isin(sets[0], tail)])
        assert torch.isin(positions, rest).sum() == math.ceil(fractions[j] * rest.numel())
