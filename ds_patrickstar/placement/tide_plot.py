"""The tide plot: model data, resident activations and offloaded activations at every moment, with
the budget line (like Figure 2 of the PatrickStar paper), the recomputation moments of activation
checkpointing shaded (see [Note: recomputation in the trace]), and under it a caption with the
host side of the disk tier (:func:`disk_caption`: states on disk, host buffers, the last step's
I/O). :func:`tide_series` and :func:`disk_caption` are the data (no plotting library needed);
matplotlib is an optional dependency (``.[plot]``) of :func:`plot_tide`."""

from __future__ import annotations

from collections.abc import Mapping

_MIB = 2**20


def tide_series(tide: list[tuple[int, int, int, int]]) -> dict[str, list[float]]:
    """The plotted series in MiB per moment: ``model`` (chunks and the backend's other accelerator
    bytes), ``resident`` (non-model: activations on the accelerator), ``offloaded`` (saved
    activations on the host, see [Note: activation offload]), and the ``moments``."""
    return {
        "moments": [float(m) for m, *_ in tide],
        "model": [b / _MIB for _, b, _, _ in tide],
        "resident": [b / _MIB for _, _, b, _ in tide],
        "offloaded": [b / _MIB for _, _, _, b in tide],
    }


def disk_caption(counters: Mapping[str, float]) -> str:
    """The disk tier's line under the plot, from a step's counters (empty when nothing is on disk):
    optimizer states and frozen chunks on disk, host buffers, and the step's bytes read (of them,
    issued during backward) and written, and the seconds it waited on them (see [Note: disk tier]
    and [Note: frozen chunks on disk])."""
    if not counters.get("model_bytes_disk") and not counters.get("frozen_bytes_disk"):
        return ""
    gib = 2**30
    frozen = counters.get("frozen_bytes_disk", 0)
    return (
        f"disk tier: {counters['model_bytes_disk'] / gib:.2f} GiB of optimizer states on disk, "
        + (f"{frozen / gib:.2f} GiB of frozen chunks on disk, " if frozen else "")
        + f"{counters['disk_buffer_bytes'] / _MIB:.0f} MiB of host buffers; last step read "
        f"{counters['disk_bytes_read'] / gib:.2f} GiB ({counters['disk_bytes_read_ahead'] / gib:.2f} GiB "
        f"during backward), wrote {counters['disk_bytes_written'] / gib:.2f} GiB, waited "
        f"{counters['disk_wait_seconds']:.2f} s on I/O"
    )


def plot_tide(
    tide: list[tuple[int, int, int, int]],
    budget: int,
    path: str,
    title: str = "",
    recomputations: list[int] | None = None,
    caption: str = "",
) -> str:
    try:
        import matplotlib
    except ImportError as err:
        raise RuntimeError(
            "the tide plot needs matplotlib: pip install matplotlib (or pip install 'ds_patrickstar[plot]')"
        ) from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = tide_series(tide)
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.stackplot(
        series["moments"],
        series["resident"],
        series["model"],
        labels=["activations on the accelerator (non-model)", "model data (chunks)"],
        colors=["#f4a261", "#2a9d8f"],
        step="post",
    )
    if any(series["offloaded"]):
        ax.step(
            series["moments"],
            series["offloaded"],
            where="post",
            color="#6d597a",
            linestyle=":",
            label="activations offloaded to the host (not on the accelerator)",
        )
    for n, moment in enumerate(recomputations or ()):
        label = "recomputation (checkpointed forward in backward)" if n == 0 else None
        ax.axvspan(moment, moment + 1, color="#8d99ae", alpha=0.35, label=label)
    ax.axhline(budget / _MIB, color="#e63946", linestyle="--", label="budget")
    ax.set_xlabel("moment (module pre-forward / pre-backward, optimizer step)")
    ax.set_ylabel("memory (MiB)")
    ax.set_title(title or "ds_patrickstar memory tide")
    ax.legend(loc="upper right")
    if caption:
        fig.text(0.01, 0.01, caption, fontsize=7, ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.05 if caption else 0, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
