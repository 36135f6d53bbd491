"""Time to first token of the same LangChain RAG chain under strategies full, prefix and cacheblend, and on
langchain-huggingface's ChatHuggingFace (what the chain would otherwise run on).

    python cookbook/ttft_comparison.py [--questions 6] [--k 4] [--max-tokens 16]

Every question is asked under each strategy and on the peer, interleaved (the order rotates per question)
after a warm-up, with the retrieved documents in a shuffled order. The measured requests don't write their
KV back, so no request is helped by an earlier run of the same prompt: `prefix` can reuse only the
shared system prompt (cached by the warm-up), `cacheblend` also reuses the documents wherever they
land. The peer is `ChatHuggingFace` over a `HuggingFacePipeline` of the very transformers model and tokenizer
the engine loaded (the bundled SmolLM2, nothing from the hub), greedy, with the same `max_new_tokens`: a full
prefill through `model.generate`, no KV kept between requests.

TTFT is measured the same way for all four: from `chain.stream(question)` to its first chunk, retrieval and
prompt rendering included. Both yield their first chunk with the first generated token (ChatHuggingFace's
streamer yields one per token, empty while it holds back a symbol's text). Prints median TTFT, the speed-up
over `full`, and how often the greedy answer equals `full`'s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from importlib.metadata import version

from langchain_huggingface import ChatHuggingFace, HuggingFacePipeline
from langchain_kvboost import ChatKVBoost
from langchain_rag import build_retriever, load_corpus, rag_chain
from offline_embeddings import encoder
from transformers import pipeline

STRATEGIES = ("full", "prefix", "cacheblend")
PEER = "ChatHuggingFace"
RUNS = (*STRATEGIES, PEER)


def huggingface_chat(llm: ChatKVBoost, max_tokens: int) -> ChatHuggingFace:
    """langchain-huggingface's chat model on the engine's own model and tokenizer: greedy, `max_tokens` new."""
    engine = llm.client  # the model is the one in the engine's adapter: same weights, dtype and attention kernel
    pipe = pipeline("text-generation", model=engine.adapter.model, tokenizer=engine.tokenizer,
                    max_new_tokens=max_tokens, do_sample=False)
    # The tokenizer is passed so that ChatHuggingFace renders the chat with it instead of fetching one by id.
    return ChatHuggingFace(llm=HuggingFacePipeline(pipeline=pipe), tokenizer=engine.tokenizer)


def timed_stream(chain, question: str):
    """(ms from the call to the chain's first streamed chunk, the whole message)."""
    started = time.perf_counter()
    ttft_ms, message = None, None
    for chunk in chain.stream(question):
        if ttft_ms is None:
            ttft_ms = (time.perf_counter() - started) * 1e3
        message = chunk if message is None else message + chunk
    return ttft_ms, message


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=6, help="questions (benchmark items) to ask")
    parser.add_argument("--k", type=int, default=4, help="documents retrieved per question")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    started = time.perf_counter()
    llm = ChatKVBoost(max_tokens=args.max_tokens)
    items, docs = load_corpus(args.questions + 1)
    warmup, items = items[0], items[1:]
    print(f"model {llm.client.model_id}, embeddings {encoder().name}: {len(docs)} documents, "
          f"{len(items)} questions, k={args.k}")
    print(f"peer: langchain-huggingface {version('langchain-huggingface')} {PEER} on the same model, greedy, "
          f"max_new_tokens={args.max_tokens}")
    retriever = build_retriever(llm, docs, args.k)
    # The same chain, with the model bound to each strategy; measured requests don't write back.
    chains = {s: rag_chain(retriever, llm.bind(strategy=s, write_back=False)) for s in STRATEGIES}
    chains[PEER] = rag_chain(retriever, huggingface_chat(llm, args.max_tokens))

    # Warm-up: loads kernels, and caches the system prompt the way a long-running service would.
    for strategy in STRATEGIES:
        rag_chain(retriever, llm.bind(strategy=strategy)).invoke(warmup.question)
    timed_stream(chains[PEER], warmup.question)  # the peer's first generate() and its streaming thread

    ttft = {r: [] for r in RUNS}
    reused = {r: [] for r in RUNS}
    answers = {r: [] for r in RUNS}
    correct = {r: 0 for r in RUNS}
    for i, item in enumerate(items):
        for run in RUNS[i % len(RUNS):] + RUNS[:i % len(RUNS)]:
            # The engine checks a share of its answers against a full prefill in the background while it is idle
            # (shadow.py), as it is while the peer runs on the same cores: done first, so no run shares the cores.
            llm.client.shadow.drain()
            ms, msg = timed_stream(chains[run], item.question)
            ttft[run].append(ms)
            if run == PEER:  # it keeps no KV between requests: nothing of its prompt is reused
                reused[run].append(0.0)
            else:
                reused[run].append(msg.response_metadata["reused_tokens"] / msg.usage_metadata["input_tokens"])
            answers[run].append(msg.content.strip())
            correct[run] += any(a.lower() in msg.content.lower() for a in item.answers)

    base = statistics.median(ttft["full"])
    print(f"\n{'run':<17}{'median TTFT':>12}{'vs full':>9}{'reused':>9}{'same as full':>14}{'correct':>9}")
    for r in RUNS:
        med = statistics.median(ttft[r])
        same = sum(a == b for a, b in zip(answers[r], answers["full"], strict=True))
        print(f"{r:<17}{med:>10.0f}ms{base / med:>8.2f}x{statistics.mean(reused[r]):>9.0%}"
              f"{same:>9}/{len(items):<4}{correct[r]:>5}/{len(items)}")
    print(f"\ndone in {time.perf_counter() - started:.1f}s")


if __name__ == "__main__":
    main()
