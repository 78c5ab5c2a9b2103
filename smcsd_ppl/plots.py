"""The plots' common style, and matplotlib (the ``[bench]`` extra) or a line saying how to get it."""

from __future__ import annotations

STYLE = {
    "font.size": 11,
    "axes.titlesize": 12,
    "axes.labelsize": 11,
    "legend.fontsize": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
}


def finish_plot(fig, ax, path, *, xlabel: str, ylabel: str, ylim: tuple[float, float], legend="best") -> None:
    """Label and bound a plot's axes, add its legend, and save it at the project's resolution."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(*ylim)
    ax.legend(loc=legend, frameon=False)
    fig.savefig(path, dpi=130)


def matplotlib_or_say():
    """matplotlib, or a one-line error naming the extra that installs it (plots are optional)."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plots need matplotlib: pip install 'smcsd_ppl[bench]'") from None
    return matplotlib
