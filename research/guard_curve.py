"""The fidelity guard against a fixed recompute budget, and how well its estimate is calibrated.

Reads a `kvboost-rag bench --json` report whose strategies hold two families: cacheblend unguarded
(`fidelity=fast`) at several `recompute_ratio`s, and cacheblend guarded at several `fidelity` levels (the
default ratio). Writes:

- `guard.png`: speed-up over full (x) against agree@16 and against accuracy, one line per family, with the
  noise floor (full in the other dtype) dashed; and, for the unguarded requests, the estimate (predicted chance
  the 16-token answer differs from full's) against the measured share that differs, in bins of predicted
  chance, with the 2x band;
- `curve.md`: the table of both families and the calibration bins.

    .venv/bin/kvboost-rag bench --data research/data/multidoc_other.jsonl --limit 24 --dtype float32 \
      --max-new-tokens 16 --noise-floor none --json out/guard/curve.json --strategies "full,naive,\
    cacheblend:fidelity=fast,cacheblend:fidelity=fast+recompute_ratio=0.15,\
    cacheblend:fidelity=fast+recompute_ratio=0.3,cacheblend:fidelity=fast+recompute_ratio=0.5,\
    cacheblend:fidelity=fast+recompute_ratio=0.7,cacheblend:fidelity=0.5,cacheblend:fidelity=0.3,cacheblend,\
    cacheblend:fidelity=strict"
    .venv/bin/python research/guard_curve.py out/guard/curve.json --floor 0.792 --out docs/guard

`--floor` is the noise floor's agreement from a separate run (`--noise-floor bfloat16 --strategies full`), for a
report without one; a report with a run of full in the other dtype draws its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

from kvboost_rag.config import LEVEL_BUDGETS

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BINS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0001)  # predicted chance of a different answer


def settings(label: str) -> dict[str, str]:
    _, _, overrides = label.partition(":")
    return dict(pair.split("=", 1) for pair in overrides.split("+") if pair)


def families(report: dict) -> tuple[dict, dict]:
    """(fixed budget: label -> row, guarded: label -> row), cacheblend rows only."""
    fixed, guarded = {}, {}
    for label, row in report["strategies"].items():
        if not label.startswith("cacheblend"):
            continue
        (fixed if settings(label).get("fidelity") == "fast" else guarded)[label] = row
    return fixed, guarded


def calibration_bins(report: dict, labels) -> list[dict]:
    """The unguarded requests binned by their estimate: mean predicted vs measured share differing."""
    pairs = [(item[label]["fidelity_estimate"], 1.0 - item[label]["agreement"])
             for item in report["per_item"] for label in labels]
    bins = []
    for low, high in zip(BINS, BINS[1:], strict=False):
        inside = [(p, d) for p, d in pairs if low <= p < high]
        if inside:
            bins.append({"range": f"{low:.2f}-{min(high, 1):.2f}", "requests": len(inside),
                         "predicted": statistics.fmean(p for p, _ in inside),
                         "measured": statistics.fmean(d for _, d in inside)})
    return bins


def floor_row(report: dict, agreement: float | None = None) -> dict | None:
    """The noise floor: the report's full prefill in the other dtype, else an agreement measured in a run of its
    own (`--floor`: a bench run with `--noise-floor none`, the floor measured apart)."""
    row = next((row for label, row in report["strategies"].items() if label.startswith("full ")), None)
    if row is None and agreement is not None:
        row = {"agreement": agreement, "accuracy": None, "first_token_kl": None}
    return row


def plot(report: dict, fixed: dict, guarded: dict, bins: list[dict], path: Path, floor: dict | None) -> None:
    """Three panels: agree@16 and accuracy against speed-up for both families; the estimate's calibration."""
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    full = report["strategies"]["full"]
    for ax, (key, title) in zip(axes, [("agreement", "agree@16: same 16 tokens as full"),
                                       ("accuracy", "accuracy")], strict=False):
        for name, rows, marker in (("fixed recompute_ratio (no guard)", fixed, "o"),
                                   ("fidelity guard (levels)", guarded, "s")):
            points = sorted((r["speedup"], r[key], label) for label, r in rows.items() if r.get(key) is not None)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, label=name)
            for x, y, label in points:
                s = settings(label)
                fast = s.get("fidelity") == "fast"
                text = s.get("recompute_ratio", str(LEVEL_BUDGETS["fast"])) if fast else s.get("fidelity", "balanced")
                ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        if key == "agreement" and floor is not None:
            ax.axhline(floor["agreement"], ls="--", lw=0.8, color="gray", label="noise floor (full, other dtype)")
        if key == "accuracy" and full.get("accuracy") is not None:
            ax.axhline(full["accuracy"], ls="--", lw=0.8, color="black", label="full prefill")
        ax.set_ylim(0, 1.05 if key == "agreement" else max(0.5, ax.get_ylim()[1]))
        ax.set_xlabel("TTFT speed-up over full prefill (x, median)")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[2]
    ax.plot([0, 1], [0, 1], color="black", lw=0.8, label="calibrated")
    grid = [i / 100 for i in range(101)]
    ax.fill_between(grid, [x / 2 for x in grid], [min(2 * x, 1.0) for x in grid], color="gray", alpha=0.2,
                    label="within 2x")
    ax.scatter([b["predicted"] for b in bins], [b["measured"] for b in bins],
               s=[20 + 4 * b["requests"] for b in bins], zorder=3, label="unguarded requests, binned (size: count)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("predicted P(16-token answer differs from full's)")
    ax.set_ylabel("measured share that differs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{report['model']} ({report['dtype']}, {report['items']} held-out items): the guard against a "
                 "fixed budget, and its estimate's calibration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(report: dict, fixed: dict, guarded: dict, bins: list[dict], floor: dict | None) -> str:
    lines = [f"{report['model']}, {report['dtype']}, {report['items']} items, max_new_tokens "
             f"{report['max_new_tokens']}; median speed-up, mean quality; {report['seconds']} s", "",
             "| family | setting | speed-up | agree@16 | accuracy | KL first | P(differs) | fell back | switched |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, rows in (("fixed", fixed), ("guard", guarded)):
        for label, r in sorted(rows.items(), key=lambda kv: -kv[1]["speedup"]):
            lines.append(f"| {name} | {label} | {r['speedup']:.2f}x | {r['agreement']:.3f} | "
                         f"{r.get('accuracy') or 0:.3f} | {r['first_token_kl']:.4f} | {r['fidelity_estimate']:.3f} | "
                         f"{r['fell_back']:.2f} | {r['switched']:.2f} |")
    for label in ("full", "naive"):
        r = report["strategies"].get(label)
        if r:
            lines.append(f"| - | {label} | {r['speedup']:.2f}x | {r['agreement']:.3f} | {r.get('accuracy') or 0:.3f} "
                         f"| {r['first_token_kl']:.4f} | - | - | - |")
    if floor:
        kl, accuracy = floor["first_token_kl"], floor.get("accuracy")
        lines.append(f"| floor | full, other dtype | - | {floor['agreement']:.3f} | "
                     f"{'-' if accuracy is None else f'{accuracy:.3f}'} | {'-' if kl is None else f'{kl:.4f}'} "
                     "| - | - | - |")
    within = sum(b["requests"] for b in bins if b["measured"] and 0.5 <= b["predicted"] / b["measured"] <= 2)
    lines += ["", "Calibration of the unguarded requests' estimate (bins of predicted chance):", "",
              "| predicted in | requests | mean predicted | measured differing | ratio |", "|---|---|---|---|---|"]
    for b in bins:
        ratio = f"{b['predicted'] / b['measured']:.2f}" if b["measured"] else "-"
        lines.append(f"| {b['range']} | {b['requests']} | {b['predicted']:.3f} | {b['measured']:.3f} | {ratio} |")
    total = sum(b["requests"] for b in bins)
    lines += ["", f"Requests in bins whose predicted/measured ratio is within 2x: {within} of {total}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="a kvboost-rag bench --json report (see the docstring)")
    parser.add_argument("--out", type=Path, default=Path("out/guard"))
    parser.add_argument("--floor", type=float, help="the noise floor's agreement, where the report has no run of "
                        "full in the other dtype (--noise-floor none)")
    args = parser.parse_args()
    report = json.loads(args.report.read_text())
    fixed, guarded = families(report)
    if not fixed or not guarded:
        raise SystemExit("the report needs cacheblend rows with fidelity=fast and guarded ones: see the docstring")
    bins = calibration_bins(report, fixed)
    args.out.mkdir(parents=True, exist_ok=True)
    floor = floor_row(report, args.floor)
    plot(report, fixed, guarded, bins, args.out / "guard.png", floor)
    text = markdown(report, fixed, guarded, bins, floor)
    (args.out / "curve.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
