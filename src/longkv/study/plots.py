"""A study's plots (`study.report.write_study_report`): mqar accuracy against pairs, gap, lead
and state size; lm loss against position with the training length marked."""

from __future__ import annotations

from pathlib import Path
from statistics import fmean

from longkv.results import finish_figure, pyplot
from longkv.study.records import Record, by_lead, has_leads


def plot_mqar(means: dict[str, Record], path: Path, title: str) -> None:
    """Accuracy vs pairs and vs gap per (filler, value_len), vs lead length per lead kind where
    the points have leads, and vs state size for kvm."""
    plt = pyplot()
    points = next(iter(means.values()))["points"]
    kinds = sorted({(p["filler"], p["value_len"]) for p in points})
    kvm = [v for v, m in means.items() if m["points"][0]["state_slots"] is not None]
    leads = has_leads(points)
    lead_kinds = sorted({p["lead_kind"] for p in points}) if leads else []
    nrows = 2 + int(leads) + int(bool(kvm))
    ncols = max(len(kinds), len(lead_kinds))
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.5 * ncols, 3.5 * nrows), squeeze=False)
    for row in axes:
        for ax in row[len(kinds) :]:
            ax.axis("off")
    color = {variant: f"C{i}" for i, variant in enumerate(means)}  # one colour per variant
    for col, (filler, value_len) in enumerate(kinds):
        for row, key in enumerate(("num_pairs", "gap")):
            ax = axes[row][col]
            for variant, m in means.items():
                mine = [
                    p for p in m["points"] if (p["filler"], p["value_len"]) == (filler, value_len)
                ]
                xs = sorted({p[key] for p in mine})
                ys = [fmean(p["accuracy"] for p in mine if p[key] == x) for x in xs]
                ax.plot(xs, ys, marker="o", label=variant, color=color[variant])
            other = "gaps" if key == "num_pairs" else "pairs"
            ax.set_title(f"{filler} filler, value_len {value_len}", fontsize=9)
            ax.set_xlabel(f"{'pairs' if key == 'num_pairs' else 'gap'} (mean over {other})")
            ax.set_ylabel("accuracy")
            ax.set_ylim(-0.02, 1.02)
            ticks = sorted({p[key] for p in points})
            if key == "gap":  # 0 and long gaps on one axis
                ax.set_xscale("symlog", linthresh=1)
                ax.set_xlim(0, max(ticks) * 1.2 + 1)
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.legend(fontsize=7)
    for col, kind in enumerate(lead_kinds):  # recall against the lead's length
        ax = axes[2][col]
        ax.axis("on")
        for variant, m in means.items():
            recall = by_lead(m["points"], kind)
            ax.plot(list(recall), list(recall.values()), marker="o", label=variant,
                    color=color[variant])  # fmt: skip
        ax.set_xscale("symlog", linthresh=64)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("lead before the pairs (tokens; mean over pairs, gaps, fillers)")
        ax.set_ylabel("accuracy")
        ax.set_title(f"{kind} lead", fontsize=9)
        ax.legend(fontsize=7)
    if kvm:  # recall against pairs per state slot, one panel per value length
        lengths = sorted({value_len for _, value_len in kinds})
        for col, value_len in enumerate(lengths):
            ax = axes[nrows - 1][col]
            for variant in kvm:
                pts = [p for p in means[variant]["points"] if p["value_len"] == value_len]
                ax.scatter(
                    [p["num_pairs"] / p["state_slots"] for p in pts],
                    [p["accuracy"] for p in pts],
                    label=variant, color=color[variant], alpha=0.6,
                )  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
            ax.set_ylim(-0.02, 1.02)
            ax.set_xlabel("pairs per state slot (end of row)")
            ax.set_ylabel("accuracy")
            ax.set_title(f"kvm: every point, value_len {value_len}", fontsize=9)
            ax.legend(fontsize=7)
        for col in range(len(lengths), ncols):
            axes[nrows - 1][col].axis("off")
    finish_figure(fig, path, title)


def plot_lm(means: dict[str, Record], train_len: int, path: Path, title: str) -> None:
    """Held-out loss against position (each bucket at its end), the training length marked."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant, m in means.items():
        ax.plot(
            [b["high"] for b in m["buckets"]],
            [b["loss"] for b in m["buckets"]],
            marker="o",
            label=variant,
        )
    ax.axvline(train_len, color="gray", linestyle="--", label=f"training length {train_len}")
    ax.set_xscale("log")
    ax.set_xlabel("position (end of bucket)")
    ax.set_ylabel("held-out loss (nats)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    finish_figure(fig, path)
