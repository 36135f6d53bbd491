"""Printing and plotting a bench report (the dict `run.run_bench` returns)."""

from __future__ import annotations

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
]


def table(report: dict) -> str:
    """A Markdown table, one row per strategy."""
    head = ["strategy"] + [h for _, h, _ in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, row in report["strategies"].items():
        cells = [label] + ["-" if row.get(k) is None else fmt.format(row[k]) for k, _, fmt in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    title = (f"{report['model']}, {report['dtype']}, kv_bits={report['kv_bits']}, {report['items']} items, "
             f"median TTFT and speedup, mean quality; {report['seconds']} s")
    return title + "\n\n" + "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Speed-up against continuation KL, and against accuracy when the set has answers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["strategies"]
    has_accuracy = any(r.get("accuracy") is not None for r in rows.values())
    fig, axes = plt.subplots(1, 2 if has_accuracy else 1, figsize=(11 if has_accuracy else 6, 4.5), squeeze=False)
    panels = [("continuation_kl", "continuation KL vs full (lower is better)")]
    if has_accuracy:
        panels.append(("accuracy", "accuracy (higher is better)"))
    for ax, (key, label) in zip(axes[0], panels, strict=False):
        for name, r in rows.items():
            if r.get(key) is None:
                continue
            ax.scatter(r["speedup"], r[key], s=40)
            ax.annotate(name, (r["speedup"], r[key]), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("TTFT speed-up over full prefill (x)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{report['model']} ({report['dtype']}, {report['items']} items)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
