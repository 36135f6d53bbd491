"""Bad settings are refused when made, naming the field, the value and the valid range (issue 23, item 8):
the config dataclasses, SamplingParams, what depends on the model, the CLI and the LLM classes' helpers."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest

from kvboost_rag import models
from kvboost_rag.cli import main as cli_main
from kvboost_rag.config import (
    DTYPE_NAMES,
    FIDELITY_LEVELS,
    KV_BITS,
    LEVEL_BUDGETS,
    ChunkingConfig,
    ConfigError,
    EngineConfig,
    RepairConfig,
    StoreConfig,
    check_for_model,
)
from kvboost_rag.engine import KVBoost
from kvboost_rag.generation import SamplingParams
from kvboost_rag.llm import CALL_ARGS, check_fields, check_sampling, repair_overrides, resolve_repair, stream_kwargs
from kvboost_rag.store.quant import SUPPORTED_BITS

NAN, INF = math.nan, math.inf

# (field, bad value, a part of the range the message must state)
BAD_REPAIR = [
    ("recompute_ratio", -1.0, "[0, 1]"), ("recompute_ratio", NAN, "[0, 1]"), ("recompute_ratio", 2.0, "[0, 1]"),
    ("recompute_ratio", INF, "[0, 1]"), ("taper", NAN, ">= 1"), ("taper", 0.5, ">= 1"), ("taper", INF, ">= 1"),
    ("recency", -1.0, ">= 0"), ("recency", NAN, ">= 0"), ("boundary_tokens", -5, ">= 0"),
    ("boundary_tokens", 2.5, ">= 0"), ("check_layer", -1, ">= 0"), ("size_multiple", -2, ">= -1"),
    ("drift", "no", "True or False"),
]


@pytest.mark.parametrize(("name", "value", "span"), BAD_REPAIR)
def test_repair_config_refuses_out_of_range_knobs(name, value, span):
    for make in (lambda: RepairConfig(**{name: value}),
                 lambda: dataclasses.replace(RepairConfig(), **{name: value})):  # what per-call overrides use
        with pytest.raises(ConfigError) as caught:
            make()
        message = str(caught.value)
        assert caught.value.field == name and name in message and span in message
        assert repr(value) in message or str(value) in message


def test_repair_config_keeps_the_edges_of_each_range():
    edges = RepairConfig(boundary_tokens=0, check_layer=0, recompute_ratio=0.0, taper=1.0, recency=0.0,
                         size_multiple=-1, drift=False)
    assert dataclasses.replace(edges, recompute_ratio=1, taper=64).recompute_ratio == 1
    assert isinstance(ConfigError("x", "y"), ValueError)  # callers catching ValueError still catch it


def test_the_recompute_budget_is_the_fidelity_levels_unless_given():
    assert RepairConfig().recompute_ratio is None and RepairConfig().budget == LEVEL_BUDGETS["balanced"]
    assert RepairConfig(fidelity="strict").budget == LEVEL_BUDGETS["strict"] > LEVEL_BUDGETS["balanced"]
    assert RepairConfig(fidelity="fast").budget == LEVEL_BUDGETS["fast"]
    assert RepairConfig(fidelity=0.2).budget == LEVEL_BUDGETS["balanced"]  # a numeric target: balanced's
    assert RepairConfig(fidelity="strict", recompute_ratio=0.3).budget == 0.3  # given: kept, whatever the level
    assert dataclasses.replace(RepairConfig(recompute_ratio=0.3), recompute_ratio=None).budget == 0.07
    assert set(LEVEL_BUDGETS) == set(FIDELITY_LEVELS)


@pytest.mark.parametrize(("make", "name", "span"), [
    (lambda: ChunkingConfig(max_chunk_tokens=0), "max_chunk_tokens", ">= 1"),
    (lambda: ChunkingConfig(max_chunk_tokens=-3), "max_chunk_tokens", ">= 1"),
    (lambda: ChunkingConfig(doc_context="sentence"), "doc_context", "none, template, passage"),
    (lambda: StoreConfig(kv_bits=3), "kv_bits", "16, 8, 4"),
    (lambda: StoreConfig(kv_bits=8.0), "kv_bits", "16, 8, 4"),
    (lambda: StoreConfig(group_size=0), "group_size", ">= 1"),
    (lambda: StoreConfig(memory_budget_bytes=-1), "memory_budget_bytes", ">= 0"),
    (lambda: StoreConfig(memory_budget_bytes=1.5e6), "memory_budget_bytes", ">= 0"),
    (lambda: StoreConfig(file_mode=0o1777), "file_mode", "0o777"),
    (lambda: StoreConfig(file_mode=0o400), "file_mode", "read and write"),
    (lambda: StoreConfig(file_mode="0o600"), "file_mode", "0o777"),
    (lambda: StoreConfig(disk_dir=5), "disk_dir", "folder path"),
    (lambda: EngineConfig(dtype="int8"), "dtype", "float32, bfloat16, float16"),
    (lambda: EngineConfig(repair={"recompute_ratio": 0.3}), "repair", "RepairConfig"),
])
def test_chunking_store_and_engine_configs_refuse_bad_values(make, name, span):
    with pytest.raises(ConfigError) as caught:
        make()
    assert caught.value.field == name and name in str(caught.value) and span in str(caught.value)


def test_store_and_engine_configs_keep_what_is_valid(tmp_path):
    store = StoreConfig(memory_budget_bytes=0, disk_dir=str(tmp_path), kv_bits=4, group_size=1, file_mode=0o644)
    assert (store.kv_bits, store.file_mode) == (4, 0o644)
    assert EngineConfig(dtype="bfloat16", store=store).store is store
    assert ChunkingConfig(max_chunk_tokens=1).max_chunk_tokens == 1


def test_names_repeated_in_config_match_their_sources():
    # config.py lists them itself to stay free of torch; these keep the copies right.
    assert SUPPORTED_BITS == KV_BITS
    assert tuple(models.DTYPES) == DTYPE_NAMES


def test_check_layer_is_checked_against_the_model():
    assert check_for_model(RepairConfig(check_layer=2), 3).check_layer == 2
    with pytest.raises(ConfigError, match=r"check_layer must be below the model's 3 layers \(0 to 2\), got 999"):
        check_for_model(RepairConfig(check_layer=999), 3)


# -- sampling ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("values", "name", "span"), [
    ({"temperature": NAN}, "temperature", ">= 0"), ({"temperature": INF}, "temperature", ">= 0"),
    ({"temperature": -1.0}, "temperature", ">= 0"), ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"top_p": NAN}, "top_p", "(0, 1]"), ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_k": -5}, "top_k", ">= 0"), ({"top_k": 2.5}, "top_k", ">= 0"),
    ({"max_new_tokens": 0}, "max_new_tokens", ">= 1"), ({"max_new_tokens": 4.0}, "max_new_tokens", ">= 1"),
    ({"stop": "###"}, "stop", "stop=['###']"), ({"stop": ("",)}, "stop", "non-empty strings"),
    ({"stop": (1,)}, "stop", "non-empty strings"), ({"seed": -1}, "seed", "None for an unseeded"),
])
def test_sampling_params_refuse_bad_values(values, name, span):
    with pytest.raises(ConfigError) as caught:
        SamplingParams(**values)
    assert caught.value.field == name and name in str(caught.value) and span in str(caught.value)


def test_sampling_params_keep_valid_values():
    params = SamplingParams(max_new_tokens=1, temperature=0.0, top_p=1.0, top_k=0, stop=["\n", "###"], seed=0)
    assert params.stop == ("\n", "###")  # a list of stop strings is kept as a tuple
    assert SamplingParams(stop=None).stop == ()


def test_bad_sampling_is_refused_before_the_prefill(make_tiny_engine, monkeypatch):
    engine = make_tiny_engine()

    def no_prefill(*args, **kwargs):
        raise AssertionError("prefilled before the sampling values were checked")

    monkeypatch.setattr(engine, "prefill", no_prefill)
    for bad in ({"temperature": NAN}, {"top_k": -5}, {"top_p": 0.0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            engine.stream("Hello there.", max_new_tokens=2, **bad)


def test_generate_refuses_a_per_call_repair_out_of_range(make_tiny_engine):
    engine = make_tiny_engine()
    with pytest.raises(ConfigError, match=r"recompute_ratio must be a finite number in \[0, 1\], got nan"):
        engine.generate("Hello there.", max_new_tokens=2,
                        repair=dataclasses.replace(engine.config.repair, recompute_ratio=NAN))


# -- the helpers both LLM classes use (kvboost_rag.llm) ---------------------------------------------------


def _llm_fields(engine=None, **fields):
    """What an LLM class holds (ChatKVBoost, KVBoostLLM), without a framework."""
    defaults = dict(model=None, dtype="float32", device="auto", doc_context=None, strategy="cacheblend", max_tokens=4,
                    temperature=0.0, top_p=1.0, top_k=0, stop=None, seed=None, repair=None, client=engine)
    return SimpleNamespace(**(defaults | fields))


def test_llm_helpers_check_repair_and_sampling_without_an_engine():
    assert repair_overrides({"taper": None, "recency": 0.5}) == {"recency": 0.5}  # None: not set
    assert repair_overrides(None) == {}
    with pytest.raises(ConfigError, match="recompute_ratio"):
        repair_overrides({"recompute_ratio": NAN})
    with pytest.raises(ConfigError, match="boundary_tokens"):
        repair_overrides({"boundary_tokens": -5})
    with pytest.raises(ConfigError, match="unknown repair setting.*'ratio'; RepairConfig's fields are "
                                          "boundary_tokens, check_layer, recompute_ratio"):
        repair_overrides({"ratio": 0.3, "recency": 0.5})
    with pytest.raises(ConfigError, match="RepairConfig, a dict of its fields or None, got float"):
        repair_overrides(0.3)
    call = check_sampling({"strategy": "full", "max_new_tokens": 3, "temperature": 0.0, "stop": ["\n"]})
    assert call["stop"] == ("\n",) and call["strategy"] == "full"
    with pytest.raises(ConfigError, match="temperature"):
        check_sampling({"temperature": NAN})


def test_llm_call_arguments_are_the_config_fields():
    repair_fields = [f.name for f in dataclasses.fields(RepairConfig)]
    sampling = ["max_tokens" if f.name == "max_new_tokens" else f.name for f in dataclasses.fields(SamplingParams)]
    assert ("strategy", *sampling, *repair_fields, "write_back") == CALL_ARGS


@pytest.mark.parametrize(("fields", "message"), [
    ({"strategy": "fastest"}, "unknown strategy 'fastest'"), ({"dtype": "int8"}, "dtype"),
    ({"doc_context": "sentence"}, "doc_context"), ({"temperature": INF}, "temperature"),
    ({"stop": "###"}, "wrap it"), ({"repair": {"taper": 0.5}}, "RepairConfig.taper"),
    ({"repair": {"ratio": 0.5}}, "unknown repair setting"),
])
def test_llm_fields_are_checked_as_a_call_would(fields, message):
    with pytest.raises(ValueError, match=message):
        check_fields(_llm_fields(**fields))
    check_fields(_llm_fields(repair=RepairConfig(taper=2.0)))


def test_resolve_repair_lays_settings_over_the_engines_config(make_tiny_engine):
    engine = make_tiny_engine(EngineConfig(repair=RepairConfig(taper=3.0)), guarded=True)  # 3 layers
    assert resolve_repair(engine, {"check_layer": 2}) == RepairConfig(taper=3.0, check_layer=2)
    assert resolve_repair(engine, {"check_layer": 2}, {"check_layer": 0}).check_layer == 0  # the call wins
    assert resolve_repair(engine, None) is None and resolve_repair(engine, {"check_layer": None}) is None
    whole = RepairConfig(recency=0.0)
    assert resolve_repair(engine, whole, {"taper": 2.0}) == RepairConfig(recency=0.0, taper=2.0)  # not the engine's
    with pytest.raises(ConfigError, match="below the model's 3 layers"):
        resolve_repair(engine, {"check_layer": 999})
    with pytest.raises(ConfigError, match="below the model's 3 layers"):
        resolve_repair(engine, whole, {"check_layer": 3})


def test_stream_kwargs_reach_the_engine(make_tiny_engine):
    engine = make_tiny_engine(EngineConfig(repair=RepairConfig(taper=3.0)), guarded=True)
    llm = _llm_fields(engine, repair={"recompute_ratio": 1.0}, stop=["\n"])
    call = stream_kwargs(llm, {"recompute_ratio": 0.3, "max_tokens": 2, "write_back": 0}, "TestLLM")
    assert call == {"strategy": "cacheblend", "max_new_tokens": 2, "temperature": 0.0, "top_p": 1.0, "top_k": 0,
                    "seed": None, "stop": ("\n",), "write_back": False,
                    "repair": RepairConfig(taper=3.0, recompute_ratio=0.3)}
    assert engine.generate("Hello there.", **call).generated_tokens <= 2
    assert "repair" not in stream_kwargs(_llm_fields(engine), {}, "TestLLM")


def test_stream_kwargs_refuse_before_touching_the_engine():
    class NoEngine(SimpleNamespace):
        @property
        def client(self):
            raise AssertionError("the engine was touched before the arguments were checked")

    llm = NoEngine(**{k: v for k, v in vars(_llm_fields()).items() if k != "client"})
    for bad, error in [({"ratio": 0.3}, TypeError), ({"strategy": "fastest"}, ValueError),
                       ({"top_k": -1}, ValueError), ({"taper": NAN}, ValueError)]:
        with pytest.raises(error, match=next(iter(bad))):
            stream_kwargs(llm, bad, "TestLLM")
    with pytest.raises(TypeError, match="TestLLM got unexpected argument"):
        stream_kwargs(llm, {"max_new_token": 3}, "TestLLM")


# -- the command line ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "flag"), [
    (["ask", "q?", "--docs", "missing.txt", "--recompute-ratio", "2"], "--recompute-ratio"),
    (["ask", "q?", "--docs", "missing.txt", "--recompute-ratio", "nan"], "--recompute-ratio"),
    (["ask", "q?", "--docs", "missing.txt", "--taper", "nan"], "--taper"),
    (["ask", "q?", "--docs", "missing.txt", "--boundary-tokens", "-5"], "--boundary-tokens"),
    (["ask", "q?", "--docs", "missing.txt", "--temperature", "nan"], "--temperature"),
    (["ask", "q?", "--docs", "missing.txt", "--max-chunk-tokens", "0"], "--max-chunk-tokens"),
    (["ingest", "missing.txt", "--memory-budget", "-5"], "--memory-budget"),
    (["bench", "--data", "missing.jsonl", "--strategies", "cacheblend:recompute_ratio=inf"], "--strategies"),
])
def test_cli_refuses_bad_settings_in_one_line_before_reading_anything(argv, flag, capsys):
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvboost-rag: error: argument {flag}: ") and err.count("\n") == 1
    assert "Traceback" not in err and "missing" not in err  # refused before the files were looked for


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "--data", "x.jsonl", "--skip", "-1"], "argument --skip: must be an integer >= 0, got '-1'"),
    (["bench", "--data", "x.jsonl", "--limit", "0"], "argument --limit: must be an integer >= 1"),
    (["bench", "--data", "x.jsonl", "--orders", "0"], "argument --orders: must be an integer >= 1"),
    (["ingest", "x.txt", "--drift-places", "0"], "argument --drift-places: must be an integer >= 1"),
    (["bench-store", "--data", "x.jsonl", "--bits", "16,3"], "argument --bits: must be a comma list of 16, 8, 4"),
    (["ask", "q?", "--docs", "x.txt", "--kv-bits", "3"], "argument --kv-bits: invalid choice"),
])
def test_cli_only_options_are_refused_by_argparse(argv, message, capsys):
    with pytest.raises(SystemExit) as caught:
        cli_main(argv)
    assert caught.value.code == 2 and message in capsys.readouterr().err


def test_cli_checks_check_layer_against_the_loaded_model(make_tiny_engine, monkeypatch, tmp_path, capsys):
    # The tiny 3-layer model in place of the bundled one, with the config the command line built.
    monkeypatch.setattr(KVBoost, "from_pretrained", classmethod(lambda cls, *a, config=None: make_tiny_engine(config)))
    doc = tmp_path / "doc.txt"
    doc.write_text("The Velmar Observatory stands on Mount Aske.")
    assert cli_main(["ask", "Where?", "--docs", str(doc), "--check-layer", "999"]) == 2
    err = capsys.readouterr().err
    assert "argument --check-layer: RepairConfig.check_layer must be below the model's 3 layers" in err


def test_a_store_given_as_a_url_is_the_redis_tier_and_an_unknown_scheme_is_refused(tmp_path, capsys):
    url = "redis://127.0.0.1:6379/0"
    config = StoreConfig(disk_dir=url)
    assert config.redis_url == url and config.disk_dir is None
    assert StoreConfig(disk_dir=url, redis_url=url).redis_url == url
    assert StoreConfig(disk_dir=tmp_path).disk_dir == tmp_path and StoreConfig(disk_dir=tmp_path).redis_url is None
    for bad in ("s3://bucket/kv", "http://127.0.0.1/kv"):
        with pytest.raises(ConfigError, match="unknown store URL"):
            StoreConfig(disk_dir=bad)
    with pytest.raises(ConfigError, match="two Redis stores"):
        StoreConfig(disk_dir=url, redis_url="redis://127.0.0.1:6380/0")
    # The CLI's --store takes either, before any model is loaded: an unknown scheme is an argument error.
    doc = tmp_path / "doc.txt"
    doc.write_text("Some text.")
    assert cli_main(["ask", "question?", "--docs", str(doc), "--store", "s3://bucket/kv"]) == 2
    assert "--store" in capsys.readouterr().err
