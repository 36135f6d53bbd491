"""Decode throughput of concurrent streams: batched decode steps (batching.py) against the same streams stepped one
at a time, on the bundled model.

Each run prefills --streams prompts (strategy `full`, not timed), then decodes --tokens tokens from each, greedy,
EOS ignored (so every stream makes all its tokens; --stop-at-eos keeps it), and times the decoding: generated
tokens / wall seconds. `batched`: one thread per stream, their steps gathered by the engine's batcher into one
forward per round. `serial`: one thread stepping the streams in turn, the batcher's window off (each step a
batch of one, today's single worker). The modes alternate, order swapped each repeat, after one warm-up of each;
the table has medians, the mean rows per batch, and whether both modes produced the same tokens.

    .venv/bin/python research/batched_decoding.py --streams 8 --tokens 64 --repeats 5 --dtype bfloat16
    .venv/bin/python research/batched_decoding.py --streams 2 --tokens 4 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from kvboost_rag import EngineConfig, KVBoost
from kvboost_rag.batching import WINDOW_S
from kvboost_rag.generation import SamplingParams

THINGS = ("a river", "a lighthouse keeper", "a travelling fox", "an old clock", "a ship's cat", "a mountain town",
          "a forgotten library", "a glass-blower", "a comet", "a market at dawn", "a bridge", "a winter garden")


def prompts(n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write a long, detailed story about {THINGS[i % len(THINGS)]}, "
                                         f"chapter {i // len(THINGS) + 1}."}] for i in range(n)]


def run(engine: KVBoost, mode: str, n: int, tokens: int) -> tuple[float, int, float, list[tuple[int, ...]]]:
    """(seconds, generated tokens, mean rows per batch, each stream's tokens) of one run in `mode`."""
    pres = [engine.prefill(p, "full", max_new_tokens=tokens, write_back=False) for p in prompts(n)]
    streams = [engine.stream_from(pre, SamplingParams(tokens)) for pre in pres]
    results: list = [None] * n
    engine.batcher.window_s = 0.0 if mode == "serial" else WINDOW_S
    before = dict(engine.batcher.counters)
    started = time.perf_counter()
    if mode == "serial":
        live = dict(enumerate(streams))
        while live:
            for i, stream in list(live.items()):
                piece = next(stream)
                if piece.result is not None:
                    results[i] = piece.result
                    del live[i]
    else:
        def consume(i: int) -> None:
            results[i] = list(streams[i])[-1].result

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    seconds = time.perf_counter() - started
    batches = engine.batcher.counters["batches"] - before.get("batches", 0)
    rows = engine.batcher.counters["rows"] - before.get("rows", 0)
    return seconds, sum(r.generated_tokens for r in results), rows / max(batches, 1), [r.token_ids for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="tokens decoded per stream")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--stop-at-eos", action="store_true", help="end a stream at EOS (tokens then vary)")
    args = parser.parse_args()
    engine = KVBoost.from_pretrained(config=EngineConfig(dtype=args.dtype, device=args.device, calibrate=False))
    if not args.stop_at_eos:
        engine._eos_ids = frozenset()  # every stream decodes all its tokens: the same work in both modes
    modes = ("batched", "serial")
    for mode in modes:  # warm-up
        run(engine, mode, args.streams, min(args.tokens, 8))
    figures: dict[str, list] = {mode: [] for mode in modes}
    same = True
    for r in range(args.repeats):
        outputs = {}
        for mode in modes if r % 2 == 0 else modes[::-1]:
            seconds, generated, rows, outputs[mode] = run(engine, mode, args.streams, args.tokens)
            figures[mode].append((generated / seconds, seconds, generated, rows))
        same &= outputs["batched"] == outputs["serial"]
    print(f"{args.streams} streams x {args.tokens} tokens, {args.dtype} on {engine.adapter.device}, "
          f"{args.repeats} repeats (medians)")
    print("| mode | tokens/s | seconds | tokens | rows/batch |\n|---|---|---|---|---|")
    medians = {}
    for mode in modes:
        rate, seconds, generated, rows = (statistics.median(column) for column in zip(*figures[mode], strict=True))
        medians[mode] = rate
        print(f"| {mode} | {rate:.1f} | {seconds:.3f} | {generated:.0f} | {rows:.2f} |")
    print(f"batched / serial: {medians['batched'] / medians['serial']:.2f}x; same tokens in both modes: {same}")


if __name__ == "__main__":
    main()
