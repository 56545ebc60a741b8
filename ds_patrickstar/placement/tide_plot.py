"""The tide plot: model and non-model accelerator memory at every moment, with the budget line
(like Figure 2 of the PatrickStar paper), the recomputation moments of activation checkpointing
shaded (see [Note: recomputation in the trace]). matplotlib is an optional dependency (``.[plot]``)."""

from __future__ import annotations


def plot_tide(
    tide: list[tuple[int, int, int]], budget: int, path: str, title: str = "", recomputations: list[int] | None = None
) -> str:
    try:
        import matplotlib
    except ImportError as err:
        raise RuntimeError(
            "the tide plot needs matplotlib: pip install matplotlib (or pip install 'ds_patrickstar[plot]')"
        ) from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    moments = [m for m, _, _ in tide]
    model = [b / 2**20 for _, b, _ in tide]
    non_model = [b / 2**20 for _, _, b in tide]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.stackplot(
        moments,
        non_model,
        model,
        labels=["non-model (activations)", "model data (chunks)"],
        colors=["#f4a261", "#2a9d8f"],
        step="post",
    )
    for n, moment in enumerate(recomputations or ()):
        label = "recomputation (checkpointed forward in backward)" if n == 0 else None
        ax.axvspan(moment, moment + 1, color="#8d99ae", alpha=0.35, label=label)
    ax.axhline(budget / 2**20, color="#e63946", linestyle="--", label="budget")
    ax.set_xlabel("moment (module pre-forward / pre-backward, optimizer step)")
    ax.set_ylabel("accelerator memory (MiB)")
    ax.set_title(title or "ds_patrickstar memory tide")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
