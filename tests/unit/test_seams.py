"""Documents are reused on the tokenizers people's models use, seams and all (issue 39).

Byte-level BPE (Llama 3.x, SmolLM3, Qwen2.5/3) fuses a document's closing '.', '!', '?' or ':' with the blank
line after it ('.ĊĊ') and its first word with a character before it ('>The', 'ĠThe'); Gemma 3 fuses '.' with a
closing tag ('.</'); SentencePiece (Llama 2, and so Mistral and Phi-3, whose tokenizers are built the same way)
gives a document tokenized alone a leading '▁'. Each family's real tokenizer (fetched at set-up by
scripts/fetch_tokenizers, never vendored) is paired with a tiny random Llama of its vocabulary size. On six
prompt layouts (the bench's, LangChain's usual RAG prompt in two forms, LlamaIndex's default text_qa_template in
its chat and completion forms, documents in tags): >= 95% of the documents' tokens are reused, every strategy
sees the tokenizer's own tokens, and the truths hold on prompts with fused seams.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT_TMPL
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from kvboost_rag import EngineConfig, KVBoost, RepairConfig
from kvboost_rag.assembly import APPROX, EXACT, assemble
from kvboost_rag.models import LoadedModel
from kvboost_rag.prompts import LAYOUTS
from kvboost_rag.tokens import bos_ids

CACHE = Path(os.environ.get("KVBOOST_CACHE", Path.home() / ".cache" / "kvboost-rag")) / "tokenizers"
# A Mistral-style template for the Llama 2 tokenizer, which ships none: [INST] ... [/INST] as plain text.
INST_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
                 "{% elif m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %}{{ m['content'] }}"
                 "{{ eos_token }}{% endif %}{% endfor %}")
FAMILIES = ["llama3_1", "qwen3", "gemma3", "llama2", "smollm2"]
GAP = 1e-3  # max |logit| difference from the model's own forward, fp32

# Documents ending in '.', '!', '?', ':', a quote and a tag; written for this test.
DOCS = [
    "The Heddon Cross glassworks opened in 1868 beside the canal at Marrow Lane. Its furnaces burned coal brought "
    "by barge from the pits at Elsworth, and at its height it employed three hundred and forty people, most of "
    "them boys who carried the hot glass from the blowers to the annealing ovens. The works closed in 1931, and "
    "the last of its green bottles can still be seen in the museum's entrance hall.",
    "Nobody expected the 1954 regatta at Lake Orsund to be decided by a rowing crew from a village school, but "
    "the eight boys from Tavik beat the university boat by half a length. Their coach, a retired ferryman named "
    "Aksel Brun, had trained them on the fjord every morning before lessons for two winters. The newspapers "
    "called it the race of the century, and the village still rings its church bell on the anniversary!",
    "Why does the bridge at Caldmoor have eleven arches when the river is narrow enough for three? The builders "
    "of 1790 expected floods like the one of 1771, which had spread the water across the whole valley floor, so "
    "they carried the roadway on arches all the way from the mill to the chapel. The floods never came again, "
    "and the meadows under the eight dry arches are now grazed by sheep. Was the expense worth it?",
    "The recipe for Pellow Farm's damson cheese, as written in the 1902 household book, is as follows. Stone "
    "four pounds of damsons and simmer them with a cup of water until soft. Rub the pulp through a sieve, weigh "
    "it, and add three quarters of its weight in sugar. Boil, stirring all the time, until a spoon drawn across "
    "the pan leaves a clear line. The book ends the page with a warning that has nothing to do with jam:",
    "When the lighthouse keeper at Skarva Point retired in 1977 after thirty-one years, the harbour board asked "
    "him what he would miss most. He said he would miss the sound of the fog signal on winter nights, and the "
    "company of the gulls that nested on the gallery rail. The board printed his reply in its annual report "
    "under the heading \"A Quiet Service\", and closed it with his own words: \"The sea was never lonely.\"",
    "The Ostrava Quartet recorded all of Janacek's chamber music in a single week of 1963, in a disused "
    "brewery hall chosen for its long echo. The cellist, Marie Vondrova, later wrote that the cold made the "
    "strings go flat every twenty minutes and that the engineers kept a stove burning beside the microphones. "
    "The sleeve notes list the works in the order they were played, ending with <b>the second quartet</b>",
]
QUESTION = "In which year did the glassworks close?"


def _bench(docs: list[str]) -> list[dict]:
    return LAYOUTS["bench"](docs, QUESTION)


def _tags(docs: list[str]) -> list[dict]:
    return LAYOUTS["tags"](docs, QUESTION)


def _langchain_hub(docs: list[str], question: str) -> list[dict]:
    """The hub's rlm/rag-prompt form: the context after 'Context: ', on the same line (a leading seam)."""
    context = "\n\n".join(docs)
    return [{"role": "user", "content": "You are an assistant for question-answering tasks. Use the following "
                                        "pieces of retrieved context to answer the question.\n"
                                        f"Question: {question} \nContext: {context} \nAnswer:"}]


def _llamaindex_completion(docs: list[str], question: str) -> list[dict]:
    """LlamaIndex's default (completion) text_qa_template, its nodes joined by blank lines."""
    return [{"role": "user", "content": DEFAULT_TEXT_QA_PROMPT_TMPL.format(context_str="\n\n".join(docs),
                                                                            query_str=question)}]


CHECKED = {**LAYOUTS, "langchain_hub": _langchain_hub, "llamaindex_completion": _llamaindex_completion}


@pytest.fixture(scope="module", params=FAMILIES)
def family_tokenizer(request, bundled_tokenizer):
    family = request.param
    if family == "smollm2":
        return family, bundled_tokenizer
    folder = CACHE / family
    if not (folder / "tokenizer.json").exists():
        pytest.skip(f"{family}'s tokenizer is not in {CACHE}: run `bash scripts/fetch_tokenizers`")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not tokenizer.chat_template:
        tokenizer.chat_template = INST_TEMPLATE
    return family, tokenizer


@pytest.fixture(scope="module")
def family_model(family_tokenizer):
    family, tokenizer = family_tokenizer
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval()


def _engine(family_tokenizer, family_model) -> KVBoost:
    family, tokenizer = family_tokenizer
    loaded = LoadedModel(family_model, tokenizer, f"tiny-random-{family}", "seed0")
    engine = KVBoost(loaded, EngineConfig(calibrate=False, repair=RepairConfig(fidelity="fast")))
    engine.ingest(DOCS, progress=False)
    return engine


def _truth_ids(tokenizer, rendered: str) -> list[int]:
    """The tokenizer's own tokens of the rendered prompt, with BOS once (a template that writes it is not given
    a second one, as `tokenizer(rendered)` would)."""
    ids, bos = tokenizer(rendered, add_special_tokens=False)["input_ids"], list(bos_ids(tokenizer))
    return ids if ids[:len(bos)] == bos else bos + ids


def _gap(engine: KVBoost, logits: torch.Tensor, token_ids: torch.Tensor) -> float:
    return (logits - engine.adapter.reference_logits(token_ids)[-1]).abs().max().item()


def test_documents_are_reused_whole_but_their_seams_on_every_layout(family_tokenizer, family_model):
    engine = _engine(family_tokenizer, family_model)
    family, tokenizer = family_tokenizer
    order = DOCS[3:] + DOCS[:3]
    fused = 0
    for name, layout in CHECKED.items():
        rendered = engine.render(layout(order, QUESTION))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            p = engine.plan(rendered, "naive")
        assert not any("could not be reused" in str(w.message) for w in caught)  # one seam token an edge is no loss
        assert p.token_ids.tolist() == _truth_ids(tokenizer, rendered), (family, name)  # what full sees
        assert p.document_tokens == sum(len(engine.document(d).token_ids) for d in DOCS), (family, name)
        share = p.document_tokens_reused / p.document_tokens
        assert share >= 0.95, (family, name, share)
        fused += p.document_tokens - p.document_tokens_reused
        for chunk in p.chunks:  # every reused piece is placed over its very tokens
            if chunk.source == APPROX:
                assert chunk.entry.token_ids == chunk.token_ids
    if family in ("llama3_1", "qwen3", "gemma3", "llama2"):
        assert fused > 0, family  # the layouts do fuse this tokenizer's seams: the test sees them


def test_the_truths_hold_on_fused_seams(family_tokenizer, family_model):
    """Exact hit = full; cacheblend recomputing everything = full; a seam-cut piece re-rotated to its place has
    the model's own layer-0 K/V there (layer 0 does not depend on context)."""
    engine = _engine(family_tokenizer, family_model)
    family, _ = family_tokenizer
    prompt = _tags(DOCS)
    blend = engine.prefill(prompt, "cacheblend", write_back=False, repair=RepairConfig(recompute_ratio=1.0,
                                                                                      fidelity="fast"))
    p = blend.plan
    assert p.count(APPROX) >= 0.9 * p.document_tokens
    assert blend.recomputed_tokens == blend.prompt_tokens - p.count(EXACT)  # exact hits are exact as they are
    assert _gap(engine, blend.logits, p.token_ids) < GAP
    naive = engine.prefill(prompt, "naive", write_back=False)
    assert _gap(engine, naive.logits, p.token_ids) > GAP  # the comparison can see reuse
    reused = p.positions(APPROX)
    with torch.inference_mode():
        cache = assemble(p, engine.adapter, p.num_tokens)
        keys, values = engine.adapter.reference_kv(p.token_ids)
    torch.testing.assert_close(cache.keys[0][:, :, reused], keys[0][None, :, reused], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.values[0][:, :, reused], values[0][None, :, reused], atol=1e-5, rtol=1e-5)
    if family != "smollm2":  # pieces cut at a seam, served as slices of stored chunks, are among those checked
        assert any(c.source == APPROX and engine.store.find_content(c.content_key) is None for c in p.chunks)
    prompt = _tags(DOCS[::-1])  # written back by a first prefill, then exact hits
    first = engine.prefill(prompt, "prefix")  # computed, written back
    again = engine.prefill(prompt, "prefix", write_back=False)
    assert first.exact_tokens < 0.1 * first.prompt_tokens and again.exact_tokens >= 0.9 * again.prompt_tokens
    assert _gap(engine, again.logits, again.plan.token_ids) < GAP


def test_a_document_found_but_not_reused_is_reported_once(family_tokenizer, family_model):
    """Found by its text, its tokens nowhere in the prompt's (here: an index record forged with another
    document's tokens): nothing of it is served, the request's figures count it, and one warning names it."""
    engine = _engine(family_tokenizer, family_model)
    real, other = engine.documents.get(DOCS[0]), engine.documents.get(DOCS[1])
    forged = type(real)(real.doc_id, real.text, other.token_ids, other.chunks)
    engine.documents._by_text[real.text] = forged
    engine.documents._by_anchor[real.text[:32]] = [forged]
    prompt = _bench(DOCS[:3])
    with pytest.warns(UserWarning, match=f"document {real.doc_id[:12]} .* could not be reused") as caught:
        out = engine.generate(prompt, strategy="naive", max_new_tokens=1)
    assert sum("could not be reused" in str(w.message) for w in caught) == 1
    reused_docs = sum(len(engine.document(d).token_ids) for d in DOCS[1:3])
    assert out.document_tokens == reused_docs + len(other.token_ids)
    assert reused_docs - 2 <= out.document_tokens_reused <= reused_docs
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        engine.generate(prompt, strategy="naive", max_new_tokens=1)
    assert not any("could not be reused" in str(w.message) for w in again)  # once per document
