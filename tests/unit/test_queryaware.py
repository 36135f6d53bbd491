"""Pure parts of query-aware repair: moving the chosen documents last."""

from __future__ import annotations

from kvboost_rag.documents import Document
from kvboost_rag.repair.queryaware import move_last


def doc(name: str) -> Document:
    return Document(name, name, (1,), ())


A, B, C, D = doc("A"), doc("B"), doc("C"), doc("D")
SEGMENTS = ["system ", A, "\n\n", B, "\n\n", C, "\n\n", D, "\n\nQuestion: ?"]


def names(segments) -> list[str]:
    return [s if isinstance(s, str) else s.doc_id for s in segments]


def test_chosen_document_moves_after_the_others_with_its_separator():
    assert names(move_last(SEGMENTS, [1])) == ["system ", "A", "\n\n", "C", "\n\n", "D", "\n\n", "B",
                                               "\n\nQuestion: ?"]


def test_already_last_is_unchanged_and_text_is_kept():
    assert move_last(SEGMENTS, [3]) == SEGMENTS
    for chosen in ([0], [0, 2], [1, 3], [0, 1, 2]):
        out = move_last(SEGMENTS, chosen)
        assert sorted(names(out)) == sorted(names(SEGMENTS))
        assert names(out)[0] == "system " and names(out)[-1] == "\n\nQuestion: ?"


def test_several_chosen_keep_their_order_at_the_end():
    assert names(move_last(SEGMENTS, [0, 3]))[1:-1] == ["B", "\n\n", "C", "\n\n", "A", "\n\n", "D"]
