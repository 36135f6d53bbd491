"""`kvboost-rag store stats|verify|prune DIR`: look after a disk KV store without loading a model
(`store verify redis://host:6379/0` checks a Redis tier the same way, see store/redis_verify.py).

stats reads only file headers (fast), and the shadow checks' figures kept with the fidelity calibration (the
guard's predicted chance of a differing answer against the share observed, and its predicted flips against those
observed over the served tokens; see fidelity.Observed); verify reads every file and checks it as its kind says (K/V
files, document indexes record by record, the calibration's drift maps and fidelity predictor, the tier's
index), listing temp files and files that are not ours; prune removes damaged files and left-over temp files,
drops a document index's bad records, then optionally removes the least recently used K/V files to meet a size
or age limit. Intact document indexes and calibrations are never removed: they are not recomputed by just using
the store.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

from kvboost_rag import fidelity
from kvboost_rag.config import REDIS_SCHEMES
from kvboost_rag.store.entries import BadEntryFile, read_header
from kvboost_rag.store.folder import file_kind, prune_dir, verify_dir

_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `store` and its subcommands on the top-level dispatcher's subparsers."""
    parser = subparsers.add_parser(
        "store",
        help="inspect, verify and prune a disk KV store",
        description="Look after a disk KV store: stats reads headers only, verify checks every file, "
        "prune removes damaged files and optionally the least recently used ones.",
    )
    commands = parser.add_subparsers(dest="store_command", required=True, metavar="{stats,verify,prune}")

    stats = commands.add_parser("stats", help="files, bytes, tokens and models in DIR (headers only), and the "
                                              "fidelity guard's predicted against observed figures")
    verify = commands.add_parser(
        "verify", help="read every file in DIR and check it; exit 1 if any is bad or not kvboost-rag's"
    )
    prune = commands.add_parser(
        "prune", help="remove damaged files and left-over temp files, then LRU K/V files to meet the limits"
    )
    for sub in (stats, verify, prune):
        sub.add_argument("dir", metavar="DIR", help="the store's disk_dir (verify also takes the URL of a Redis "
                                                    "tier: redis://host:6379/0)")
        sub.add_argument("--json", action="store_true", help="print a JSON report instead of text")
    for sub in (verify, prune):
        sub.add_argument(
            "--fingerprint",
            help="model fingerprint the files must carry (others count as foreign); default: accept any",
        )
    prune.add_argument(
        "--max-bytes", type=parse_size, help="keep at most this much, e.g. 500M or 20G (1024-based)"
    )
    prune.add_argument("--max-age-days", type=float, help="remove files not read for this many days")
    prune.add_argument(
        "--remove-foreign", action="store_true", help="also remove other fingerprints' K/V files"
    )
    prune.add_argument("--dry-run", action="store_true", help="report what would be removed, remove nothing")
    parser.set_defaults(func=main)
    return parser


def main(args: argparse.Namespace) -> int:
    if str(args.dir).startswith(REDIS_SCHEMES):
        if args.store_command != "verify":
            print(f"kvboost-rag store {args.store_command}: works on a store folder; a Redis tier is sized by its "
                  "own maxmemory policy (allkeys-lru), and `kvboost-rag store verify URL` checks it", file=sys.stderr)
            return 2
        return _verify_redis(args)
    args.dir = Path(args.dir)
    if not args.dir.is_dir():
        print(f"kvboost-rag store: {args.dir} is not a directory", file=sys.stderr)
        return 2
    if args.store_command == "prune" and args.remove_foreign and args.fingerprint is None:
        print("kvboost-rag store prune: --remove-foreign needs --fingerprint", file=sys.stderr)
        return 2
    try:
        return {"stats": _stats, "verify": _verify, "prune": _prune}[args.store_command](args)
    except OSError as e:  # e.g. prune on a read-only folder
        print(f"kvboost-rag store {args.store_command}: {e}", file=sys.stderr)
        return 1


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 500M or 20G)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _stats(args: argparse.Namespace) -> int:
    by_model: dict[str, Counter] = {}
    kinds: dict[str, list[Path]] = {}
    for path in sorted(args.dir.iterdir()):
        kinds.setdefault(file_kind(path) if path.is_file() else "other", []).append(path)
    unreadable = 0
    for path in kinds.get("entry", []):
        try:
            meta = read_header(path)
            shape = json.loads(meta["key_shape"])  # [L, H_kv, S, D]
            model = by_model.setdefault(meta.get("fingerprint", "?"), Counter())
            model["files"] += 1
            model["bytes"] += path.stat().st_size
            model["tokens"] += shape[2]
            model[f"kv_bits={meta.get('kv_bits', '?')}"] += 1
        except (BadEntryFile, KeyError, ValueError, IndexError, OSError):
            unreadable += 1
    report = dict(
        directory=str(args.dir),
        files=sum(m["files"] for m in by_model.values()) + unreadable,
        bytes=sum(m["bytes"] for m in by_model.values()),
        unreadable=unreadable,
        temp_files=len(kinds.get("temp", [])),
        fingerprints={fp: dict(sorted(m.items())) for fp, m in sorted(by_model.items())},
        drift_maps=len(kinds.get("drift", [])),
        fidelity_calibrations=len(kinds.get("fidelity", [])),
        document_indexes=len(kinds.get("documents", [])),
        documents=sum(_count_lines(p) for p in kinds.get("documents", [])),
        store_indexes=len(kinds.get("index", [])),
        other_files=len(kinds.get("other", [])),
        # Per fidelity calibration: the shadow checks' figures (Observed.figures), None before any, or why unreadable
        observed_fidelity={p.name: _observed(p) for p in kinds.get("fidelity", [])},
    )
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{report['directory']}: {report['files']} entry files, {_human(report['bytes'])}")
    for fp, m in report["fingerprints"].items():
        bits = ", ".join(f"{k} x{v}" for k, v in m.items() if k.startswith("kv_bits"))
        print(f"  fingerprint {fp}: {m['files']} files, {_human(m['bytes'])}, {m['tokens']} tokens ({bits})")
    if unreadable:
        print(f"  {unreadable} files with unreadable headers (run `kvboost-rag store verify {args.dir}`)")
    print(f"  {report['document_indexes']} document indexes ({report['documents']} records), "
          f"{report['drift_maps']} drift maps, {report['fidelity_calibrations']} fidelity calibrations, "
          f"{report['store_indexes']} store indexes")
    for name, figures in report["observed_fidelity"].items() or [("", None)]:
        if isinstance(figures, str):
            print(f"  observed fidelity ({name}): {figures} (run `kvboost-rag store verify {args.dir}`)")
        else:
            print("\n".join(observed_lines(name, figures)))
    if report["temp_files"]:
        print(f"  {report['temp_files']} temp files (interrupted or in-flight writes; prune removes left-over ones)")
    if report["other_files"]:
        print(f"  {report['other_files']} files that are not kvboost-rag's (run `kvboost-rag store verify {args.dir}`)")
    return 0


def _observed(path: Path) -> dict | str | None:
    """The shadow checks' figures kept with a fidelity calibration (fidelity.Observed.figures); None when a shadow
    check has not refit it yet; why, when its metadata cannot be read."""
    try:
        observed = fidelity.observed_in(path.read_bytes())
    except (ValueError, TypeError, OSError) as e:
        return f"unreadable ({e})"
    return None if observed is None else observed.figures()


def observed_lines(where: str, figures: dict | None) -> list[str]:
    """How `stats` (and `verify URL`) print the shadow checks' figures kept with the fidelity calibration `where`
    (a file or a Redis key; "": none), Observed.figures or None."""
    head = f"  observed fidelity{f' ({where})' if where else ''}: "
    if figures is None:
        return [head + "no shadow checks yet"]
    shown = {k: "-" if v is None else f"{v:.3f}" for k, v in figures.items() if k.endswith(("_share", "_ratio"))}
    return [head + f"{figures['checks']} shadow checks of served answers against a full prefill",
            f"    answers that differ: predicted {figures['predicted_differ']:.2f} of {figures['answers']} "
            f"({shown['predicted_differ_share']}), observed {figures['observed_differ']} "
            f"({shown['observed_differ_share']}), predicted/observed {shown['differ_ratio']}",
            f"    served tokens that flip: {_flips(figures)}"] + [
            f"    {FLOOR_WORDS[floor]} floor, judged tokens where it differs from full: {_flips(floor_figures)}"
            for floor, floor_figures in figures.get("floors", {}).items() if floor_figures["tokens"]]


# What each floor's full prefill is (fidelity.FLOOR_NAMES)
FLOOR_WORDS = {"order": "order (the documents reversed)", "dtype": "dtype (bf16)"}


def _flips(figures: dict) -> str:
    """Predicted against observed flips (fidelity._flip_figures) in words."""
    shown = {k: "-" if figures[k] is None else f"{figures[k]:.3f}"
             for k in ("predicted_flip_share", "observed_flip_share", "flip_ratio")}
    return (f"predicted {figures['predicted_flips']:.2f} of {figures['tokens']} ({shown['predicted_flip_share']}), "
            f"observed {figures['observed_flips']} ({shown['observed_flip_share']}), predicted/observed "
            f"{shown['flip_ratio']}")


def _count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


def _verify(args: argparse.Namespace) -> int:
    report = verify_dir(args.dir, args.fingerprint)
    if args.json:
        doc = dict(
            directory=str(args.dir),
            ok=report.ok,
            good=len(report.good),
            foreign=[str(p) for p in report.foreign],
            bad={str(p): why for p, why in report.bad.items()},
            fingerprints=report.fingerprints,
            temp_files=[str(p) for p in report.temp_files],
            drift_maps=[str(p) for p in report.drift_maps],
            fidelity_calibrations=[str(p) for p in report.fidelity],
            documents={str(p): n for p, n in report.documents.items()},
            bad_records={str(p): [dict(line=n, why=why) for n, why in v] for p, v in report.bad_records.items()},
            store_indexes=[str(p) for p in report.indexes],
            unknown=[str(p) for p in report.unknown],
        )
        print(json.dumps(doc, indent=2))
        return 0 if report.ok else 1
    kv_bad = sum(file_kind(p) not in ("documents", "drift", "fidelity", "index") for p in report.bad)
    print(f"{args.dir}: {len(report.good)} good, {kv_bad} bad, {len(report.foreign)} foreign K/V files")
    bad_records = sum(len(v) for v in report.bad_records.values())
    print(f"  {len(report.documents)} document indexes ({sum(report.documents.values())} intact records, "
          f"{bad_records} bad), {len(report.drift_maps)} intact drift maps, {len(report.fidelity)} intact fidelity "
          f"calibrations, {len(report.indexes)} store indexes, "
          f"{len(report.temp_files)} temp files, {len(report.unknown)} unknown files")
    for fp, n in sorted(report.fingerprints.items()):
        mark = "" if args.fingerprint in (None, fp) else " (foreign)"
        print(f"  fingerprint {fp}: {n} intact files{mark}")
    for path, why in report.bad.items():
        print(f"  BAD {path.name}: {why}")
    for path in report.temp_files:
        print(f"  TEMP {path.name}: left by an interrupted write, or one in flight")
    for path in report.unknown:
        print(f"  UNKNOWN {path.name}: not a kvboost-rag file; move it out of the store folder")
    if report.bad:
        print(f"run `kvboost-rag store prune {args.dir}` to remove the bad files (they are recomputed on use) and "
              "drop the bad records of document indexes (those documents are tokenized again when ingested)")
    elif report.temp_files:
        print(f"`kvboost-rag store prune {args.dir}` removes the temp files no writer holds any more")
    return 0 if report.ok else 1


def _verify_redis(args: argparse.Namespace) -> int:
    from kvboost_rag.store.redis_verify import verify_redis  # needs the redis client: only for a Redis URL

    try:
        report = verify_redis(args.dir, args.fingerprint)
    except Exception as e:  # noqa: BLE001 - the client's errors (unreachable, refused) and a missing client
        print(f"kvboost-rag store verify: cannot read the Redis store at {args.dir}: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 2
    if args.json:
        doc = dict(url=report.url, ok=report.ok, good=report.good, foreign=report.foreign,
                   fingerprints=report.fingerprints, pointers=report.pointers, stale_pointers=report.stale_pointers,
                   calibrations=report.calibrations, documents=report.documents, bad=report.bad,
                   unknown=report.unknown, other_keys=report.other_keys,
                   observed_fidelity={key: None if o is None else o.figures() for key, o in report.observed.items()})
        print(json.dumps(doc, indent=2))
        return 0 if report.ok else 1
    kv_bad = sum(":p:" in key for key in report.bad)
    print(f"{report.url}: {report.good} good, {kv_bad} bad, {report.foreign} foreign entries")
    print(f"  {report.pointers} content pointers ({report.stale_pointers} stale: their entry is gone), "
          f"{len(report.documents)} document indexes ({sum(report.documents.values())} intact records), "
          f"{len(report.calibrations)} intact calibrations, {len(report.unknown)} unknown keys under kvboost:, "
          f"{report.other_keys} other keys (not kvboost-rag's, left alone)")
    for fp, n in sorted(report.fingerprints.items()):
        mark = "" if args.fingerprint in (None, fp) else " (foreign)"
        print(f"  fingerprint {fp}: {n} intact entries{mark}")
    for key, observed in report.observed.items():
        print("\n".join(observed_lines(key, None if observed is None else observed.figures())))
    for key, why in report.bad.items():
        print(f"  BAD {key}: {why}")
    for key in report.unknown:
        print(f"  UNKNOWN {key}: not named like anything kvboost-rag writes")
    if report.bad:
        print("an engine deletes a bad value when it reads it (a chunk is then recomputed, a document tokenized again "
              "when ingested, a calibration fitted again); `redis-cli DEL KEY` removes one now")
    return 0 if report.ok else 1


def _prune(args: argparse.Namespace) -> int:
    report = prune_dir(
        args.dir,
        args.fingerprint,
        max_bytes=args.max_bytes,
        max_age_s=None if args.max_age_days is None else args.max_age_days * 86400.0,
        remove_foreign=args.remove_foreign,
        dry_run=args.dry_run,
    )
    if args.json:
        doc = dict(
            directory=str(args.dir),
            dry_run=report.dry_run,
            removed=[dict(file=str(p), why=why) for p, why in report.removed],
            compacted=[dict(file=str(p), why=why) for p, why in report.compacted],
            freed_bytes=report.freed_bytes,
            kept_files=report.kept_files,
            kept_bytes=report.kept_bytes,
        )
        print(json.dumps(doc, indent=2))
        return 0
    verb = "would remove" if report.dry_run else "removed"
    for path, why in report.removed:
        print(f"  {verb} {path.name}: {why}")
    for path, why in report.compacted:
        print(f"  {'would rewrite' if report.dry_run else 'rewrote'} {path.name}: {why}")
    rewrote = f", {'would rewrite' if report.dry_run else 'rewrote'} {len(report.compacted)} document indexes"
    print(
        f"{args.dir}: {verb} {len(report.removed)} files{rewrote if report.compacted else ''} "
        f"({_human(report.freed_bytes)} freed); kept {report.kept_files} K/V files ({_human(report.kept_bytes)}), "
        "and every intact document index and calibration"
    )
    return 0


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
