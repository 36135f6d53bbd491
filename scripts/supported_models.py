"""Print the README's supported-models tables (markdown) from the architecture matrix's own data.

    .venv/bin/python scripts/supported_models.py            # runs the matrix (~1 min on 2 cores), then prints
    .venv/bin/python scripts/supported_models.py --no-run   # the tables alone, truths marked "tested"

The families and the refused cases are the parametrization of tests/unit/test_architectures.py (FAMILIES,
REFUSED): each row is a case that module runs, and a truth is marked passed only when this run saw it pass.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
from pathlib import Path

MATRIX = Path(__file__).resolve().parent.parent / "tests" / "unit" / "test_architectures.py"


def load_matrix():
    spec = importlib.util.spec_from_file_location("architecture_matrix", MATRIX)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def truths(matrix) -> dict[str, str]:
    """The table's truth columns -> the test function checking each."""
    return {"(a) re-rotation": matrix.test_rerotated_keys_are_the_models_own_at_the_new_position.__name__,
            "(b) exact prefix hit": matrix.test_exact_prefix_hit_and_decode_give_a_full_prefills_logits.__name__,
            "(c) CacheBlend r=1": matrix.test_cacheblend_recomputing_everything_is_a_full_prefill.__name__}


def run_matrix() -> dict[tuple[str, str], str]:
    """Run the test module: (test function, parametrization id) -> its outcome (passed, failed, skipped)."""
    import pytest

    class Outcomes:
        def __init__(self):
            self.seen: dict[tuple[str, str], str] = {}

        def pytest_runtest_logreport(self, report):
            name, _, case = report.nodeid.split("::")[-1].partition("[")
            key = (name, case.rstrip("]"))
            if report.failed:  # in set-up, the test or tear-down
                self.seen[key] = "failed"
            elif report.when == "call" or report.skipped:
                self.seen.setdefault(key, report.outcome)

    outcomes = Outcomes()
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the tables alone, to paste
        pytest.main([str(MATRIX), "-q", "-p", "no:cacheprovider"], plugins=[outcomes])
    return outcomes.seen


def table(matrix, outcomes: dict[tuple[str, str], str] | None) -> str:
    columns = truths(matrix)
    mark = {"passed": "passes", None: "tested"}

    def cell(test: str, case: str) -> str:
        return mark.get(None if outcomes is None else outcomes.get((test, case)), "**FAILS**")

    lines = ["| Family | `model_type` | What the adapter handles | " + " | ".join(columns) + " |",
             "|---|---|---|" + "---|" * len(columns)]
    lines += [f"| {f.name} | `{f.model_type}` | {f.handles} | "
              + " | ".join(cell(test, str(f)) for test in columns.values()) + " |" for f in matrix.FAMILIES]
    lines += ["", f"Each row is a tiny random-weight model built from its transformers config class (fp32, "
              f"{matrix.TINY['num_hidden_layers']} layers, sliding windows of {matrix.WINDOW} tokens in prompts of "
              f"~250), checked on every layer by `tests/unit/test_architectures.py`: (a) keys computed at one "
              f"position and rotated equal the model's own at the new one, (b) an exact prefix hit and a decode step "
              f"after it, and (c) CacheBlend with `recompute_ratio=1`, give the model's own logits within "
              f"{matrix.GAP:g}.", "",
              "| Refused | When | What to do | Refusal (and exact reuse) |", "|---|---|---|---|"]
    when = {"load": "at load", "reuse": "at the first reuse of moved keys (exact prefix hits still served)"}
    refusal_tests = {"load": matrix.test_what_cannot_be_driven_is_refused_at_load.__name__,
                     "reuse": matrix.test_rope_that_does_not_compose_refuses_moving_keys_and_keeps_exact_reuse.__name__}
    lines += [f"| {r.case} | {when[r.when]} | {r.remedy} | {cell(refusal_tests[r.when], str(r))} |"
              for r in matrix.REFUSED]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-run", action="store_true", help="print the tables without running the matrix")
    args = parser.parse_args()
    outcomes = None if args.no_run else run_matrix()
    print(table(load_matrix(), outcomes))


if __name__ == "__main__":
    main()
