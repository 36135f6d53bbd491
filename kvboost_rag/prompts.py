"""RAG prompt layouts: where the retrieved documents go, in the retriever's order, around the question.

`bench` is what the CLI, the bench and the examples lay out: one user message with the documents, separated by
blank lines, then the question, after an optional system text. The others are how the frameworks our users run
lay them out, so that the bench (`--layout`) and the tests of seams (tests/unit/test_seams.py) see those prompts
too: a tokenizer fuses a document's edge with the text around it differently in each (see matching.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

DEFAULT_SYSTEM = "Answer the question using only the documents."

Layout = Callable[[Sequence[str], str, "str | None"], list[dict]]


def rag_messages(documents: Sequence[str], question: str, system: str | None = DEFAULT_SYSTEM) -> list[dict]:
    """Chat messages: the system text, then one user message with the documents and the question."""
    user = "\n\n".join(documents) + f"\n\nQuestion: {question}"
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def langchain_messages(documents: Sequence[str], question: str, system: str | None = None) -> list[dict]:
    """A LangChain stuff chain's usual prompt: the context after 'Context:' in the system message, documents joined
    by blank lines (`format_docs`), the question as the user's message."""
    head = system or "You are an assistant for question-answering tasks. Use the following pieces of retrieved " \
                     "context to answer the question. If you don't know the answer, say that you don't know."
    return [{"role": "system", "content": f"{head}\n\nContext:\n" + "\n\n".join(documents)},
            {"role": "user", "content": question}]


def llamaindex_messages(documents: Sequence[str], question: str, system: str | None = None) -> list[dict]:
    """LlamaIndex's default chat text_qa_template (its system and user messages), nodes joined by blank lines.
    Read from llama-index-core itself, so it stays what a query engine sends."""
    try:
        from llama_index.core.prompts.chat_prompts import CHAT_TEXT_QA_PROMPT
    except ImportError:
        raise ValueError("the llamaindex layout needs llama-index-core: pip install -e integrations/llama-index") \
            from None
    messages = CHAT_TEXT_QA_PROMPT.format_messages(context_str="\n\n".join(documents), query_str=question)
    out = [{"role": m.role.value, "content": m.content} for m in messages]
    if system:
        out = [{"role": "system", "content": system}] + [m for m in out if m["role"] != "system"]
    return out


def tagged_messages(documents: Sequence[str], question: str, system: str | None = DEFAULT_SYSTEM) -> list[dict]:
    """Each document in <doc> tags (a tokenizer may fuse '>' with its first word and its last '.' with '</')."""
    return rag_messages([f"<doc>{d}</doc>" for d in documents], question, system)


LAYOUTS: dict[str, Layout] = {"bench": rag_messages, "langchain": langchain_messages,
                              "llamaindex": llamaindex_messages, "tags": tagged_messages}


def layout(name: str) -> Layout:
    """The layout called `name`; a ValueError listing them for any other."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"unknown prompt layout {name!r}: choose one of {', '.join(LAYOUTS)}") from None
