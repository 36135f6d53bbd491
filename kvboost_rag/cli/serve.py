"""`kvboost-rag serve [--documents PATH...]`: an OpenAI-compatible HTTP server over one engine.

    kvboost-rag serve --store kv/ --documents corpus.jsonl --port 8000
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")

With --api-key KEY (or the environment variable KVBOOST_API_KEY) every /v1/* route and /metrics require
`Authorization: Bearer KEY` (the openai client's api_key); /health stays open. --max-requests bounds the
requests running the model at once: one more gets 429 with Retry-After. --max-prompt-bytes and --max-body-bytes
bound a request's text and body (413 over them, before any tokenizing); their defaults follow the model's context
window (kvboost_rag/server_requests.py).

Needs the `serve` extra (FastAPI, uvicorn, prometheus-client): pip install 'kvboost-rag[serve]'. See
kvboost_rag/server.py for the routes and kvboost_rag/server_gate.py for the key, the bound and the metrics.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

from .common import add_engine_options, engine_config, make_engine, read_documents

# The packages the server needs beyond the base install, by the top-level name an ImportError gives.
_SERVE_PACKAGES = {"fastapi", "uvicorn", "starlette", "pydantic", "prometheus_client"}
# The same as server_gate.DEFAULT_MAX_REQUESTS, which cannot be imported before the serve extra is checked.
_DEFAULT_MAX_REQUESTS = 64
_API_KEY_ENV = "KVBOOST_API_KEY"
_INSTALL_HINT = "pip install 'kvboost-rag[serve]'"


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve chat and text completions over an OpenAI-compatible HTTP API")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: the model's id)")
    p.add_argument("--documents", nargs="+", type=Path, default=[], metavar="PATH",
                   help="documents to ingest before serving: a .jsonl file (one JSON string, {\"text\": ...} or "
                        "{\"documents\": [...]} a line), or text files and folders of them (one document a file)")
    p.add_argument("--pin", action="store_true", help="never evict the --documents from memory")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every /v1/* route and /metrics (401 otherwise; "
                        f"/health stays open); default: the environment variable {_API_KEY_ENV}, else no key")
    p.add_argument("--max-requests", type=_positive, default=_DEFAULT_MAX_REQUESTS, metavar="N",
                   help="requests running the model at once (prefill or decoding, streamed or not); one more gets "
                        "429 with Retry-After (default: %(default)s)")
    p.add_argument("--max-prompt-bytes", type=_positive, default=None, metavar="BYTES",
                   help="UTF-8 bytes of text a request (or one document) may hold; more gets 413 before any tokenizing "
                        "(default: 8 per token of the model's context window)")
    p.add_argument("--max-body-bytes", type=_positive, default=None, metavar="BYTES",
                   help="bytes a request's body may hold; more gets 413 before it is read (default: 6 per byte of "
                        "--max-prompt-bytes, plus 64 KiB)")
    add_engine_options(p)
    # The engine options call the disk tier's folder --store, as every subcommand does; --disk-dir is its alias.
    p.add_argument("--disk-dir", dest="store", type=Path, default=None, help="the same as --store")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    # Every setting, the documents and the server's packages checked before the model is loaded.
    config = engine_config(args)
    docs = read_corpus(args.documents)
    api_key = _api_key(args.api_key)
    try:
        import uvicorn

        from ..server import create_app
    except ImportError as e:
        if (e.name or "").split(".")[0] not in _SERVE_PACKAGES:
            raise
        print(f"kvboost-rag serve: error: {e.name} is not installed; the server needs the serve extra: "
              f"{_INSTALL_HINT}", file=sys.stderr)
        return 2
    engine = make_engine(args, config)
    try:
        if docs:
            ids = engine.ingest(docs, pin=args.pin, progress=True)
            c = engine.counters
            print(f"documents {len(ids)} (computed {c['documents_computed']}, already stored "
                  f"{c['documents_stored']})")
        app = create_app(engine, model_name=args.model_name, api_key=api_key, max_requests=args.max_requests,
                         max_prompt_bytes=args.max_prompt_bytes, max_body_bytes=args.max_body_bytes)
        _freeze_what_is_loaded()
        uvicorn.run(app, host=args.host, port=args.port)
    finally:
        engine.close()  # writes the disk tier's index
    return 0


def _freeze_what_is_loaded() -> None:
    """Keep the objects loaded so far (the model, tokenizer, documents, libraries: ~470k of them for the bundled
    model) out of the garbage collector's full collections, which otherwise scan them all: ~230 ms with the GIL held,
    a stall of every request in flight, that traffic (any traffic, malformed requests too) sets off every so often
    (issue 40's soak). What is garbage already is collected first; what is frozen is still freed when no longer
    referenced."""
    gc.collect()
    gc.freeze()


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in [0, 65535], got {text!r}")
    return port


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _api_key(given: str | None) -> str | None:
    """--api-key, else the environment's key (set but empty: no key); an empty --api-key is refused."""
    if given is not None:
        if not given.strip():
            raise ValueError("--api-key is empty: give a key, or leave the option out for none")
        return given.strip()
    return os.environ.get(_API_KEY_ENV, "").strip() or None


def read_corpus(paths: list[Path]) -> list[str]:
    """The documents of `paths`, each once, in order: JSONL files line by line, anything else as the ingest
    command reads it (one document per text file)."""
    texts: list[str] = []
    for path in paths:
        if path.suffix.lower() == ".jsonl" and path.is_file():
            texts.extend(_read_jsonl(path))
        else:
            texts.extend(text for _, text in read_documents([path]))
    return list(dict.fromkeys(text.strip() for text in texts))


def _read_jsonl(path: Path) -> list[str]:
    """One document a line as a JSON string or {"text": ...}, or several as {"documents": [...]} (the bench
    items' format, so a benchmark file serves its documents)."""
    texts: list[str] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg})") from None
            found = _record_texts(record)
            if found is None or not all(isinstance(t, str) and t.strip() for t in found):
                raise ValueError(f'{where}: expected a non-empty string, {{"text": str}} or '
                                 f'{{"documents": [str, ...]}}')
            texts.extend(found)
    if not texts:
        raise ValueError(f"{path} holds no documents")
    return texts


def _record_texts(record) -> list | None:
    if isinstance(record, str):
        return [record]
    if isinstance(record, dict) and "text" in record:
        return [record["text"]]
    if isinstance(record, dict) and isinstance(record.get("documents"), list):
        return record["documents"]
    return None
