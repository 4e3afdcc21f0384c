"""PNG figures for the profile report (matplotlib, headless)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only: no display on a CI or GPU box
import matplotlib.pyplot as plt  # noqa: E402



def component_bars(rows, clock: str, path: str, title: str) -> None:
    """Horizontal bars: ms per step for each report row (forward and backward stacked)."""
    names = [r["component"] for r in rows]
    bwd = [r["backward_ms"] for r in rows]
    fwd = [r["ms"] - b for r, b in zip(rows, bwd)]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
    y = range(len(rows))
    ax.barh(y, fwd, color="tab:blue", label="forward")
    if any(bwd):
        ax.barh(y, bwd, left=fwd, color="tab:orange", label="backward")
        ax.legend(loc="lower right")
    for i, r in enumerate(rows):
        ax.text(r["ms"], i, f" {r['share']:.1%}", va="center", fontsize=8)
    ax.set_yticks(list(y), names)
    ax.invert_yaxis()
    ax.set_xlabel(f"ms per step ({clock})")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def expert_load(loads, maxvios, path: str, title: str) -> None:
    """Heat map: tokens routed to each expert, one row per MoE layer."""
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(loads) + 1.6))
    im = ax.imshow([[int(x) for x in row] for row in loads], aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(loads)), [f"{name} (MaxVio {v:.2f})" for name, v in maxvios])
    ax.set_xlabel("expert")
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label="token-slots routed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep_lines(results: dict, key: str, ylabel: str, path: str, title: str, cross=None, scale=1.0) -> None:
    """One line per attention mode against sequence length (log2 axis); the crossover as a dashed line."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for attn, points in results.items():
        ax.plot([p["seq"] for p in points], [p[key] * scale for p in points], marker="o", label=attn)
    if cross is not None:
        ax.axvline(cross, color="gray", linestyle="--", label=f"crossover ~{cross:.0f}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
