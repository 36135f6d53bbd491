"""The store folder as a whole: what each file in it is, checking every one, and pruning.

One folder holds the disk tier's K/V files and index (store/disk.py), the engine's document index
(`documents-*.jsonl`, see documents.py), the corpus's calibration (`drift-*.safetensors`, the drift maps, see
drift.py; `fidelity-*.safetensors`, the fidelity guard's predictor, see fidelity.py; both written by
calibrate.save), temp files of writes in flight or interrupted (store/files.py), and maybe files that are not
ours. `file_kind`
tells them apart by name alone; `verify_dir` checks each as its kind says and `prune_dir` removes what is
damaged or left over, and what it takes to meet an age or size limit. They live apart from the disk tier
because they judge every kind of file, not only the K/V files (`kvboost-rag store verify/prune` call them
on a folder without opening a store).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch

from kvboost_rag.store.documents import describe_bad_records, drop_bad_records, read_records
from kvboost_rag.store.entries import SUFFIX, BadEntryFile, read_entry, read_header
from kvboost_rag.store.files import TEMP_SUFFIX, _mtime, _stat, is_locked, safetensors_metadata

# What each name in the folder is (see file_kind). Prefix keys are written as lowercase hex by entry_path.
_KINDS = (
    ("entry", re.compile(r"(?:[0-9a-f]{2})+\.safetensors")),
    ("drift", re.compile(r"drift-[0-9a-f]{16}\.safetensors")),  # calibrate.save, named by the engine
    ("fidelity", re.compile(r"fidelity-[0-9a-f]{16}\.safetensors")),  # calibrate.save, named by the engine
    ("documents", re.compile(r"documents-[0-9a-f]{16}\.jsonl")),  # DocumentIndex, named by make_index
    ("index", re.compile(r"index-[0-9a-f]{16}\.json")),  # DiskStore's own index
)


def file_kind(path: Path) -> str:
    """What a name in the store folder is: "entry" (a K/V file), "drift" (fitted drift maps), "fidelity" (the
    fidelity guard's fitted predictor), "documents" (the document index), "index" (the disk tier's index),
    "temp" (a write in flight or interrupted) or "other" (not named like any of ours)."""
    name = Path(path).name
    if name.endswith(TEMP_SUFFIX):
        return "temp"
    for kind, pattern in _KINDS:
        if pattern.fullmatch(name):
            return kind
    return "other"


@dataclass
class VerifyReport:
    """What `verify_dir` found: every file of the folder, by kind."""

    good: list[Path] = field(default_factory=list)  # intact K/V files (of the fingerprint, when one is given)
    bad: dict[Path, str] = field(default_factory=dict)  # any file that fails its checks -> what is wrong
    foreign: list[Path] = field(default_factory=list)  # intact K/V files of another fingerprint
    fingerprints: dict[str, int] = field(default_factory=dict)  # intact K/V files per fingerprint
    temp_files: list[Path] = field(default_factory=list)  # left by interrupted writes (or in flight)
    drift_maps: list[Path] = field(default_factory=list)  # intact fitted drift maps
    fidelity: list[Path] = field(default_factory=list)  # intact fitted fidelity predictors
    documents: dict[Path, int] = field(default_factory=dict)  # document index -> intact records
    # Document index -> (line, why) of each record the engine would skip; such a file is also in `bad`.
    bad_records: dict[Path, list[tuple[int, str]]] = field(default_factory=dict)
    indexes: list[Path] = field(default_factory=list)  # the disk tier's own index files (readable)
    unknown: list[Path] = field(default_factory=list)  # not kvboost-rag's: never removed

    @property
    def ok(self) -> bool:
        """Every file is intact or of a known kind (temp files are; unknown ones are not)."""
        return not self.bad and not self.unknown


@dataclass
class PruneReport:
    removed: list[tuple[Path, str]]  # file, why
    freed_bytes: int
    kept_files: int  # K/V files
    kept_bytes: int
    dry_run: bool
    compacted: list[tuple[Path, str]] = field(default_factory=list)  # document indexes rewritten, what was dropped


def list_entry_files(directory: Path) -> list[Path]:
    """The K/V files in `directory` (named by their prefix key), sorted."""
    return sorted(p for p in Path(directory).glob(f"*{SUFFIX}") if file_kind(p) == "entry" and p.is_file())


def verify_dir(directory: str | os.PathLike, fingerprint: str | None = None) -> VerifyReport:
    """Check every file in the folder as its kind says: K/V files read in full (checksums included), drift
    maps and fidelity predictors loaded, document indexes record by record, this tier's index parsed; temp files
    and files that are not kvboost-rag's listed. Without a fingerprint, any intact K/V file is good and
    `fingerprints` says how many each model wrote."""

    directory = Path(directory)
    report = VerifyReport()
    for path in sorted(directory.iterdir()) if directory.is_dir() else []:
        kind = file_kind(path) if path.is_file() else "other"
        try:
            if kind == "entry":
                _verify_entry(path, fingerprint, report)
            elif kind in CALIBRATIONS:
                check_calibration(kind, path.read_bytes(), path.stem.removeprefix(f"{kind}-"))
                (report.drift_maps if kind == "drift" else report.fidelity).append(path)
            elif kind == "documents":
                docs, problems = read_records(path)
                report.documents[path] = len(docs)
                if problems:
                    report.bad_records[path] = problems
                    report.bad[path] = describe_bad_records(problems)
            elif kind == "index":
                _check_index(path)
                report.indexes.append(path)
            elif kind == "temp":
                report.temp_files.append(path)
            elif path.name.endswith(SUFFIX) and path.is_file() and _has_our_metadata(path):
                report.bad[path] = "kvboost-rag metadata, but the file name is not a prefix key: never served"
            else:
                report.unknown.append(path)
        except FileNotFoundError:
            continue  # removed while we looked
        except (BadEntryFile, OSError) as e:
            report.bad[path] = str(e)
    return report


def _verify_entry(path: Path, fingerprint: str | None, report: VerifyReport) -> None:
    try:
        read_entry(path, prefix_key=bytes.fromhex(path.stem))
        owner = read_header(path)["fingerprint"]
    except KeyError as e:
        raise BadEntryFile(f"no {e} in its metadata") from e
    report.fingerprints[owner] = report.fingerprints.get(owner, 0) + 1
    (report.good if fingerprint in (None, owner) else report.foreign).append(path)


# The corpus's calibration (calibrate.save): a file beside the disk tier, a value in the Redis tier, the same bytes.
CALIBRATIONS = ("drift", "fidelity")


def check_calibration(kind: str, data: bytes, namespace: str) -> None:
    """Raise BadEntryFile unless `data` is calibration `kind` ("drift" or "fidelity") that an engine whose
    fingerprint starts with `namespace` (the 16 characters a file name or Redis key holds) would use: its metadata
    (format version, that fingerprint), its shapes and finite numbers, checked as drift.from_bytes and
    fidelity.from_bytes check them without the model (the drift maps' shapes against the model are the engine's)."""
    # Imported here, not at the top: both import store/files.py, and the store is imported before them.
    from kvboost_rag import drift, fidelity

    module, what, then = {"drift": (drift, "drift maps", "refit them with KVBoost.fit_drift()"),
                          "fidelity": (fidelity, "fidelity calibration", "the next ingest fits it again")}[kind]
    try:
        meta = safetensors_metadata(data)
        tensors = safetensors.torch.load(bytes(data))
    except Exception as e:  # safetensors' own error types: damaged or truncated bytes
        raise BadEntryFile(f"unreadable {what} ({e})") from e
    if meta.get("version") != str(module.VERSION):
        raise BadEntryFile(f"{what} of version {meta.get('version')!r}, this kvboost-rag reads {module.VERSION}: "
                           f"{then}")
    if meta.get("fingerprint", "")[:16] != namespace:
        raise BadEntryFile(f"{what} for model fingerprint {meta.get('fingerprint')!r}, not the one its name says")
    if kind == "drift":
        keys, values = tensors.get("keys"), tensors.get("values")
        if keys is None or values is None:
            raise BadEntryFile(f"unreadable {what} (no keys or values tensor)")
        if keys.dim() != 5 or keys.shape != values.shape or keys.shape[-2] != keys.shape[-1] + 1:
            raise BadEntryFile(f"drift maps of shape {list(keys.shape)} / {list(values.shape)}, not "
                               "[P, L, H, D + 1, D]")
        if not (torch.isfinite(keys).all() and torch.isfinite(values).all()):
            raise BadEntryFile("drift maps hold NaN or infinite numbers")
        return
    curves = tensors.get("curves")
    if curves is None or curves.dim() != 2 or curves.shape[0] < 1 or curves.shape[1] != 13:
        shape = None if curves is None else list(curves.shape)
        raise BadEntryFile(f"fidelity calibration of shape {shape}, not [curves, 13]")
    if not torch.isfinite(curves[:, :5]).all():  # the floors' columns are NaN where a curve has no floors
        raise BadEntryFile("fidelity calibration holds NaN or infinite numbers")
    if fidelity.from_bytes(data, meta["fingerprint"]) is None:  # what else the engine refuses
        raise BadEntryFile("fidelity calibration the engine refuses (a curve's floors or the HALF step's curve "
                           "partly missing, or its metadata damaged)")


def _check_index(path: Path) -> None:
    try:
        doc = json.loads(path.read_bytes())
        if not (isinstance(doc.get("content"), dict) and isinstance(doc.get("others"), list)):
            raise ValueError("no content or others")
    except (ValueError, AttributeError) as e:
        raise BadEntryFile(f"unreadable store index ({e}); the disk tier rebuilds it from the files") from e


def _has_our_metadata(path: Path) -> bool:
    try:
        meta = read_header(path)
    except (BadEntryFile, OSError):
        return False
    return "format_version" in meta and "prefix_key" in meta


def prune_dir(
    directory: str | os.PathLike,
    fingerprint: str | None = None,
    *,
    max_bytes: int | None = None,
    max_age_s: float | None = None,
    remove_foreign: bool = False,
    dry_run: bool = False,
    temp_grace_s: float = 60.0,
) -> PruneReport:
    """Remove bad files and left-over temp files, and drop the bad records of document indexes; then,
    least recently used first (reads bump a file's mtime), K/V files unused for `max_age_s` and as many
    as it takes to fit `max_bytes`. Intact K/V files of another fingerprint are kept unless
    `remove_foreign`. Intact calibrations (drift maps, fidelity predictors) and document indexes, and files
    not kvboost-rag's, are never removed."""

    report = verify_dir(directory, fingerprint)
    now = time.time()
    sizes = {
        p: st.st_size
        for p in [*report.bad, *report.temp_files, *report.good, *report.foreign]
        if (st := _stat(p)) is not None
    }
    # A document index is compacted, not removed: its good records are the documents' tokenization.
    doomed = [(p, f"damaged: {why}") for p, why in report.bad.items() if p not in report.bad_records]
    doomed += [(p, "stale temp file") for p in report.temp_files if _left_over(p, now, temp_grace_s)]
    if remove_foreign:
        doomed += [(p, "written for another model fingerprint") for p in report.foreign]
    kept = [p for p in report.good + ([] if remove_foreign else report.foreign) if p in sizes]
    kept_bytes = sum(sizes[p] for p in kept)
    for path in sorted((p for p in report.good if p in sizes), key=_mtime):
        if max_age_s is not None and now - _mtime(path) > max_age_s:
            why = f"unused for more than {max_age_s:.0f} s"
        elif max_bytes is not None and kept_bytes > max_bytes:
            why = f"over the {max_bytes}-byte target"
        else:
            continue
        doomed.append((path, why))
        kept.remove(path)
        kept_bytes -= sizes[path]
    freed = sum(sizes.get(p, 0) for p, _ in doomed)
    compacted = [(p, f"dropped {len(problems)} bad record(s)") for p, problems in report.bad_records.items()]
    if not dry_run:
        for path, _ in doomed:
            path.unlink(missing_ok=True)
        freed += sum(drop_bad_records(path) for path, _ in compacted)
    return PruneReport(doomed, freed, len(kept), kept_bytes, dry_run, compacted)


def _left_over(path: Path, now: float, grace_s: float) -> bool:
    """A temp file is left over from an interrupted write, not in flight, when no writer holds its lock
    (write_atomic holds it from just after creating the file until after the rename) and it is older than
    `grace_s`, which covers the instant between creation and lock and filesystems without locks. An
    interrupted write is never resumed, so waiting costs only the disk space for a minute."""
    return now - _mtime(path) > grace_s and not is_locked(path)

