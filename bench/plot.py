"""Shared matplotlib figures for the experiment benches (PNG, no display needed)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

COLORS = {"baseline": "tab:gray", "ps_fixed": "tab:blue", "ps_adaptive": "tab:orange",
          "spo": "tab:green", "grpo": "tab:gray", "GRPO": "tab:blue", "lr": "tab:gray",
          "GRPO+PS": "tab:orange", "revisit": "tab:purple"}


def arm_label(arm: str, seeds: int) -> str:
    """A legend label, e.g. "spo (3 seeds)"; band_plot colours it by its first word."""
    return f"{arm} ({seeds} seed{'s' if seeds > 1 else ''})"


def band_plot(path: str, title: str, xlabel: str, ylabel: str,
              series: Mapping[str, tuple[Sequence[float], Sequence[float], Sequence[float]]],
              hline: float | None = None, hband: float | None = None) -> str:
    """One line per arm: (x, mean, std) drawn as mean with a +-std band over seeds. The
    arm's colour is looked up by the first word of its label."""
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120)
    for name, (x, mean, std) in series.items():
        if len(x) == 0:
            continue
        x, mean, std = np.asarray(x, float), np.asarray(mean, float), np.asarray(std, float)
        color = COLORS.get(name.split(" ")[0])
        ax.plot(x, mean, marker="o", ms=3, label=name, color=color)
        ax.fill_between(x, mean - std, mean + std, alpha=0.2, color=color)
    if hline is not None:
        ax.axhline(hline, color="k", lw=0.8, ls="--")
        if hband:
            ax.axhspan(hline - hband, hline + hband, color="k", alpha=0.06)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
