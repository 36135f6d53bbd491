"""Every store kvboost-rag writes passes its own check (issue 40, item 4), and each kind of thing in it, damaged,
fails it.

A calibrated ingestion writes K/V files, the document index, the disk tier's index and the corpus's calibration
(drift maps and the fidelity guard's predictor) into a folder, and the same things as keys into a Redis tier.
`kvboost-rag store verify` must know every one of them: the first test of each pair fails as soon as the product
writes a file or key of a kind verify does not know, until verify learns it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest
import redis
import safetensors.torch
import torch
from test_fidelity import corpus
from test_redis_store import _start_server, _stop

from kvboost_rag import EngineConfig, StoreConfig, drift, fidelity
from kvboost_rag import calibrate as calibration
from kvboost_rag.cli import store as store_cli
from kvboost_rag.store.documents import decode_record, encode_record
from kvboost_rag.store.files import safetensors_metadata
from kvboost_rag.store.folder import file_kind, list_entry_files, prune_dir, verify_dir

KNOWN_KINDS = {"entry", "drift", "fidelity", "documents", "index"}


def _cli(*argv) -> int:
    parser = argparse.ArgumentParser(prog="kvboost-rag")
    store_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def _synthetic_calibration(engine) -> None:
    """A predictor and drift maps of `engine`'s shapes, saved as calibration saves them (without fitting)."""
    a, numbers = engine.adapter, torch.Generator().manual_seed(0)
    shape = (2, a.num_layers, a.num_kv_heads, a.head_dim + 1, a.head_dim)  # [P, L, H_kv, D + 1, D]
    engine.set_drift(drift.DriftMaps(torch.randn(shape, generator=numbers), torch.randn(shape, generator=numbers), 3))
    engine.set_predictor(fidelity.Predictor(0.25, -1.5, tokens=64, flips=5, documents=len(corpus())))


# -- damage, to any safetensors calibration --------------------------------------------------------------


def _with_metadata(**changes):
    return lambda blob: safetensors.torch.save(safetensors.torch.load(blob),
                                               metadata={**safetensors_metadata(blob), **changes})


def _not_finite(blob: bytes) -> bytes:
    tensors = {k: torch.full_like(v, float("nan")) for k, v in safetensors.torch.load(blob).items()}
    return safetensors.torch.save(tensors, metadata=safetensors_metadata(blob))


def _wrong_shape(blob: bytes) -> bytes:
    tensors = {k: v.reshape(-1) for k, v in safetensors.torch.load(blob).items()}
    return safetensors.torch.save(tensors, metadata=safetensors_metadata(blob))


DAMAGES = {"foreign": _with_metadata(fingerprint="f" * 32), "old-version": _with_metadata(version="1"),
           "nan": _not_finite, "shape": _wrong_shape, "truncated": lambda blob: blob[:-7],
           "garbage": lambda blob: b"junk"}
WHY = {"foreign": "not the one its name says", "old-version": "of version '1'", "nan": "NaN", "shape": "shape",
       "truncated": "unreadable", "garbage": "unreadable"}


# -- a store folder ------------------------------------------------------------------------------------------


def test_a_calibrated_ingest_writes_only_kinds_verify_knows_and_verify_passes(make_tiny_engine, tmp_path, monkeypatch,
                                                                              capsys):
    monkeypatch.setattr(calibration, "PROMPTS", 4)  # what calibration writes, not how well it predicts
    engine = make_tiny_engine(EngineConfig(store=StoreConfig(disk_dir=tmp_path)), guarded=True)
    engine.ingest(corpus())  # calibrated by ingestion itself, as `kvboost-rag ingest` does
    engine.close()
    assert engine.counters["calibrations"] == 1
    kinds = {path.name: file_kind(path) for path in tmp_path.iterdir()}
    assert set(kinds.values()) == KNOWN_KINDS, kinds  # a new kind written: teach store/folder.py, then this test
    assert _cli("store", "verify", str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "1 intact drift maps, 1 intact fidelity calibrations" in out and "0 unknown files" in out
    assert _cli("store", "stats", str(tmp_path), "--json") == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["drift_maps"], stats["fidelity_calibrations"], stats["other_files"], stats["unreadable"]) == \
           (1, 1, 0, 0)
    assert _cli("store", "prune", str(tmp_path), "--max-bytes", "0") == 0  # every K/V file goes, nothing else
    assert engine.fidelity_path.exists() and engine.drift_path.exists() and not list_entry_files(tmp_path)
    assert _cli("store", "verify", str(tmp_path)) == 0


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("kind", ["drift", "fidelity"])
def test_a_damaged_calibration_file_fails_verify_and_is_pruned(make_tiny_engine, tmp_path, kind, damage, capsys):
    engine = make_tiny_engine(EngineConfig(store=StoreConfig(disk_dir=tmp_path)))
    engine.ingest(corpus()[:2])
    _synthetic_calibration(engine)
    engine.close()
    assert _cli("store", "verify", str(tmp_path)) == 0
    path = engine.drift_path if kind == "drift" else engine.fidelity_path
    path.write_bytes(DAMAGES[damage](path.read_bytes()))
    assert WHY[damage] in verify_dir(tmp_path).bad[path]
    assert _cli("store", "verify", str(tmp_path)) == 1
    assert f"BAD {path.name}" in capsys.readouterr().out
    assert [p for p, _ in prune_dir(tmp_path).removed] == [path]  # of no use to any engine: the next ingest refits
    assert _cli("store", "verify", str(tmp_path)) == 0


def test_a_fidelity_file_of_another_version_than_its_engine_reads_is_refused_by_both(make_tiny_engine, tmp_path):
    """verify's check of a fidelity file is the engine's: what verify passes the engine uses, and what the engine
    refuses verify fails."""
    engine = make_tiny_engine(EngineConfig(store=StoreConfig(disk_dir=tmp_path)))
    _synthetic_calibration(engine)
    data = engine.fidelity_path.read_bytes()
    assert fidelity.from_bytes(data, engine.fingerprint) is not None and verify_dir(tmp_path).ok
    floors_half_missing = safetensors.torch.load(data)["curves"]
    floors_half_missing[0, 5] = 1.0  # one floor value of eight: neither a floor nor none
    engine.fidelity_path.write_bytes(safetensors.torch.save({"curves": floors_half_missing},
                                                            metadata=safetensors_metadata(data)))
    assert fidelity.from_bytes(engine.fidelity_path.read_bytes(), engine.fingerprint) is None
    assert "refuses" in verify_dir(tmp_path).bad[engine.fidelity_path]


SEEN = fidelity.Observed(checks=3, answers=3, predicted_differ=1.25, observed_differ=1, tokens=48,
                         predicted_flips=3.5, observed_flips=5,  # what shadow checks saw (shadow.py)
                         order_tokens=40, order_predicted_flips=6.0, order_observed_flips=8)  # no bf16 model


def test_a_fidelity_file_from_before_the_shadow_figures_loads_and_shows_none(make_tiny_engine, tmp_path, capsys):
    """Issue 41: the shadow checks' figures are metadata of the fidelity file, of the same version: a file written
    before them (none in its metadata) is used as it was, passes verify and shows no checks; one with them shows
    them; damaged ones make the whole file one the engine refuses, and verify with it."""
    engine = make_tiny_engine(EngineConfig(store=StoreConfig(disk_dir=tmp_path)))
    rows = torch.tensor([[0.07, 0.25, -1.5, 64, 5] + [math.nan] * 8], dtype=torch.float64)
    old = safetensors.torch.save({"curves": rows, "half": torch.full((4,), math.nan, dtype=torch.float64)},
                                 metadata={"fingerprint": engine.fingerprint, "version": str(fidelity.VERSION),
                                           "documents": "10"})
    engine.fidelity_path.write_bytes(old)  # as written before any shadow check
    predictor = fidelity.Predictor(0.25, -1.5, tokens=64, flips=5, documents=10, budget=0.07)
    assert fidelity.from_bytes(old, engine.fingerprint) == predictor and predictor.observed is None
    assert make_tiny_engine(EngineConfig(store=StoreConfig(disk_dir=tmp_path))).predictor == predictor
    assert _cli("store", "verify", str(tmp_path)) == 0
    capsys.readouterr()
    name = engine.fidelity_path.name
    assert _cli("store", "stats", str(tmp_path)) == 0
    assert f"observed fidelity ({name}): no shadow checks yet" in capsys.readouterr().out
    assert _cli("store", "stats", str(tmp_path), "--json") == 0
    assert json.loads(capsys.readouterr().out)["observed_fidelity"] == {name: None}

    engine.set_predictor(dataclasses.replace(predictor, observed=SEEN))  # as a shadow check's refit saves it
    data = engine.fidelity_path.read_bytes()
    assert fidelity.from_bytes(data, engine.fingerprint).observed == SEEN and verify_dir(tmp_path).ok
    assert _cli("store", "stats", str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert f"observed fidelity ({name}): 3 shadow checks of served answers" in out
    assert "answers that differ: predicted 1.25 of 3 (0.417), observed 1 (0.333), predicted/observed 1.250" in out
    assert "served tokens that flip: predicted 3.50 of 48 (0.073), observed 5 (0.104), predicted/observed 0.700" in out
    assert ("order (the documents reversed) floor, judged tokens where it differs from full: predicted 6.00 of 40 "
            "(0.150), observed 8 (0.200), predicted/observed 0.750") in out
    assert "dtype (bf16) floor" not in out  # none checked
    assert _cli("store", "stats", str(tmp_path), "--json") == 0
    figures = json.loads(capsys.readouterr().out)["observed_fidelity"][name]
    assert figures == SEEN.figures() and figures["differ_ratio"] == pytest.approx(1.25)
    assert figures["floors"]["order"]["flip_ratio"] == pytest.approx(0.75)

    # Figures kept before the floors' were: read as no floor checked
    before_floors = json.dumps({k: v for k, v in dataclasses.asdict(SEEN).items()
                                if not k.startswith(("order", "dtype"))})
    engine.fidelity_path.write_bytes(_with_metadata(observed=before_floors)(data))
    seen = fidelity.from_bytes(engine.fidelity_path.read_bytes(), engine.fingerprint).observed
    assert seen == dataclasses.replace(SEEN, order_tokens=0, order_predicted_flips=0.0, order_observed_flips=0)
    assert _cli("store", "stats", str(tmp_path)) == 0 and "floor" not in capsys.readouterr().out

    for damaged in ('{"checks": 3}', SEEN.to_json().replace("48", "-48"),
                    SEEN.to_json().replace('"observed_flips": 5', '"observed_flips": NaN'),
                    SEEN.to_json().replace('"dtype_tokens": 0', '"dtype_tokens": 0.5'),
                    SEEN.to_json()[:-1] + ', "unknown": 1}', "not json"):
        engine.fidelity_path.write_bytes(_with_metadata(observed=damaged)(data))
        assert fidelity.from_bytes(engine.fidelity_path.read_bytes(), engine.fingerprint) is None
        assert "refuses" in verify_dir(tmp_path).bad[engine.fidelity_path]
        assert _cli("store", "stats", str(tmp_path)) == 0
        assert f"observed fidelity ({name}): unreadable" in capsys.readouterr().out


# -- a Redis tier --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    proc, url = _start_server(tmp_path_factory.mktemp("redis"))
    yield url
    _stop(proc)


@pytest.fixture
def raw(redis_server):
    client = redis.Redis.from_url(redis_server)
    client.flushall()
    yield client
    client.close()


def _verify_json(url: str, capsys, *options) -> tuple[int, dict]:
    code = _cli("store", "verify", url, "--json", *options)
    return code, json.loads(capsys.readouterr().out)


def test_a_calibrated_redis_store_holds_only_keys_verify_knows_and_verify_passes(redis_server, raw, make_tiny_engine,
                                                                                 monkeypatch, capsys):
    monkeypatch.setattr(calibration, "PROMPTS", 4)
    engine = make_tiny_engine(EngineConfig(store=StoreConfig(redis_url=redis_server)), guarded=True)
    engine.ingest(corpus())
    engine.close()
    assert engine.counters["calibrations"] == 1
    code, report = _verify_json(redis_server, capsys)
    assert code == 0 and report["ok"] and report["unknown"] == [] and report["bad"] == {}
    namespace = f"kvboost:{engine.fingerprint[:16]}"
    assert sorted(report["calibrations"]) == [f"{namespace}:calibration:drift", f"{namespace}:calibration:fidelity"]
    assert report["documents"] == {f"{namespace}:documents": len(corpus())}
    entries = len(raw.keys(f"{namespace}:p:*"))
    assert report["good"] == entries > 0 and report["fingerprints"] == {engine.fingerprint: entries}
    assert report["pointers"] == len(raw.keys(f"{namespace}:c:*")) > 0 and report["other_keys"] == 0
    # Whatever the product writes, verify knows: every key is counted in one of its kinds.
    counted = report["good"] + report["pointers"] + report["stale_pointers"] + len(report["calibrations"]) + 1
    assert counted == len(raw.keys("*"))
    code, report = _verify_json(redis_server, capsys, "--fingerprint", "0" * 32)
    assert code == 0 and report["good"] == 0 and report["foreign"] == entries


def test_redis_verify_shows_the_shadow_checks_figures_kept_with_the_shared_curve(redis_server, raw, make_tiny_engine,
                                                                                 capsys):
    """The curve a shadow check refits is shared through Redis with its figures: verify URL shows them as `store
    stats` does for a folder (stats takes no URL), and an engine on the same Redis reads them back."""
    engine = make_tiny_engine(EngineConfig(store=StoreConfig(redis_url=redis_server)))
    _synthetic_calibration(engine)  # a corpus calibration: no checks yet
    key = f"kvboost:{engine.fingerprint[:16]}:calibration:fidelity"
    code, report = _verify_json(redis_server, capsys)
    assert code == 0 and report["observed_fidelity"] == {key: None}
    assert _cli("store", "verify", redis_server) == 0
    assert f"observed fidelity ({key}): no shadow checks yet" in capsys.readouterr().out
    engine.set_predictor(dataclasses.replace(engine.predictor, observed=SEEN))  # as a shadow check's refit saves it
    engine.close()
    code, report = _verify_json(redis_server, capsys)
    assert code == 0 and report["observed_fidelity"] == {key: SEEN.figures()}
    assert _cli("store", "verify", redis_server) == 0
    assert f"observed fidelity ({key}): 3 shadow checks" in capsys.readouterr().out
    assert make_tiny_engine(EngineConfig(store=StoreConfig(redis_url=redis_server))).predictor.observed == SEEN


def _redis_store(redis_server, make_tiny_engine):
    engine = make_tiny_engine(EngineConfig(store=StoreConfig(redis_url=redis_server)))
    engine.ingest(corpus()[:3])
    _synthetic_calibration(engine)
    engine.close()
    return engine, f"kvboost:{engine.fingerprint[:16]}"


def _first(raw, pattern: str) -> bytes:
    return sorted(raw.keys(pattern))[0]


def _damage_entry(raw, namespace):
    key = _first(raw, f"{namespace}:p:*")
    raw.set(key, raw.get(key)[:-9])
    return key.decode()


def _damage_pointer(raw, namespace):
    key = _first(raw, f"{namespace}:c:*")
    raw.set(key, b"\xffnot hex")
    return key.decode()


def _misdirect_pointer(raw, namespace):
    first, second = sorted(raw.keys(f"{namespace}:c:*"))[:2]
    raw.set(first, raw.get(second))  # an entry of other tokens
    return first.decode()


def _damage_record(raw, namespace):
    key = f"{namespace}:documents"
    doc_id = next(f for f in sorted(raw.hkeys(key)) if len(f) == 32)
    raw.hset(key, doc_id, raw.hget(key, doc_id).replace(b'"token_ids": [', b'"token_ids": [7, '))
    return f"{key} {doc_id.decode()}"


def _foreign_record(raw, namespace):
    """A record whose checksum holds, filed under this model's namespace but of another model's tokens."""
    key = f"{namespace}:documents"
    doc_id = next(f for f in sorted(raw.hkeys(key)) if len(f) == 32)
    doc = decode_record(raw.hget(key, doc_id))
    forged = dataclasses.replace(doc, doc_id="e" * 32)
    raw.hset(key, forged.doc_id, encode_record(forged))
    return f"{key} {forged.doc_id}"


def _damage_calibration(name):
    def damage(raw, namespace):
        key = f"{namespace}:calibration:{name}"
        raw.set(key, _not_finite(raw.get(key)))
        return key

    return damage


def _wrong_type(raw, namespace):
    key = f"{namespace}:calibration:fidelity"
    raw.delete(key)
    raw.hset(key, "a", "b")
    return key


def _unknown(raw, namespace):
    raw.set(f"{namespace}:z:1", b"?")
    return f"{namespace}:z:1"


REDIS_DAMAGES = {"entry": _damage_entry, "pointer": _damage_pointer, "misdirected-pointer": _misdirect_pointer,
                 "record": _damage_record, "foreign-record": _foreign_record,
                 "drift": _damage_calibration("drift"), "fidelity": _damage_calibration("fidelity"),
                 "wrong-type": _wrong_type}


@pytest.mark.parametrize("damage", REDIS_DAMAGES)
def test_each_damaged_kind_in_redis_fails_verify(redis_server, raw, make_tiny_engine, damage, capsys):
    engine, namespace = _redis_store(redis_server, make_tiny_engine)
    assert _verify_json(redis_server, capsys)[0] == 0
    key = REDIS_DAMAGES[damage](raw, namespace)
    code, report = _verify_json(redis_server, capsys)
    assert code == 1 and list(report["bad"]) == [key], report["bad"]
    assert _cli("store", "verify", redis_server) == 1
    assert f"BAD {key}" in capsys.readouterr().out


def test_unknown_keys_under_kvboost_fail_verify_and_other_programs_keys_do_not(redis_server, raw, make_tiny_engine,
                                                                              capsys):
    _, namespace = _redis_store(redis_server, make_tiny_engine)
    raw.set("session:42", b"another program's")
    code, report = _verify_json(redis_server, capsys)
    assert code == 0 and report["other_keys"] == 1
    key = _unknown(raw, namespace)
    code, report = _verify_json(redis_server, capsys)
    assert code == 1 and report["unknown"] == [key] and report["bad"] == {}


def test_a_stale_pointer_is_not_damage(redis_server, raw, make_tiny_engine, capsys):
    _, namespace = _redis_store(redis_server, make_tiny_engine)
    raw.delete(_first(raw, f"{namespace}:p:*"))  # evicted: its pointer leads nowhere, and the tier drops it on read
    code, report = _verify_json(redis_server, capsys)
    assert code == 0 and report["stale_pointers"] == 1


def test_stats_and_prune_refuse_a_redis_url_and_verify_an_unreachable_one_exits_2(capsys):
    for command in ("stats", "prune"):
        assert _cli("store", command, "redis://127.0.0.1:1/0") == 2
        assert "store verify URL" in capsys.readouterr().err
    assert _cli("store", "verify", "redis://127.0.0.1:1/0?socket_connect_timeout=0.5") == 2
    assert "cannot read the Redis store" in capsys.readouterr().err
