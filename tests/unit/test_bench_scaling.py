"""The scaling bench (issue 20 item 4): prompts built near their target sizes from the bundled set, the report's
table, JSON and plot on made-up numbers, and the whole run, CLI included, on the tiny random model."""

from __future__ import annotations

import json
import time

import pytest
import torch

from kvboost_rag import KVBoost, models
from kvboost_rag.bench.data import load_items
from kvboost_rag.bench.report import scaling_table, write_scaling
from kvboost_rag.bench.run import parse_strategies, render_prompt
from kvboost_rag.bench.scaling import build_prompts, device_name, run_scaling, token_counter
from kvboost_rag.bench.scaling import ingest as ingest_as_shipped
from kvboost_rag.cli import main as cli_main
from kvboost_rag.cli.bench_scaling import BUNDLED_SET

STRATEGIES = ("full", "prefix", "naive", "cacheblend")


@pytest.fixture(scope="module")
def items():
    return load_items(BUNDLED_SET, limit=60)


@pytest.fixture(scope="module")
def count(bundled_tokenizer):
    """An item's prompt tokens as the bundled model's chat template and tokenizer make them (no model)."""

    def count(item) -> int:
        return len(bundled_tokenizer.apply_chat_template(render_prompt(item), add_generation_prompt=True,
                                                         tokenize=True, return_dict=True)["input_ids"])

    return count


def test_prompts_come_near_their_targets_from_distinct_documents(items, count, bundled_tokenizer):
    sizes = [300, 1000, 2000, 4000, 8000]
    prompts = build_prompts(items, sizes, 2, count)
    assert [p.target for p in prompts] == [s for s in sizes for _ in range(2)]
    longest_doc = max(len(bundled_tokenizer(d + "\n\n")["input_ids"]) for i in items for d in i.documents)
    used = [d for p in prompts for d in p.item.documents]
    assert len(used) == len(set(used))  # no document in two prompts: each prompt's documents are its own
    by_id = {i.id: i for i in items}
    for p in prompts:
        assert p.tokens == count(p.item)
        assert abs(p.tokens - p.target) <= longest_doc / 2 + 1, (p.target, p.tokens)  # the nearest a document allows
        source = by_id[p.item.id.split("@")[0]]
        assert p.item.question == source.question and p.item.answers == source.answers
        if source.answer_doc is not None:  # the answer's document is always there, and answer_doc still names it
            assert p.item.documents[p.item.answer_doc] == source.documents[source.answer_doc]
        if p.target >= 2000:  # the item whole and last, as the set has it, after documents of other items
            assert p.item.documents[-len(source.documents):] == source.documents
    big = prompts[-1].item
    assert len(big.documents) >= 30  # ~8k tokens: five items' worth of documents


def test_too_few_items_for_the_sizes_is_refused_saying_so(items, count):
    with pytest.raises(ValueError, match="items are too few for 2 prompt"):
        build_prompts(items[:6], [8000], 2, count)


def test_the_counter_is_the_engines_plan(make_tiny_engine, items):
    engine = make_tiny_engine()
    counter = token_counter(engine)
    for p in build_prompts(items, [500, 1500], 1, counter):
        assert p.tokens == engine.plan(render_prompt(p.item), "full").num_tokens


def _fake_report() -> dict:
    """A scaling report shaped as run_scaling's, with made-up numbers."""
    sizes = []
    for target, full_ms in ((1000, 800.0), (2000, 1700.0), (4000, 3900.0)):
        strategies = {}
        for label, share in zip(STRATEGIES, (1.0, 0.9, 0.1, 0.3), strict=True):
            strategies[label] = {"ttft_ms": full_ms * share, "ttft_ratio": share, "speedup": 1 / share,
                                 "first_token_agreement": 1.0 if share > 0.5 else 0.5, "agreement": 0.5,
                                 "first_token_kl": 0.0 if label == "full" else 0.02, "first_logit_gap": 0.3,
                                 "recompute_fraction": share, "fell_back": 0.0, "accuracy": None}
        sizes.append({"target": target, "prompts": 3, "prompt_tokens": target + 7, "strategies": strategies})
    return {"kind": "scaling", "model": "fake-model", "dtype": "bfloat16", "device": "cpu",
            "device_name": "CPU x86_64, 2 threads", "torch": "2.13.0", "kv_bits": 16, "context_window": 8192,
            "per_size": 3, "max_new_tokens": 8, "agree_tokens": 8,
            "ingest": {"documents": 120, "tokens": 24000, "computed": 120, "stored_already": 0, "seconds": 20.0,
                       "tokens_per_s": 1200.0, "calibrated": True, "calibration_s": 31.5},
            "sizes": sizes, "refused": [{"target": 16000, "reason": "16000 prompt tokens + 8 new exceed fake-model's "
                                                                   "context window of 8192 tokens"}],
            "seconds": 99.0, "per_prompt": []}


def test_the_report_writer_makes_a_table_json_and_plot(tmp_path):
    report = _fake_report()
    table = scaling_table(report)
    lines = table.splitlines()
    assert "fake-model, bfloat16 on cpu (CPU x86_64, 2 threads)" in lines[0]
    assert "120 documents, 24000 tokens in 20.0 s (1200 tokens/s, 120 computed" in table
    assert "calibration 31.5 s more" in table
    rows = [line for line in lines if line.startswith("| ")][1:]
    assert len(rows) == 3 * len(STRATEGIES) + 1
    assert rows[2].startswith("| 1000 | 1007 | naive | 80.0 | 0.100 | 10.00x | 0.50 | 0.50 | 0.0200 | 0.300 |")
    assert "agree@8" in lines[4] and rows[-1].startswith("| 16000 | - | refused: 16000 prompt tokens")
    paths = write_scaling(report, tmp_path / "out")
    assert [p.name for p in paths] == ["scaling.json", "scaling.md", "scaling.png"]
    assert json.loads(paths[0].read_text()) == report
    assert paths[1].read_text() == table + "\n"
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[2].stat().st_size > 10_000
    assert [p.name for p in write_scaling(report, tmp_path / "bare", plot=False)] == ["scaling.json", "scaling.md"]


def test_ingestion_is_timed_apart_from_the_calibration_it_runs(make_tiny_engine, items, monkeypatch):
    engine = make_tiny_engine(guarded=True)  # calibrate on, as shipped
    calls = []  # calibration itself is tested elsewhere (~30 s on the tiny model): here only that it is timed apart

    def calibrate(**options):
        time.sleep(0.05)
        calls.append(options)

    monkeypatch.setattr(engine, "calibrate", calibrate)
    texts = [d for item in items[:2] for d in item.documents]
    ingest = ingest_as_shipped(engine, texts, progress=False)
    assert ingest["documents"] == ingest["computed"] == 16 and ingest["stored_already"] == 0
    assert ingest["tokens"] == sum(len(engine.document(t).token_ids) for t in texts)
    assert ingest["tokens_per_s"] == pytest.approx(ingest["tokens"] / ingest["seconds"], rel=0.01)
    assert ingest["calibrated"] and ingest["calibration_s"] >= 0.05 and len(calls) == 1
    again = ingest_as_shipped(engine, texts, progress=False)  # all stored; calibration not due (a stub fitted none)
    assert again["computed"] == 0 and again["stored_already"] == 16 and again["tokens_per_s"] is None
    few = ingest_as_shipped(make_tiny_engine(guarded=True), texts[:3], progress=False)
    assert not few["calibrated"] and few["calibration_s"] == 0  # below 8 documents nothing is calibrated


def test_a_scaling_run_on_the_tiny_model(make_tiny_engine, items):
    engine = make_tiny_engine()
    specs = parse_strategies(",".join(STRATEGIES), engine.config.repair)
    report = run_scaling(engine, items, specs, sizes=[300, 700, 5000], per_size=1, max_new_tokens=3, progress=False)
    assert [s["target"] for s in report["sizes"]] == [300, 700] and report["refused"][0]["target"] == 5000
    assert "context window of 4096 tokens" in report["refused"][0]["reason"]
    assert report["ingest"]["computed"] == report["ingest"]["documents"] and not report["ingest"]["calibrated"]
    for size in report["sizes"]:
        assert abs(size["prompt_tokens"] - size["target"]) < 150 and size["prompts"] == 1
        assert list(size["strategies"]) == list(STRATEGIES)
        full = size["strategies"]["full"]
        assert full["ttft_ratio"] == 1.0 and full["first_token_agreement"] == 1.0 and full["first_logit_gap"] == 0
        assert size["strategies"]["naive"]["reuse_fraction"] > 0.5
    assert len(report["per_prompt"]) == 2 and report["device"] == "cpu" and report["agree_tokens"] == 3
    json.dumps(report)  # JSON-ready
    with pytest.raises(ValueError, match="no size fits: 9000 prompt tokens"):
        run_scaling(engine, items, specs, sizes=[9000], per_size=1, progress=False)


def test_the_cli_runs_end_to_end_and_refuses_bad_sizes(make_tiny_engine, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(KVBoost, "from_pretrained", classmethod(lambda cls, *a, config=None: make_tiny_engine(config)))
    out = tmp_path / "scaling"
    assert cli_main(["bench-scaling", "--sizes", "300", "--limit", "1", "--max-new-tokens", "2", "--out",
                     str(out), "--no-plot"]) == 0
    report = json.loads((out / "scaling.json").read_text())
    # Unset, the dtype is the one this machine runs fastest: bfloat16 only where the CPU has bf16 instructions.
    assert report["dtype"] == models.fastest_dtype(torch.device("cpu")) and report["sizes"][0]["target"] == 300
    assert list(report["sizes"][0]["strategies"]) == list(STRATEGIES)
    assert "| 300 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["bench-scaling", "--sizes", "1000,8"])
    assert "argument --sizes: must be a comma list of prompt sizes" in capsys.readouterr().err


def test_the_device_name_says_which_cpu_and_whether_it_has_bf16(monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"cpu_name": "AMD EPYC", "avx512_bf16": False})
    assert device_name(torch.device("cpu")) == f"CPU AMD EPYC, {torch.get_num_threads()} threads, no bf16 instructions"
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"cpu_name": "Xeon", "amx_bf16": True})
    assert device_name(torch.device("cpu")).endswith("with bf16 instructions")
