"""The RAG prompt the CLI, the bench and the examples lay out: documents in the retriever's order, then the
question, in one user message after an optional system text. Documents separated by a blank line sit on
their own token boundaries, so each one's stored KV can be reused (see assembly.tokenize_prompt)."""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_SYSTEM = "Answer the question using only the documents."


def rag_messages(documents: Sequence[str], question: str, system: str | None = DEFAULT_SYSTEM) -> list[dict]:
    """Chat messages: the system text, then one user message with the documents and the question."""
    user = "\n\n".join(documents) + f"\n\nQuestion: {question}"
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
