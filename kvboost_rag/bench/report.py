"""Printing and plotting a bench report (the dict `run.run_bench` returns)."""

from __future__ import annotations

import collections

COLUMNS = [  # (key, header, format)
    ("ttft_ms", "TTFT ms", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("accuracy", "accuracy", "{:.3f}"),
    ("agreement", "agree@16", "{:.3f}"),
    ("first_token_kl", "KL first", "{:.4f}"),
    ("continuation_kl", "KL cont", "{:.4f}"),
    ("recompute_fraction", "recompute", "{:.3f}"),
    ("reuse_fraction", "reuse", "{:.3f}"),
    ("prompt_tokens", "prompt tok", "{:.0f}"),
    ("total_ms", "total ms", "{:.0f}"),
    ("fidelity_estimate", "P(differs)", "{:.3f}"),
    ("fell_back", "fell back", "{:.2f}"),
    ("switched", "switched", "{:.2f}"),
]


def table(report: dict) -> str:
    """A Markdown table, one row per strategy."""
    rows = report["strategies"]
    columns = COLUMNS
    head = ["strategy"] + [h for _, h, _ in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, row in rows.items():
        cells = [label] + ["-" if row.get(k) is None else fmt.format(row[k]) for k, _, fmt in columns]
        lines.append("| " + " | ".join(cells) + " |")
    title = (f"{report['model']}, {report['dtype']}, kv_bits={report['kv_bits']}, {report['items']} items, "
             f"median TTFT and speedup, mean quality; {report['seconds']} s")
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
