"""The K/V entry format: one stored chunk as a safetensors payload, checked on every read.

Its metadata says which format, model fingerprint and quantization wrote it, and carries an xxh3_128
checksum over the metadata and every tensor byte. The disk tier keeps one file per entry
(`<prefix_key hex>.safetensors`: `write_entry`, `read_entry`), the Redis tier one value per entry (the same
bytes: `entry_bytes`, `entry_from_bytes`). A damaged, foreign or unknown-version entry is never served.
"""

from __future__ import annotations

import contextlib
import json
import struct
import warnings
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import load, save

from kvboost_rag.store.files import DEFAULT_FILE_MODE, write_atomic
from kvboost_rag.store.quant import QuantizedKV, StoredEntry

FORMAT_VERSION = 1
SUFFIX = ".safetensors"
_DTYPES = {
    str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
}


class StoreIntegrityWarning(UserWarning):
    """A stored KV file was ignored because it is damaged, foreign or of another format version."""


class BadEntryFile(Exception):
    """A KV file that must not be served; `str()` says what is wrong with it."""


# -- one file ----------------------------------------------------------------------------------


def entry_path(directory: Path, prefix_key: bytes) -> Path:
    return Path(directory) / f"{prefix_key.hex()}{SUFFIX}"


def write_entry(path: Path, stored: StoredEntry, fingerprint: str, file_mode: int = DEFAULT_FILE_MODE) -> None:
    """Write `stored` to `path` atomically, with permissions `file_mode`."""
    write_atomic(path, entry_bytes(stored, fingerprint), file_mode)


def entry_bytes(stored: StoredEntry, fingerprint: str) -> bytes:
    """`stored` in the K/V file format (safetensors; metadata with format version, fingerprint, checksum):
    what `write_entry` writes and the Redis tier stores as a value."""
    tensors = {"token_ids": torch.tensor(stored.token_ids, dtype=torch.int64)}
    if stored.raw is not None:
        tensors["keys"], tensors["values"] = stored.raw
        key_shape, value_shape = stored.raw[0].shape, stored.raw[1].shape
        group_size = 0
    else:
        tensors.update(stored.quantized.tensors())
        key_shape, value_shape = stored.quantized.key_shape, stored.quantized.value_shape
        group_size = stored.quantized.group_size
    tensors = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    meta = {
        "format_version": str(FORMAT_VERSION),
        "fingerprint": fingerprint,
        "kv_bits": str(stored.bits),
        "group_size": str(group_size),
        "dtype": str(stored.dtype).removeprefix("torch."),
        "start": str(stored.start),
        "key_shape": json.dumps(list(key_shape)),
        "value_shape": json.dumps(list(value_shape)),
        "prefix_key": stored.prefix_key.hex(),
        "content_key": stored.content_key.hex(),
    }
    meta["checksum"] = _checksum(meta, tensors)
    return save(tensors, metadata=meta)


def read_header(path: Path) -> dict[str, str]:
    """The file's metadata, without reading or checking its tensors. Raises BadEntryFile."""
    with _open(path) as f:
        return _metadata(f)


def read_entry(path: Path, *, fingerprint: str | None = None, prefix_key: bytes | None = None) -> StoredEntry:
    """Read and check a file: format version, fingerprint (when given), prefix key (when given),
    checksum, tensor layout. Raises BadEntryFile on any failure, FileNotFoundError when absent."""
    # One open for metadata and tensors: a concurrent os.replace cannot mix two versions.
    with _open(path) as f:
        meta = _metadata(f)
        _check_header(meta, fingerprint, prefix_key)
        try:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a dict
        except Exception as e:
            raise BadEntryFile(f"unreadable ({e})") from e
    return _verified(meta, tensors)


def entry_from_bytes(data: bytes, *, fingerprint: str | None = None, prefix_key: bytes | None = None) -> StoredEntry:
    """Check and decode `entry_bytes` output as `read_entry` does a file. Raises BadEntryFile."""
    try:
        (header_len,) = struct.unpack_from("<Q", data)  # safetensors: u64 header length, JSON header, tensors
        header = json.loads(bytes(data[8:8 + header_len]))
        meta = header.get("__metadata__") if isinstance(header, dict) else None
    except (struct.error, ValueError) as e:  # truncated, or not safetensors at all
        raise BadEntryFile(f"unreadable ({e})") from e
    if not isinstance(meta, dict) or not meta:
        raise BadEntryFile("no kvboost-rag metadata")
    _check_header(meta, fingerprint, prefix_key)
    try:
        tensors = load(bytes(data))
    except Exception as e:  # safetensors raises its own error type for every kind of damage
        raise BadEntryFile(f"unreadable ({e})") from e
    return _verified(meta, tensors)


def _check_header(meta: dict[str, str], fingerprint: str | None, prefix_key: bytes | None) -> None:
    if meta.get("format_version") != str(FORMAT_VERSION):
        version = meta.get("format_version")
        raise BadEntryFile(f"format version {version!r}, this kvboost-rag reads {FORMAT_VERSION}")
    if fingerprint is not None and meta.get("fingerprint") != fingerprint:
        raise BadEntryFile(f"written for model fingerprint {meta.get('fingerprint')!r}, not {fingerprint!r}")
    if prefix_key is not None and meta.get("prefix_key") != prefix_key.hex():
        raise BadEntryFile(f"holds prefix key {meta.get('prefix_key')}, not the one its name says")


def _verified(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> StoredEntry:
    """The entry, once the checksum and the layout check out. Raises BadEntryFile."""
    body = {k: v for k, v in meta.items() if k != "checksum"}
    if meta.get("checksum") != _checksum(body, tensors):
        raise BadEntryFile("checksum mismatch (damaged after it was written)")
    try:
        return _stored_from(meta, tensors)
    except (KeyError, ValueError, TypeError) as e:
        raise BadEntryFile(f"inconsistent contents ({e})") from e


@contextlib.contextmanager
def _open(path: Path):
    try:
        f = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error type for every kind of damage
        if not Path(path).exists():
            raise FileNotFoundError(path) from e  # absent or removed meanwhile: a miss, not damage
        raise BadEntryFile(f"unreadable ({e})") from e
    with f:
        yield f


def _metadata(f) -> dict[str, str]:
    meta = f.metadata()
    if not meta:
        raise BadEntryFile("no kvboost-rag metadata")
    return meta


def _stored_from(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> StoredEntry:
    bits = int(meta["kv_bits"])
    common = dict(
        token_ids=tuple(tensors["token_ids"].tolist()),
        start=int(meta["start"]),
        prefix_key=bytes.fromhex(meta["prefix_key"]),
        content_key=bytes.fromhex(meta["content_key"]),
        dtype=_DTYPES[meta["dtype"]],
    )
    key_shape, value_shape = tuple(json.loads(meta["key_shape"])), tuple(json.loads(meta["value_shape"]))
    # [L, H_kv, S, D]: S is the number of token ids, and keys and values agree on L, H_kv and S.
    if len(key_shape) != 4 or key_shape[:3] != value_shape[:3] or key_shape[2] != len(common["token_ids"]):
        raise ValueError(f"KV shapes {key_shape} and {value_shape} do not fit {len(common['token_ids'])} tokens")
    if bits == 16:
        keys, values = tensors["keys"], tensors["values"]
        if tuple(keys.shape) != key_shape or tuple(values.shape) != value_shape:
            raise ValueError("tensor shapes differ from the recorded ones")
        if keys.dtype != common["dtype"] or values.dtype != common["dtype"]:
            raise ValueError(f"tensors are {keys.dtype} and {values.dtype}, not the recorded {common['dtype']}")
        return StoredEntry(**common, raw=(keys, values))
    q = QuantizedKV.from_tensors(tensors, key_shape, value_shape, bits, int(meta["group_size"]))
    return StoredEntry(**common, quantized=q)


def _checksum(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """xxh3_128 over the metadata and every tensor's name, dtype, shape and bytes, in name order."""
    h = xxhash.xxh3_128()
    h.update(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}:{t.dtype}:{list(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, no copy
    return h.hexdigest()


def _warn_bad(path: Path, problem: str) -> None:
    warnings.warn(
        f"kvboost-rag: ignoring stored KV file {path}: {problem}. The chunk will be recomputed and the "
        f"file overwritten; run `kvboost-rag store verify {path.parent}` to check the directory and "
        f"`kvboost-rag store prune {path.parent}` to remove damaged files.",
        StoreIntegrityWarning,
        stacklevel=3,
    )
