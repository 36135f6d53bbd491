"""What the engine needs to know of a tokenizer and its text: which ids frame a text (BOS, EOS), a digest of
everything that decides token ids (part of the model fingerprint), and text a tokenizer can take."""

from __future__ import annotations

import xxhash


def tokenizer_digest(tokenizer) -> str:
    """A hash of everything that decides token ids: the whole tokenizer (vocabulary, merges, normalizer,
    pre-tokenizer, added tokens) where it can be serialized, else its vocabulary and added tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        described = backend.to_str()
    else:
        described = repr((sorted(tokenizer.get_vocab().items()), sorted(tokenizer.added_tokens_decoder)))
    return xxhash.xxh3_128_hexdigest(f"{type(tokenizer).__name__}:{described}".encode())


def check_text(text: object, what: str) -> str:
    """`text` when it is a str a tokenizer can take; else a ValueError that says what to pass instead."""
    if isinstance(text, (bytes, bytearray)):
        raise ValueError(f"{what} is bytes, not text: decode it first, e.g. data.decode('utf-8')")
    if not isinstance(text, str):
        raise ValueError(f"{what} is {type(text).__name__}, not text: pass a str (a document's or prompt's text)")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} holds a lone surrogate ({text[e.start]!r} at character {e.start}), which is not "
                         "valid Unicode: repair the text, e.g. text.encode('utf-8', 'replace').decode()") from None
    return text


def bos_ids(tokenizer) -> tuple[int, ...]:
    """Special tokens the tokenizer puts before any text (Llama's <s>); none for SmolLM2 or Qwen."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    special = tokenizer("a", add_special_tokens=True)["input_ids"]
    return tuple(special[: len(special) - len(plain)]) if special[-len(plain):] == plain else ()


def eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return ids
