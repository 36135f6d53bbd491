"""Options shared by the subcommands: the model, dtype, store and repair settings, and reading documents."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..config import (
    DOC_CONTEXTS,
    DTYPE_NAMES,
    KV_BITS,
    QA_ORDERS,
    SELECTS,
    STRATEGIES,
    ChunkingConfig,
    ConfigError,
    EngineConfig,
    RepairConfig,
    StoreConfig,
)
from ..generation import SamplingParams

# The flag each config field is set by, where it is not "--" + the field's name with dashes.
_FLAGS = {"memory_budget_bytes": "--memory-budget", "disk_dir": "--store", "drift": "--no-drift"}


def flag(field: str) -> str:
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


@contextmanager
def flags_named() -> Iterator[None]:
    """Re-raise a ConfigError from settings the command line gave as one naming the flag (printed by
    `kvboost-rag` as a one-line error, exit code 2)."""
    try:
        yield
    except ConfigError as e:
        raise ConfigError(e.field, f"argument {flag(e.field)}: {e}") from None


def count(minimum: int):
    """An argparse type: an integer >= minimum, refused by argparse with what it must be."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="local HF folder or hub id (default: bundled SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    g.add_argument("--store", type=Path, default=None, help="persistent KV store folder (disk tier)")
    g.add_argument("--memory-budget", type=int, default=None, help="bytes the in-memory tier may hold")
    g.add_argument("--kv-bits", type=int, default=StoreConfig.kv_bits, choices=KV_BITS, help="stored KV precision")
    g.add_argument("--max-chunk-tokens", type=int, default=ChunkingConfig.max_chunk_tokens)
    g.add_argument("--doc-context", default=ChunkingConfig.doc_context, choices=DOC_CONTEXTS,
                   help="what documents are encoded after at ingestion: nothing, the chat template's opening, "
                        "or that and a neutral passage (as a later document of a prompt)")
    r = parser.add_argument_group("repair")
    r.add_argument("--boundary-tokens", type=int, default=RepairConfig.boundary_tokens, help="selective: k")
    r.add_argument("--recompute-ratio", type=float, default=RepairConfig.recompute_ratio,
                   help="cacheblend: fraction of reused tokens recomputed per layer, averaged (1.0 = full prefill)")
    r.add_argument("--taper", type=float, default=RepairConfig.taper,
                   help="cacheblend: first repaired layer's set over the last's (1.0 = one set, original CacheBlend)")
    r.add_argument("--recency", type=float, default=RepairConfig.recency,
                   help="cacheblend: exponent of the position weight on deviation (0 = none)")
    r.add_argument("--check-layer", type=int, default=RepairConfig.check_layer, help="cacheblend: check layer")
    r.add_argument("--select", default=RepairConfig.select, choices=SELECTS,
                   help="cacheblend: rank reused tokens by KV deviation, or pick at random (the control)")
    r.add_argument("--no-drift", dest="drift", action="store_false",
                   help="cacheblend: serve the reused documents' K/V as stored, without the model's drift maps")
    r.add_argument("--drift-strength", type=float, default=RepairConfig.drift_strength,
                   help="cacheblend: how far the drift maps move the reused K/V (0 = as stored, 1 = as fitted)")
    r.add_argument("--qa-order", default=RepairConfig.qa_order, choices=QA_ORDERS,
                   help="queryaware: keep the documents in place, or move the ones the question needs last "
                        "(a rewritten prompt)")


def add_strategy_option(parser: argparse.ArgumentParser, default: str = "cacheblend") -> None:
    parser.add_argument("--strategy", default=default, choices=STRATEGIES)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine options as a config; a value out of range is refused naming its flag."""
    with flags_named():
        return EngineConfig(
            dtype=args.dtype,
            chunking=ChunkingConfig(max_chunk_tokens=args.max_chunk_tokens, doc_context=args.doc_context),
            repair=RepairConfig(boundary_tokens=args.boundary_tokens, recompute_ratio=args.recompute_ratio,
                                taper=args.taper, recency=args.recency, check_layer=args.check_layer,
                                select=args.select, qa_order=args.qa_order, drift=args.drift,
                                drift_strength=args.drift_strength),
            store=StoreConfig(memory_budget_bytes=args.memory_budget, disk_dir=args.store, kv_bits=args.kv_bits),
        )


def sampling_params(**values) -> SamplingParams:
    """SamplingParams from the command line's values, refused naming the flag: checked before any model loads."""
    with flags_named():
        return SamplingParams(**values)


def make_engine(args: argparse.Namespace, config: EngineConfig | None = None):
    """The engine the options describe, its repair settings checked against the model it loaded."""
    from ..engine import KVBoost

    # The engine checks the repair settings against the model it loads (check_for_model).
    with flags_named():
        return KVBoost.from_pretrained(args.model, config=config or engine_config(args))


TEXT_SUFFIXES = {".txt", ".md", ".rst", ".text"}


def read_documents(paths: list[Path]) -> list[tuple[Path, str]]:
    """Each file is one document; a folder contributes its text files (recursively, sorted)."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"{path}: no such file or folder")
    if not files:
        raise ValueError(f"no text files ({', '.join(sorted(TEXT_SUFFIXES))}) found in {', '.join(map(str, paths))}")
    docs = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            raise ValueError(f"{f} is empty: remove it or give it some text")
        docs.append((f, text))
    return docs
