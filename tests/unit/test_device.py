"""Where the model runs (EngineConfig.device, issue 20 item 3): the name checked when a config is made, "auto"
resolved, a device the machine lacks refused saying what to do, the CLI flag and the LLM helpers derived from the
one field, the tiny engine on the CPU, and, where torch sees a GPU, the tiny engine on CUDA against the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvboost_rag import serving
from kvboost_rag.cli import build_parser
from kvboost_rag.cli import main as cli_main
from kvboost_rag.config import ConfigError, EngineConfig, RepairConfig
from kvboost_rag.engine import KVBoost
from kvboost_rag.llm import DEVICE_HELP, check_engine, check_fields
from kvboost_rag.models import resolve_device, to_device

NO_CUDA = "no CUDA GPU visible to torch here: the CUDA path is checked on a GPU machine (scripts/gpu_check.sh)"
STRATEGIES = ("full", "prefix", "naive", "selective", "cacheblend")


def _no_cuda(monkeypatch, build: str | None = None):
    """This process as if torch saw no GPU; `build` its CUDA version (None: a CPU-only build)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", build)


@pytest.mark.parametrize("name", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_names_of_every_form_are_kept(name):
    assert EngineConfig(device=name).device == name


@pytest.mark.parametrize("bad", ["gpu", "CUDA", "cuda:", "cuda:-1", "cuda:x", "cuda0", " cpu", "", None, 0])
def test_an_unknown_device_is_refused_naming_the_forms(bad):
    with pytest.raises(ConfigError, match=r"unknown device .*; use one of auto, cpu, cuda, cuda:N") as caught:
        EngineConfig(device=bad)
    assert caught.value.field == "device"


def test_auto_is_the_first_gpu_when_torch_sees_one_else_the_cpu(monkeypatch):
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device("auto") == torch.device("cuda", 0)  # indexed: compares equal to the weights' device
    _no_cuda(monkeypatch)
    assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize(("build", "advice"), [
    (None, r"is built without CUDA: install a CUDA build of torch \(https://pytorch.org/get-started/locally/\)"),
    ("12.6", r"\(CUDA 12.6\) sees no GPU: check nvidia-smi and CUDA_VISIBLE_DEVICES"),
])
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_cuda_on_a_machine_without_it_says_what_to_do(monkeypatch, build, advice, name):
    _no_cuda(monkeypatch, build)
    with pytest.raises(ConfigError, match=rf"device '{name}' asked for, but .*{advice}; or use device 'cpu'") as caught:
        resolve_device(name)
    assert caught.value.field == "device"


def test_a_gpu_index_the_machine_lacks_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"device 'cuda:2' asked for, but torch sees 2 GPU\(s\), cuda:0 to cuda:1"):
        resolve_device("cuda:2")


def test_from_pretrained_refuses_a_missing_device_before_loading_anything(monkeypatch, tmp_path):
    _no_cuda(monkeypatch)
    with pytest.raises(ConfigError, match="device 'cuda' asked for"):  # not "no such folder": nothing was read
        KVBoost.from_pretrained(str(tmp_path / "no-such-model"), device="cuda")


def test_the_tiny_engine_runs_on_the_cpu_given_by_name(make_tiny_engine, docs, rag_prompt):
    engine = make_tiny_engine(EngineConfig(device="cpu"))
    assert engine.adapter.device == torch.device("cpu") and engine.config.device == "cpu"
    engine.ingest(docs)
    prompt = rag_prompt(docs[::-1], "Who founded it?")
    reference = engine.prefill(prompt, "full", write_back=False).logits
    for strategy in STRATEGIES:
        pre = engine.prefill(prompt, strategy, write_back=False)
        assert pre.logits.device.type == "cpu" and pre.cache.all_keys.device.type == "cpu"
        assert torch.isfinite(pre.logits).all()
        if strategy in ("full", "prefix"):
            assert torch.allclose(pre.logits, reference, atol=1e-4)
    assert engine.generate(prompt, max_new_tokens=3).generated_tokens <= 3


def test_auto_leaves_a_loaded_model_where_it_is_and_a_named_device_moves_it(make_tiny_engine):
    model = make_tiny_engine().adapter.model
    assert to_device(model, "auto") is model and to_device(model, "cpu") is model  # already there: not copied


def test_the_cli_flag_is_the_config_field(monkeypatch, capsys):
    field = next(f for f in dataclasses.fields(EngineConfig) if f.name == "device")
    for command in (["ask", "q?", "--docs", "x.txt"], ["ingest", "x.txt"], ["bench", "--data", "x.jsonl"],
                    ["bench-scaling"], ["serve"]):
        sub = build_parser()._subparsers._group_actions[0].choices[command[0]]
        action = next(a for a in sub._actions if a.dest == "device")
        assert action.default == field.default == "auto" and action.help == field.metadata["help"]
    assert build_parser().parse_args(["ingest", "x.txt", "--device", "cuda:1"]).device == "cuda:1"
    assert cli_main(["ask", "q?", "--docs", "missing.txt", "--device", "tpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvboost-rag: error: argument --device: unknown device 'tpu'") and err.count("\n") == 1
    _no_cuda(monkeypatch)
    assert cli_main(["ask", "q?", "--docs", "missing.txt", "--device", "cuda"]) == 2
    err = capsys.readouterr().err  # refused before the documents were looked for
    assert "argument --device: device 'cuda' asked for, but" in err and "missing" not in err


def test_llm_fields_check_the_device_and_the_shared_engine_is_one_per_device(make_tiny_engine, monkeypatch):
    from types import SimpleNamespace

    fields = dict(model=None, dtype="float32", device="auto", doc_context=None, strategy="cacheblend", max_tokens=4,
                  temperature=0.0, top_p=1.0, top_k=0, stop=None, seed=None, repair=None)
    check_fields(SimpleNamespace(**fields))
    assert DEVICE_HELP.startswith(next(f for f in dataclasses.fields(EngineConfig) if f.name == "device")
                                  .metadata["help"])
    with pytest.raises(ConfigError, match="unknown device 'gpu'"):
        check_fields(SimpleNamespace(**(fields | {"device": "gpu"})))
    engine = make_tiny_engine()
    check_engine(engine, SimpleNamespace(**(fields | {"device": "cpu"})))  # the engine's own device
    made = []
    monkeypatch.setattr(serving, "_ENGINES", {})
    monkeypatch.setattr(KVBoost, "from_pretrained",
                        classmethod(lambda cls, model, config: made.append(config) or engine))
    _no_cuda(monkeypatch)
    assert serving.shared_engine(device="cpu") is serving.shared_engine(device="auto")
    assert len(made) == 1 and made[0].device == "cpu"  # "auto" is named by the device it resolves to: one engine
    with pytest.raises(ConfigError, match="device 'cuda' asked for"):
        check_fields(SimpleNamespace(**(fields | {"device": "cuda"})))
    with pytest.raises(ConfigError, match="device 'cuda' asked for"):
        serving.shared_engine(device="cuda")
    assert len(made) == 1


# -- on a GPU ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_tiny_engine_on_cuda_gives_the_cpus_logits(make_tiny_engine, docs, rag_prompt, strategy):
    # fp32 both (torch keeps TF32 off for fp32 matmuls by default): the GPU's logits are the CPU's to ~1e-5.
    repair = RepairConfig(fidelity="fast", size_multiple=0)
    engines = [make_tiny_engine(EngineConfig(device=device, repair=repair)) for device in ("cpu", "cuda")]
    prompt = rag_prompt(docs[::-1], "Who founded it?")
    logits = []
    for engine in engines:
        engine.ingest(docs)
        pre = engine.prefill(prompt, strategy, max_new_tokens=4, write_back=False)
        logits.append(torch.cat([pre.logits[None], engine.continuation_logits(pre, [11, 12, 13])]).cpu())
    gpu = engines[1]
    assert gpu.adapter.device.type == "cuda" and gpu.adapter.model.lm_head.weight.device.type == "cuda"
    assert torch.allclose(logits[0], logits[1], atol=1e-3, rtol=1e-3), (logits[0] - logits[1]).abs().max()
    assert gpu.generate(prompt, max_new_tokens=3, strategy=strategy, temperature=0.7, seed=1).generated_tokens <= 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_stored_kv_lives_on_the_host_when_the_model_is_on_cuda(make_tiny_engine, docs, rag_prompt):
    engine = make_tiny_engine(EngineConfig(device="cuda"))
    engine.ingest(docs)
    pre = engine.prefill(rag_prompt(docs, "Who founded it?"), "naive")
    assert pre.cache.all_keys.device.type == "cuda"
    stored = [c.entry for c in pre.plan.chunks if c.entry is not None]
    assert stored and all(e.keys.device.type == "cpu" and e.values.device.type == "cpu" for e in stored)
