"""The examples' loss-curve plot: both runs' train losses, and below them their relative
difference against the tolerance (the curves overlap at any visible scale). Imports matplotlib
only, so every example can use it."""

import matplotlib

matplotlib.use("Agg")  # headless: only writes a file
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def save_loss_plot(path: str, unfused: list, fused: list, labels: tuple[str, str], title: str,
                   ylabel: str, loss_rtol: float, xlabel: str = "epoch") -> None:
    """Writes the PNG at `path`: per-epoch (or per-interval: xlabel) `unfused` and `fused`
    losses (labels for the legend)."""
    epochs = list(range(1, len(unfused) + 1))
    rel = [abs(u - f) / u for u, f in zip(unfused, fused)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    top.plot(epochs, unfused, label=labels[0], linewidth=3, alpha=0.6)
    top.plot(epochs, fused, "--", label=labels[1], linewidth=1.5)
    top.set(ylabel=ylabel, yscale="log", title=title)
    top.legend()
    # Exact zeros have no place on a log axis: gaps in the line, markers on the bottom edge.
    bottom.plot(epochs, [r if r > 0 else float("nan") for r in rel], "o-", markersize=3,
                color="tab:red", label="|difference| / loss")
    zeros = [e for e, r in zip(epochs, rel) if r == 0]
    if zeros:
        bottom.plot(zeros, [0] * len(zeros), "v", color="tab:green", clip_on=False,
                    transform=bottom.get_xaxis_transform(), label="exactly equal")
    bottom.axhline(loss_rtol, color="black", linestyle=":", label=f"tolerance {loss_rtol:.0e}")
    nonzero = [r for r in rel if r > 0]
    bottom.set(xlabel=xlabel, ylabel="|loss difference| / loss", yscale="log",
               ylim=(min(nonzero + [loss_rtol]) / 10, loss_rtol * 10))
    bottom.legend()
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole epochs
    for ax in (top, bottom):
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
