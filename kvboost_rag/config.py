"""Frozen configuration: everything that is fixed for the life of an engine.

Per-request state (the prompt, the strategy chosen for it) lives in the engine's call arguments,
never here; strategies are named by the registry in `repair/`. Anything that changes the numbers in a
stored KV chunk is part of `ChunkingConfig` and so of the model fingerprint (see `keys.model_fingerprint`).

Every field is checked when a config is made (`__post_init__`, so `dataclasses.replace` checks too):
a value out of range raises a `ConfigError` (a ValueError) naming the field, the value and the range,
instead of running as some other setting. What depends on the model (the number of layers) is checked
by `check_for_model` once the model is known. This module imports nothing heavy (no torch).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from numbers import Integral, Real
from pathlib import Path

from .prompts import LAYOUTS

DOC_CONTEXTS = ("none", "template", "passage")
# The fidelity guard's named levels (fidelity.LEVELS, repeated so a config is checked without torch).
FIDELITY_LEVELS = ("fast", "balanced", "strict")
# The recompute budget (RepairConfig.recompute_ratio) each level repairs with unless one is given; a numeric
# target takes balanced's. With the guard deciding per request, 0.07 kept the 0.15 budget's agreement and
# accuracy on the tuning set, 25-50% faster; "strict" (target 0.03) at 0.07 fell back to a full prefill on
# most first tokens of the held-out set, so it repairs more (docs/method.md, "A smaller budget under the guard").
LEVEL_BUDGETS = {"fast": 0.07, "balanced": 0.07, "strict": 0.15}
# Names of the compute dtypes (models.DTYPES) and the stored KV precisions (store.quant.SUPPORTED_BITS),
# repeated here so that a config can be checked without importing torch; a unit test keeps them equal.
DTYPE_NAMES = ("float32", "bfloat16", "float16")
KV_BITS = (16, 8, 4)
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
# Where the model runs (EngineConfig.device): "auto" (CUDA when available, else the CPU), "cpu", "cuda" or
# "cuda:N". Only the form is checked here (no torch); whether the machine has that device, at load (models.py).
DEVICE_FORMS = ("auto", "cpu", "cuda", "cuda:N")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
# torch.Generator.manual_seed takes seeds below this.
SEED_LIMIT = 2**64


class ConfigError(ValueError):
    """A setting out of its range or of an unknown name; `field` is the setting's name (the CLI names
    the flag it came from)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_int(config, name: str, low: int, high: int | None = None, hint: str = "") -> None:
    """A ConfigError unless `config.<name>` is an integer in [low, high] (no upper bound when None)."""
    value = getattr(config, name)
    if _is_int(value) and low <= value and (high is None or value <= high):
        return
    span = f">= {low}" if high is None else f"in [{low}, {'2**64 - 1' if high == SEED_LIMIT - 1 else high}]"
    raise ConfigError(name, f"{type(config).__name__}.{name} must be an integer {span}, got {value!r}"
                            + (f" ({hint})" if hint else ""))


def check_number(config, name: str, low: float, high: float = math.inf, *, above: bool = False,
                 hint: str = "") -> None:
    """A ConfigError unless `config.<name>` is a finite number in [low, high] ((low, high] with `above`)."""
    value = getattr(config, name)
    if (isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
            and (low < value if above else low <= value) and value <= high):
        return
    span = (f"> {low:g}" if above else f">= {low:g}") if high == math.inf else \
        f"in {'(' if above else '['}{low:g}, {high:g}]"
    raise ConfigError(name, f"{type(config).__name__}.{name} must be a finite number {span}, got {value!r}"
                            + (f" ({hint})" if hint else ""))


def _check_choice(name: str, value, choices: tuple) -> None:
    if not isinstance(value, type(choices[0])) or value not in choices:
        raise ConfigError(name, f"unknown {name} {value!r}; use one of {', '.join(map(str, choices))}")


def check_file_mode(file_mode: int) -> int:
    """`file_mode` (StoreConfig.file_mode), or a ConfigError saying what a valid one is. The store reads back
    and replaces what it writes, so the owner keeps read and write."""
    if not _is_int(file_mode) or not 0 <= file_mode <= 0o777 or file_mode & 0o600 != 0o600:
        shown = oct(file_mode) if _is_int(file_mode) else repr(file_mode)
        raise ConfigError("file_mode", f"StoreConfig.file_mode must be permission bits (0 to 0o777) that let the "
                                       f"owner read and write, such as 0o600 (owner only), 0o640 (and the group) "
                                       f"or 0o644 (everyone); got {shown}")
    return file_mode


def check_device(device: str) -> str:
    """The device's name (EngineConfig.device), or a ConfigError listing the forms it may take."""
    if not isinstance(device, str) or not _DEVICE.fullmatch(device):
        raise ConfigError("device", f"unknown device {device!r}; use one of {', '.join(DEVICE_FORMS)} (N: a GPU's "
                                    "index, as torch numbers them)")
    return device


def check_doc_context(doc_context: str) -> str:
    """The ingestion context's name (ChunkingConfig.doc_context), or a ValueError listing the known ones."""
    _check_choice("doc_context", doc_context, DOC_CONTEXTS)
    return doc_context


@dataclass(frozen=True)
class ChunkingConfig:
    # A document longer than this is split at paragraph, then sentence, then word boundaries.
    max_chunk_tokens: int = 512
    # What a document is encoded after at ingestion: "none" (alone, from position 0), "template" (after
    # the opening of the model's chat template, up to a user message's content) or "passage" (after that
    # opening, a neutral paragraph and a blank line: as a later document of a prompt). With anything
    # but "none" the document's first token is not an attention sink; with "passage" its KV does not look
    # like a prompt's first document either, which every reused document otherwise claims to be.
    doc_context: str = "passage"

    def __post_init__(self):
        check_int(self, "max_chunk_tokens", 1, hint="tokens per stored chunk")
        check_doc_context(self.doc_context)


def knob(default, help: str):
    """A dataclass field with the help text the CLI and both integrations show for it (declared once, here)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class RepairConfig:
    """How a request's reused KV is repaired. Every field can be given per request (the CLI's flags, the LLM
    classes' `repair` field and per-call keyword arguments all come from these fields)."""

    boundary_tokens: int = knob(16, "selective: how many leading tokens of every reused chunk are recomputed")
    check_layer: int = knob(1, "cacheblend: every token runs layers up to this one, where deviation is first "
                               "measured")
    recompute_ratio: float | None = knob(None, "cacheblend: fraction of reused tokens recomputed per layer after "
                                               "the check layer, averaged over those layers (0 = naive, 1 = a full "
                                               "prefill; default: the fidelity level's, 0.07, or 0.15 under "
                                               "'strict')")
    # The set is filtered again at every layer by that layer's deviation, shrinking geometrically.
    taper: float = knob(8.0, "cacheblend: how many times more tokens the first repaired layer recomputes than "
                             "the last (1 = one set for all layers, the original CacheBlend)")
    # The question attends most to the documents just before it, and the later a document sits the more
    # context its stored KV never saw.
    recency: float = knob(1.0, "cacheblend: deviation is weighted by ((position + 1) / n) ** recency before "
                               "ranking (0 = unweighted)")
    # Shrinking sets that repeat a few matrix shapes let kernels that set up per shape (oneDNN's bf16 on CPU)
    # reuse their setup: 16 took bf16 from 1.46x to 2.29x at the same KL; 64 was as fast but too coarse for
    # the deep layers' small sets; fp32 gains nothing measurable (docs/method.md).
    size_multiple: int = knob(-1, "cacheblend: round each layer's set to a multiple of this many tokens "
                                  "(0 = exact counts, -1 = 16 in 16-bit dtypes, else exact)")
    drift: bool = knob(True, "cacheblend: map the reused documents' K/V with the drift maps fitted on the "
                             "corpus (KVBoost.calibrate) before repair, when the engine has some")
    # See fidelity.py: the guard moves a request to an exact cache before a token it cannot trust.
    fidelity: str | float = knob("balanced", "how sure each answer must be to equal a full prefill's: 'fast' (no "
                                             "guard), 'balanced', 'strict', or the chance it may differ, e.g. 0.1")

    def __post_init__(self):
        check_int(self, "boundary_tokens", 0, hint="selective: 0 recomputes no reused token")
        check_int(self, "check_layer", 0, hint="and below the model's number of layers")
        if self.recompute_ratio is not None:
            check_number(self, "recompute_ratio", 0.0, 1.0, hint="0 repairs nothing, as naive; 1 recomputes every "
                                                                 "reused token, as full")
        check_number(self, "taper", 1.0, hint="1 keeps one set for all layers")
        check_number(self, "recency", 0.0, hint="0 weighs every position alike")
        check_int(self, "size_multiple", -1, hint="-1 = auto, 0 = exact counts")
        if not isinstance(self.drift, bool):
            raise ConfigError("drift", f"RepairConfig.drift must be True or False, got {self.drift!r}")
        if isinstance(self.fidelity, str):
            _check_choice("fidelity", self.fidelity, FIDELITY_LEVELS)
        else:
            check_number(self, "fidelity", 0.0, 1.0, above=True,
                         hint="the chance an answer may differ from a full prefill's, or one of "
                              + ", ".join(FIDELITY_LEVELS))

    @property
    def budget(self) -> float:
        """The recompute ratio a cacheblend request runs at: `recompute_ratio`, else its fidelity level's."""
        if self.recompute_ratio is not None:
            return self.recompute_ratio
        return LEVEL_BUDGETS[self.fidelity if isinstance(self.fidelity, str) else "balanced"]


@dataclass(frozen=True)
class StoreConfig:
    # Bytes the in-memory tier may hold (tensors, scales and zero points all counted); None = no limit.
    memory_budget_bytes: int | None = None
    # Persistent tier; evicted and newly computed chunks are written here when set.
    disk_dir: Path | None = None
    # 16 keeps the compute dtype; 8 and 4 quantize (keys per channel, values per token).
    kv_bits: int = 16
    # Quantization group size along the quantized axis.
    group_size: int = 64
    # Permissions of the files written under disk_dir (the folder gets the matching x bits). The store
    # holds every ingested document's text and its KV, so by default only the owner can read it;
    # 0o640 shares it with the group, 0o644 with everyone.
    file_mode: int = 0o600
    # Shared tier behind memory and disk (store/redis.py), e.g. redis://host:6379/0, so that several processes
    # and machines reuse one store; None = none. Client options go in the URL (?socket_timeout=5). Bound its
    # size in Redis itself: maxmemory with maxmemory-policy allkeys-lru is safe (an evicted entry is a miss; the
    # document index, shared there too, is written back by the processes that hold it).
    redis_url: str | None = None

    def __post_init__(self):
        # A store given as a URL where a folder goes (the CLI's --store, say) is the shared tier; any other
        # scheme is refused rather than taken as a folder named "s3:".
        if isinstance(self.disk_dir, str) and "://" in self.disk_dir:
            if not self.disk_dir.startswith(REDIS_SCHEMES):
                raise ConfigError("disk_dir", f"unknown store URL {self.disk_dir!r}: a store is a folder or a Redis "
                                              "URL (redis://host:6379/0, rediss:// for TLS, unix:///path/to/redis.sock)")
            if self.redis_url not in (None, self.disk_dir):
                raise ConfigError("disk_dir", f"two Redis stores given: {self.disk_dir!r} and redis_url "
                                              f"{self.redis_url!r}; give one")
            object.__setattr__(self, "redis_url", self.disk_dir)
            object.__setattr__(self, "disk_dir", None)
        if self.redis_url is not None and not (isinstance(self.redis_url, str)
                                               and self.redis_url.startswith(REDIS_SCHEMES)):
            raise ConfigError("redis_url", f"StoreConfig.redis_url must be a Redis URL: redis://host:6379/0, rediss:// "
                                           f"for TLS or unix:///path/to/redis.sock, or None for no shared tier; got "
                                           f"{self.redis_url!r}")
        if self.memory_budget_bytes is not None:
            check_int(self, "memory_budget_bytes", 0, hint="None = no limit")
        if self.disk_dir is not None and not isinstance(self.disk_dir, (str, os.PathLike)):
            raise ConfigError("disk_dir", f"StoreConfig.disk_dir must be a folder path or None, got {self.disk_dir!r}")
        if not _is_int(self.kv_bits) or self.kv_bits not in KV_BITS:
            raise ConfigError("kv_bits", f"StoreConfig.kv_bits must be one of {', '.join(map(str, KV_BITS))}, got "
                                         f"{self.kv_bits!r} (16 keeps the compute dtype, 8 and 4 quantize)")
        check_int(self, "group_size", 1)
        check_file_mode(self.file_mode)


@dataclass(frozen=True)
class EngineConfig:
    dtype: str = "float32"
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    repair: RepairConfig = field(default_factory=RepairConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    # Ingestion fits the drift maps and the fidelity guard on the corpus by itself (calibrate.py); False: only
    # when KVBoost.calibrate is called (a benchmark of a method without them, a test of something else).
    calibrate: bool = True
    # How calibration lays out its prompts (a name in prompts.LAYOUTS): as the application does, with a question,
    # so that the guard is fitted on answers like the ones it watches. The integrations set their framework's.
    calibration_layout: str = "bench"
    # Ingestion encodes documents side by side, this many (padded) tokens per forward at most: bf16 and large
    # fp32 matmuls run faster on thousands of rows than on one document's hundreds. Memory grows with it.
    ingest_batch_tokens: int = 4096
    # The model, the assembled cache and the repair run there; the store's tiers keep their KV in host memory
    # (or on disk, or in Redis), and a request's stored chunks are copied to the device as they are assembled.
    device: str = knob("auto", "where the model runs: 'auto' (CUDA when available, else the CPU), 'cpu', 'cuda' "
                               "or 'cuda:N'; a model handed to KVBoost already loaded stays where it is under 'auto'")
    # The guard's ladder (repair/guard.py): a cache the request's budget cannot be trusted with is repaired again at
    # the levels' larger budgets, then this one, before a full prefill; so a model whose cache the default budget
    # cannot trust still gains at a larger one. An engine's setting, not a request's: RepairConfig stays lean.
    escalate_to: float = knob(0.3, "the largest recompute budget the fidelity guard repairs a request's cache again "
                                   "at before a token it cannot trust (the levels' budgets above the request's, then "
                                   "this), before a full prefill; 0 = straight to a full prefill")
    bf16_step: bool = knob(True, "let the fidelity guard's ladder serve from a full prefill in bf16 before one in "
                                 "float32, for a float32 engine where bf16 runs natively (a CPU with bf16 "
                                 "instructions, a GPU): its answers differ from float32's as often as the dtype "
                                 "floor strict is held to, and it runs ~1.6x faster on such a CPU")
    # Records from one template are told apart only from a cache right nearly everywhere (likeness.py).
    strict_likeness: float | None = knob(0.1, "hold a 'balanced' request to 'strict' when its documents are this "
                                              "alike or more: the mean over pairs of the word 4-grams two share "
                                              "over those either has (records from one template 0.13-0.22, real "
                                              "pages below 0.05); above 1 or None: never")
    # A floor is a rate over answers (fidelity.Account): the unspent floor risk of answers lent to later ones.
    floor_credit: float = knob(2.0, "answers' worth of floor risk that 'balanced' answers which ran less than their "
                                    "floor may lend to later ones which would pass it, so that the level is held on "
                                    "average rather than answer by answer (0 = every answer held to its own floor)")
    ladder_costs: bool = knob(True, "skip a step of the fidelity guard's ladder (a repair, an escalation) whose "
                                    "cache the guard trusts less often than the step's measured cost as a share of a "
                                    "full prefill's: it would cost more than it saves")
    lookahead: int = knob(2, "draft tokens a greedy decode step checks in the same forward, copied from where the "
                             "text's last tokens occurred before in the prompt or answer (lookahead.py: greedy "
                             "decoding's answer in fewer forwards; in bf16 a forward over several tokens rounds "
                             "unlike one over one); 0 = one token per forward")
    transposed_weights: bool = knob(True, "float32 on the CPU: keep each linear weight a second time, transposed, for "
                                          "inputs of 4 rows and more (batched or drafted decode steps), where a probe "
                                          "at load finds MKL's path for the weight as stored slower (packing.py): "
                                          "twice the weights' memory; False: once")
    # Online calibration (shadow.py): served answers checked against a full prefill once the engine is idle, off
    # every request's path, refitting the fidelity guard on what users ask.
    shadow_share: float = knob(0.05, "share of the guarded requests whose answer is checked against a full prefill "
                                     "in the background, once the engine is idle, to refit the fidelity guard "
                                     "(0 = none)")
    shadow_share_young: float = knob(0.25, "that share while the request's flip curve was fitted on few tokens "
                                           "(shadow.YOUNG_TOKENS)")
    shadow_queue: int = knob(8, "shadow checks waiting at most; one offered to a full queue is dropped")

    def __post_init__(self):
        check_int(self, "ingest_batch_tokens", 1, hint="tokens per ingestion forward")
        check_device(self.device)
        check_number(self, "escalate_to", 0.0, 1.0, hint="0 falls back to a full prefill without repairing again")
        check_number(self, "floor_credit", 0.0, hint="0 holds every answer to its own floor")
        if self.strict_likeness is not None:
            check_number(self, "strict_likeness", 0.0, hint="above 1 never holds a request to 'strict' for it")
        check_number(self, "shadow_share", 0.0, 1.0, hint="0 checks no request")
        check_number(self, "shadow_share_young", 0.0, 1.0, hint="0 checks no request")
        check_int(self, "shadow_queue", 1, hint="checks waiting at most")
        check_int(self, "lookahead", 0, hint="0 decodes one token per forward")
        if not isinstance(self.bf16_step, bool):
            raise ConfigError("bf16_step", f"EngineConfig.bf16_step must be True or False, got {self.bf16_step!r}")
        if not isinstance(self.ladder_costs, bool):
            raise ConfigError("ladder_costs", f"EngineConfig.ladder_costs must be True or False, got "
                                              f"{self.ladder_costs!r}")
        if not isinstance(self.calibrate, bool):
            raise ConfigError("calibrate", f"EngineConfig.calibrate must be True or False, got {self.calibrate!r}")
        if self.calibration_layout not in LAYOUTS:
            raise ConfigError("calibration_layout", f"unknown calibration_layout {self.calibration_layout!r}; use one "
                                                    f"of {', '.join(LAYOUTS)}")
        if self.dtype not in DTYPE_NAMES:
            raise ConfigError("dtype", f"unknown dtype {self.dtype!r}; use one of {', '.join(DTYPE_NAMES)}")
        for name, kind in (("chunking", ChunkingConfig), ("repair", RepairConfig), ("store", StoreConfig)):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(name, f"EngineConfig.{name} must be a {kind.__name__}, got "
                                        f"{type(getattr(self, name)).__name__}")


def check_for_model(repair: RepairConfig, num_layers: int) -> RepairConfig:
    """`repair`, or a ConfigError when a setting does not fit a model of `num_layers` layers: what the
    dataclass cannot check alone. The engine calls it for its own config and for a per-request one."""
    if repair.check_layer >= num_layers:
        raise ConfigError("check_layer", f"RepairConfig.check_layer must be below the model's {num_layers} layers "
                                         f"(0 to {num_layers - 1}), got {repair.check_layer}")
    return repair
