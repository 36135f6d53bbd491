"""Options shared by the subcommands: the model, dtype, store and repair settings, and reading documents."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..config import (
    DOC_CONTEXTS,
    DTYPE_NAMES,
    KV_BITS,
    ChunkingConfig,
    ConfigError,
    EngineConfig,
    RepairConfig,
    StoreConfig,
)
from ..generation import SamplingParams
from ..models import MODEL_HELP, resolve_device
from ..prompts import LAYOUTS
from ..repair import get_strategy, names

# The flag each config field is set by, where it is not "--" + the field's name with dashes.
_FLAGS = {"memory_budget_bytes": "--memory-budget", "disk_dir": "--store"}


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


def add_engine_options(parser: argparse.ArgumentParser, *, repair: bool = True) -> None:
    """The model, dtype, store and encoding options; with `repair`, also one flag per RepairConfig field
    (a command that answers no prompt, such as ingest, leaves them out)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help=MODEL_HELP)
    g.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    add_config_option(g, EngineConfig, "device")
    add_config_option(g, EngineConfig, "transposed_weights", action=argparse.BooleanOptionalAction)
    g.add_argument("--store", default=None, help="persistent KV store: a folder (disk tier) or a Redis URL, "
                   "redis://host:6379/0 (a tier shared by processes and machines)")
    g.add_argument("--memory-budget", type=int, default=None, help="bytes the in-memory tier may hold")
    g.add_argument("--kv-bits", type=int, default=StoreConfig.kv_bits, choices=KV_BITS, help="stored KV precision")
    g.add_argument("--max-chunk-tokens", type=int, default=ChunkingConfig.max_chunk_tokens)
    g.add_argument("--doc-context", default=ChunkingConfig.doc_context, choices=DOC_CONTEXTS,
                   help="what documents are encoded after at ingestion: nothing, the chat template's opening, "
                        "or that and a neutral passage (as a later document of a prompt)")
    g.add_argument("--calibration-layout", default=EngineConfig.calibration_layout, choices=tuple(LAYOUTS),
                   help="how the prompts ingestion calibrates on lay out the documents and a question: as your "
                        "application does (the bench's, LangChain's, LlamaIndex's, in tags)")
    if repair:
        add_config_option(g, EngineConfig, "floor_credit", type=float)
        add_config_option(g, EngineConfig, "strict_likeness", type=float)
        add_config_option(g, EngineConfig, "lookahead", type=count(0))
        add_repair_options(parser)


def add_config_option(group, config_class, name: str, **overrides) -> None:
    """The flag of one config field, with the field's own default and help text (declared once, in config.py)."""
    f = next(f for f in dataclasses.fields(config_class) if f.name == name)
    group.add_argument(flag(name), **{"default": f.default, "help": f.metadata["help"], **overrides})


def add_repair_options(parser: argparse.ArgumentParser) -> None:
    """One flag per RepairConfig field, with the field's own default and help text."""
    r = parser.add_argument_group("repair")
    for f in dataclasses.fields(RepairConfig):
        if f.type in (bool, "bool"):  # --drift / --no-drift
            r.add_argument(flag(f.name), default=f.default, action=argparse.BooleanOptionalAction,
                           help=f.metadata["help"])
        else:
            kind = {"int": int, "float": float, "float | None": float, "str": str,
                    "str | float": level_or_number}.get(f.type, f.type)
            r.add_argument(flag(f.name), type=kind, default=f.default, help=f.metadata["help"])


def level_or_number(text: str) -> str | float:
    """A named level as it is, anything else as a number (RepairConfig checks both)."""
    try:
        return float(text)
    except ValueError:
        return text


def add_strategy_option(parser: argparse.ArgumentParser, default: str = "cacheblend") -> None:
    parser.add_argument("--strategy", default=default, choices=names(),
                        help="; ".join(f"{name}: {get_strategy(name).summary}" for name in names()))


def repair_config(args: argparse.Namespace) -> RepairConfig:
    """RepairConfig from the flags add_repair_options made (defaults where a command has none)."""
    with flags_named():
        return RepairConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RepairConfig)
                               if hasattr(args, f.name)})


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine options as a config; a value out of range is refused naming its flag."""
    repair = repair_config(args)
    with flags_named():
        config = EngineConfig(
            dtype=args.dtype,
            device=args.device,
            chunking=ChunkingConfig(max_chunk_tokens=args.max_chunk_tokens, doc_context=args.doc_context),
            repair=repair,
            store=StoreConfig(memory_budget_bytes=args.memory_budget, disk_dir=args.store, kv_bits=args.kv_bits),
            calibration_layout=getattr(args, "calibration_layout", EngineConfig.calibration_layout),
            floor_credit=getattr(args, "floor_credit", EngineConfig.floor_credit),
            strict_likeness=getattr(args, "strict_likeness", EngineConfig.strict_likeness),
            lookahead=getattr(args, "lookahead", EngineConfig.lookahead),
            transposed_weights=args.transposed_weights,
        )
        resolve_device(config.device)  # "cuda" on a machine without one is refused here, before anything is read
        return config


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
