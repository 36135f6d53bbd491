"""Printing and plotting a bench report (the dict `run.run_bench` returns)."""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

COLUMNS = [  # (key, header, format)
    ("ttft_ms", "TTFT ms", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("accuracy", "accuracy", "{:.3f}"),
    ("agreement", "agree@16", "{:.3f}"),
    ("first_token_kl", "KL first", "{:.4f}"),
    ("continuation_kl", "KL cont", "{:.4f}"),
    ("first_logit_gap", "max abs dlogit 1st (mean)", "{:.3f}"),
    ("max_first_logit_gap", "(max)", "{:.3f}"),
    ("recompute_fraction", "recompute", "{:.3f}"),
    ("reuse_fraction", "reuse", "{:.3f}"),
    ("document_reuse", "doc tokens reused", "{:.3f}"),
    ("prompt_tokens", "prompt tok", "{:.0f}"),
    ("total_ms", "total ms", "{:.0f}"),
    ("fidelity_estimate", "P(differs)", "{:.3f}"),
    ("differs", "differs", "{:.3f}"),
    ("fell_back", "fell back", "{:.2f}"),
    ("escalated", "escalated", "{:.2f}"),
    ("halved", "bf16 prefill", "{:.2f}"),
    ("held_strict", "held strict", "{:.2f}"),
    ("switched", "switched", "{:.2f}"),
]


def table(report: dict) -> str:
    """A Markdown table, one row per strategy."""
    rows = report["strategies"]
    columns = COLUMNS
    head = ["strategy"] + [h for _, h, _ in columns]
    paired = any("lost" in row for row in rows.values())
    if paired:  # accuracy paired with full's, beside it
        at = head.index("accuracy") + 1
        head.insert(at, "lost / won (sign test p)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, row in rows.items():
        cells = [label] + ["-" if row.get(k) is None else fmt.format(row[k]) for k, _, fmt in columns]
        if paired:
            cells.insert(at, f"{row['lost']} / {row['won']} ({row['sign_test_p']:.2f})" if "lost" in row else "-")
        lines.append("| " + " | ".join(cells) + " |")
    title = (f"{report['model']}, {report['dtype']}, kv_bits={report['kv_bits']}, {report['items']} items, "
             f"median TTFT and speedup, mean quality; {report['seconds']} s")
    shadow = report.get("shadow_checks")
    if shadow:  # the guard's predictions against the shadow checks of the bench's answers (shadow.py)
        lines += ["", f"Shadow checks: {shadow['checks']}; differing answers predicted {shadow['predicted_differ']:.2f}"
                      f", observed {shadow['observed_differ']}; flips over {shadow['tokens']} served tokens predicted "
                      f"{shadow['predicted_flips']:.2f}, observed {shadow['observed_flips']}"]
    for row in report.get("floors_checked") or ():  # the floors on the bench's answers against calibration's curves
        lines.append(f"{row['floor'].capitalize()} floor at budget {row['budget']:g}: {row['flips']} of "
                     f"{row['samples']} checked tokens differ from full's; calibrated curve expected "
                     f"{row.get('expected_before', math.nan):.1f}, refit {row['expected_now']:.1f}")
    held = {level: c for level, c in (report.get("floor_credit") or {}).items() if c["cap"] > 0}
    if held:  # the levels held on average (fidelity.Account)
        lines.append("Held on average: " + "; ".join(
            f"{level} {c['loans']} loans, {c['borrowed']:.2f} of floor risk, {c['credit']:.2f} left of {c['cap']:g}"
            for level, c in held.items()))
    trials = report.get("ladder_trials")
    if trials and any(trials.values()):  # skipped steps tried after their request (repair/routes.py, shadow.py)
        lines.append(f"Ladder trials made after their request: {trials['held']} held, {trials['refused']} refused, "
                     f"{trials['dropped']} dropped")
    return title + "\n\n" + "\n".join(lines)


def family(label: str) -> str:
    """A strategy label without its recompute_ratio override: the points of one speed/quality curve."""
    name, _, overrides = label.partition(":")
    rest = [o for o in overrides.split("+") if o and not o.startswith("recompute_ratio=")]
    return name + (":" + "+".join(rest) if rest else "")


def plot(report: dict, path: str) -> None:
    """Speed-up against continuation KL, and against accuracy when the set has answers. Strategies that
    differ only in recompute_ratio are joined into one curve; dashed lines mark issue #6's targets
    (a third of naive's KL, 80% of the naive-to-full accuracy gap). Points on a curve are labelled with
    their recompute fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["strategies"]
    has_accuracy = any(r.get("accuracy") is not None for r in rows.values())
    fig, axes = plt.subplots(1, 2 if has_accuracy else 1, figsize=(12 if has_accuracy else 6.5, 4.8), squeeze=False)
    panels = [("continuation_kl", "continuation KL vs full (lower is better)")]
    if has_accuracy:
        panels.append(("accuracy", "accuracy (higher is better)"))
    full, naive = rows.get("full"), rows.get("naive")
    sizes = collections.Counter(family(name) for name in rows)
    for ax, (key, label) in zip(axes[0], panels, strict=False):
        curves: dict[str, list[tuple[float, float]]] = {}
        for name, r in rows.items():
            if r.get(key) is None:
                continue
            curves.setdefault(family(name), []).append((r["speedup"], r[key]))
            # A curve's points are told apart by what they recompute; a lone point by its name.
            text = f"{r['recompute_fraction']:.2f}" if sizes[family(name)] > 1 else name
            ax.annotate(text, (r["speedup"], r[key]), textcoords="offset points", xytext=(4, 4), fontsize=7)
        for name, points in curves.items():
            points.sort()
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", ms=5,
                    lw=1 if len(points) > 1 else 0, label=name)
        if full and naive and full.get(key) is not None and naive.get(key) is not None:
            target = naive[key] / 3 if key == "continuation_kl" else naive[key] + 0.8 * (full[key] - naive[key])
            ax.axhline(target, ls="--", lw=0.8, color="gray")
            ax.axvline(3.0, ls=":", lw=0.8, color="gray")
        ax.set_xlabel("TTFT speed-up over full prefill (x)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"{report['model']} ({report['dtype']}, {report['items']} items)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the scaling report (scaling.run_scaling) -------------------------------------------------------------

SCALING_COLUMNS = [  # (key, header, format)
    ("ttft_ms", "TTFT ms", "{:.1f}"),
    ("ttft_ratio", "TTFT / full's", "{:.3f}"),
    ("speedup", "speed-up", "{:.2f}x"),
    ("first_token_agreement", "1st token = full's", "{:.2f}"),
    ("agreement", "agree@N", "{:.2f}"),
    ("first_token_kl", "KL 1st", "{:.4f}"),
    ("first_logit_gap", "max abs dlogit 1st", "{:.3f}"),
    ("recompute_fraction", "recompute", "{:.3f}"),
    ("fell_back", "fell back", "{:.2f}"),
]


def scaling_table(report: dict) -> str:
    """Markdown: how the report was made, its ingestion, then one row per size and strategy."""
    ing = report["ingest"]
    speed = "-" if ing["tokens_per_s"] is None else f"{ing['tokens_per_s']:.0f} tokens/s"
    head = ["target", "prompt tok", "strategy"] + [h.replace("agree@N", f"agree@{report['agree_tokens']}")
                                                   for _, h, _ in SCALING_COLUMNS]
    lines = [f"{report['model']}, {report['dtype']} on {report['device']} ({report['device_name']}), "
             f"kv_bits={report['kv_bits']}, {report['per_size']} prompt(s) per size; median TTFT and ratios, mean "
             f"quality against full; {report['seconds']} s",
             "",
             f"Ingestion: {ing['documents']} documents, {ing['tokens']} tokens in {ing['seconds']:.1f} s ({speed}, "
             f"{ing['computed']} computed, {ing['stored_already']} found stored); calibration "
             + (f"{ing['calibration_s']:.1f} s more" if ing["calibrated"] else "not run"),
             "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for size in report["sizes"]:
        for label, row in size["strategies"].items():
            cells = [str(size["target"]), f"{size['prompt_tokens']:.0f}", label]
            cells += ["-" if row.get(k) is None else fmt.format(row[k]) for k, _, fmt in SCALING_COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
    for refused in report["refused"]:
        lines.append(f"| {refused['target']} | - | refused: {refused['reason']} |" + " |" * len(SCALING_COLUMNS))
    return "\n".join(lines)


def plot_scaling(report: dict, path: str) -> None:
    """Median TTFT (left, log-log) and TTFT as a share of full's (right) against prompt tokens, a line per
    strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = report["sizes"]
    labels = list(sizes[0]["strategies"]) if sizes else []
    fig, (absolute, ratio) = plt.subplots(1, 2, figsize=(12, 4.8))
    tokens = [s["prompt_tokens"] for s in sizes]
    for label in labels:
        style = dict(marker="o", ms=5, label=label, ls="--" if label == "full" else "-")
        absolute.plot(tokens, [s["strategies"][label]["ttft_ms"] for s in sizes], **style)
        ratio.plot(tokens, [s["strategies"][label]["ttft_ratio"] for s in sizes], **style)
    absolute.set_xscale("log", base=2)
    absolute.set_yscale("log")
    absolute.set_ylabel("median TTFT (ms)")
    ratio.set_xscale("log", base=2)
    ratio.set_ylim(bottom=0)
    ratio.set_ylabel("TTFT / full prefill's TTFT (median)")
    for ax in (absolute, ratio):
        ax.set_xticks(tokens, [f"{t:.0f}" for t in tokens])
        ax.set_xlabel("prompt tokens")
        ax.grid(alpha=0.3)
    ratio.legend(fontsize=8)
    fig.suptitle(f"{report['model']} ({report['dtype']}, {report['device_name']}): TTFT as the prompt grows")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_scaling(report: dict, folder: str | Path, plot: bool = True) -> list[Path]:
    """scaling.json, scaling.md and (with `plot`) scaling.png in `folder`; returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "scaling.json", folder / "scaling.md"]
    paths[0].write_text(json.dumps(report, indent=1))
    paths[1].write_text(scaling_table(report) + "\n")
    if plot and report["sizes"]:
        paths.append(folder / "scaling.png")
        plot_scaling(report, str(paths[-1]))
    return paths
