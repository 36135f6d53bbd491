"""Research (issue 41, tried, not shipped): documents encoded after a context longer than Gemma 3's sliding window.

In a prompt of ~1k tokens, 43% of package_pages' documents start past position 512, where Gemma's sliding layers
(15 of 18) no longer see the text's start; stored after the ingestion context's ~90 tokens, their tokens saw it. Here
the context's neutral passage (assembly.CONTEXT_PASSAGE) is replaced by eight neutral paragraphs (553 Gemma tokens),
so a stored document's sliding layers see what a later document's see. Runs `kvboost-rag` with that context when
given --long, as shipped otherwise:

    python research/long_context.py bench [--long] --model gemma-3-270m --data research/data/package_pages.jsonl \
        --limit 16 --dtype float32 --max-new-tokens 16 --strategies "full;naive;cacheblend:fidelity=fast" \
        --order-floor off --noise-floor none
Figures in docs/method.md, "Where Gemma's error lives".
"""
import sys

import kvboost_rag.assembly as assembly

FILLER = [
    "The notes below were gathered from several sources and arranged for easy reading. Each part describes one "
    "subject on its own, in plain language, and the parts may be read in any order. Some details were checked "
    "against older records, while others come from people who knew the subject well. Where sources disagreed, the "
    "more recent account was kept. Small changes to spelling and wording were made so that the parts read alike.",
    "A reader who wants the short version can look at the first lines of each part, which say what it is about. "
    "The longer explanations follow, with examples where they help. Nothing here is meant to be complete; the aim "
    "is to give enough to find one's way and to know where to look next. Terms are explained the first time they "
    "appear, and later parts use them without repeating the explanation.",
    "Most parts were written at different times and by different hands, so their tone varies a little. Some are "
    "brief and practical, listing steps or settings; others give background and reasons. When a part refers to "
    "another, it does so by its subject rather than by its place, because the order of the parts may change from "
    "one collection to the next.",
    "Care was taken to keep each statement as it was found in its source. Where a value or a setting is given, it "
    "is the one that the source gave at the time, and it may have changed since. Readers are encouraged to check "
    "such details against the current material before relying on them, especially for anything that is updated "
    "often.",
    "The collection grew over many seasons. New parts were added when questions came up that the older parts did "
    "not answer, and some older parts were shortened when they repeated what others already said. A few parts were "
    "split in two because they covered more than one subject, and a few small ones were joined together.",
    "Questions about the material are usually best answered by reading the part that covers the subject in full, "
    "rather than a summary of it. The wording of the original is often more exact than any paraphrase, and small "
    "differences in wording can matter. For that reason the parts keep their own words wherever possible.",
    "Some parts include lists, tables or short examples, and these are kept as they were, with only their layout "
    "made consistent. Where a part quotes another text, the quotation is marked as such, and where it sums one up, "
    "it says so. Nothing was left out on purpose, though some things may have been missed along the way.",
    "Finally, the parts are not ranked by importance. A short part can hold the one detail that matters, and a "
    "long one can be mostly background. Each should be read on its own terms, with attention to what it actually "
    "says rather than to what one expects it to say.",
]
if "--long" in sys.argv:
    sys.argv.remove("--long")
    assembly.CONTEXT_PASSAGE = "\n\n".join(FILLER)
from kvboost_rag.cli import main  # noqa: E402

sys.exit(main())
