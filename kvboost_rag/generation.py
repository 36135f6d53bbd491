"""Token choice and streaming text: sampling, stop strings, incremental detokenization."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import SEED_LIMIT, ConfigError, check_int, check_number


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen; checked when made, so a bad value is refused before any prefill."""

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        check_int(self, "max_new_tokens", 1)
        check_number(self, "temperature", 0.0, hint="0 = greedy")
        check_number(self, "top_p", 0.0, 1.0, above=True, hint="1 = no nucleus cut")
        check_int(self, "top_k", 0, hint="0 = no top-k cut")
        if isinstance(self.stop, str):
            raise ConfigError("stop", f"SamplingParams.stop must be a list of strings, got the string {self.stop!r}: "
                                      f"wrap it, stop=[{self.stop!r}]")
        try:
            stop = tuple(self.stop or ())
        except TypeError:
            stop = None
        if stop is None or not all(isinstance(s, str) and s for s in stop):
            raise ConfigError("stop", f"SamplingParams.stop must be a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)  # any sequence of strings, kept as a tuple
        if self.seed is not None:
            check_int(self, "seed", 0, SEED_LIMIT - 1, hint="or None for an unseeded sampler")


def choose_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [V] fp32 -> the next token id."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1])).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set whose mass reaches top_p (the token that crosses it included).
        drop = sorted_probs.cumsum(-1) - sorted_probs > params.top_p
        sorted_probs[drop] = 0
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


class TextStream:
    """Turns generated token ids into text deltas, holding back what could still become a stop string
    or is an incomplete UTF-8 sequence."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.token_ids: list[int] = []
        self.emitted = 0  # characters of the text already handed out
        self.text = ""
        self.stopped = False

    def add(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        for s in self.stop:
            at = self.text.find(s)
            if at != -1:
                self.text, self.stopped = self.text[:at], True
        if self.stopped:
            return self.flush()
        end = len(self.text) - (1 if self.text.endswith("\ufffd") else 0)
        safe = end
        for s in self.stop:  # the longest tail that is a proper prefix of a stop string waits
            for n in range(min(len(s) - 1, end), 0, -1):
                if self.text[end - n:end] == s[:n]:
                    safe = min(safe, end - n)
                    break
        delta, self.emitted = self.text[self.emitted:safe], max(self.emitted, safe)
        return delta

    def flush(self) -> str:
        delta, self.emitted = self.text[self.emitted:], len(self.text)
        return delta
