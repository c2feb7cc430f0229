"""The figures meshlight draws for TensorBoard, labelled: the pipeline timeline and the expert-load heatmap.

They need matplotlib (``pip install meshlight[plots]``); without it the callbacks fall back to unlabelled
images (:func:`~meshlight.callbacks.pipeline_timeline.render_timeline`,
:func:`~meshlight.callbacks.expert_load.load_heatmap`); TrainingMonitor says how to get these. Figures are drawn on
matplotlib's Agg canvas directly, never through pyplot: no global state, no display needed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from torch import Tensor

from meshlight.callbacks.pipeline_timeline import COLORS, IDLE, Event

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["can_draw", "figure_image", "load_heatmap_figure", "timeline_figure"]

KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient"}
_DPI = 96


def can_draw() -> bool:
    """Whether matplotlib is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def figure_image(figure: Figure) -> np.ndarray:
    """The figure as an ``H × W × 3`` uint8 array, as TensorBoard's ``add_image(..., dataformats="HWC")`` takes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def _rgb(color: tuple[int, int, int], shade: float = 1.0) -> tuple[float, float, float]:
    return tuple(channel * shade / 255 for channel in color)


def timeline_figure(ranks: Sequence[Sequence[Event]], step_seconds: float, *, step: int | None = None,
                    schedule: str | None = None, bubble: float | None = None) -> Figure:
    """One row per rank (rank 0 on top), labelled with the stages it holds; time into the step in milliseconds
    along the bottom; each compute call a bar coloured by its kind (legend) with its microbatch's number on it;
    light grey where the rank idles. ``ranks[r]`` holds ``(kind, stage, microbatch, start, end)`` events,
    seconds into the step; ``microbatch`` may be None (no number drawn)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    milliseconds = step_seconds * 1e3
    figure = Figure(figsize=(10, 1.3 + 0.5 * len(ranks)), dpi=_DPI, layout="constrained")
    axes = figure.add_subplot()
    kinds_seen: list[str] = []
    labels = []
    width_px = 10 * _DPI * 0.85  # about the plot's width on the canvas
    for rank, events in enumerate(ranks):
        stages = sorted({event[1] for event in events})
        axes.barh(rank, milliseconds, left=0, height=0.8, color=_rgb(IDLE))
        for kind, stage, microbatch, start, end in events:
            shade = 1.0 - 0.35 * stages.index(stage) / max(len(stages) - 1, 1)
            left, width = start * 1e3, max((end - start) * 1e3, milliseconds * 1e-4)
            axes.barh(rank, width, left=left, height=0.8, color=_rgb(COLORS[kind], shade),
                      edgecolor="white", linewidth=0.5)
            if kind not in kinds_seen:
                kinds_seen.append(kind)
            if microbatch is not None and width / max(milliseconds, 1e-9) * width_px >= 9:
                axes.text(left + width / 2, rank, str(microbatch), ha="center", va="center", fontsize=7,
                          color="white")
        held = ", ".join(map(str, stages)) if stages else "none"
        labels.append(f"rank {rank}\nstage{'s' if len(stages) > 1 else ''} {held}")
    axes.set_yticks(range(len(ranks)), labels, fontsize=8)
    axes.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top
    axes.set_xlim(0, milliseconds)
    axes.set_xlabel("time into the optimizer step (ms); the number on a bar is its microbatch")
    title = "Pipeline timeline"
    if step is not None:
        title += f" of optimizer step {step}"
    if schedule:
        title += f" ({schedule})"
    if bubble is not None:
        title += f": idle {bubble:.0%} of the step, averaged over ranks"
    axes.set_title(title, fontsize=10)
    handles = [Patch(color=_rgb(COLORS[kind]), label=KIND_NAMES[kind]) for kind in "FBW" if kind in kinds_seen]
    handles.append(Patch(color=_rgb(IDLE), label="idle (waiting for another stage)"))
    figure.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    return figure


def load_heatmap_figure(history: Sequence[Tensor], *, layer: str, last_step: int) -> Figure:
    """Expert ``e`` (row) at optimizer step ``s`` (column, the last ``len(history)`` steps up to ``last_step``),
    coloured by its share of the assignments relative to an even share: white even, red above (full at 2× and
    more), blue below (full at ½× and less)."""
    import torch
    from matplotlib.figure import Figure

    shares = torch.stack(list(history), dim=1).float()  # [experts, steps]
    experts, steps = shares.shape
    relative = torch.log2((shares * experts).clamp_min(1e-6)).clamp(-1.0, 1.0).numpy()
    figure = Figure(figsize=(8, 1.6 + 0.22 * experts), dpi=_DPI, layout="constrained")
    axes = figure.add_subplot()
    first = last_step - steps + 1
    image = axes.imshow(relative, cmap="bwr", vmin=-1, vmax=1, aspect="auto", interpolation="nearest",
                        extent=(first - 0.5, last_step + 0.5, experts - 0.5, -0.5))
    axes.set_yticks(range(experts), [str(e) for e in range(experts)], fontsize=7 if experts > 16 else 8)
    axes.set_ylabel("expert")
    worst = float((shares.max(dim=0).values * experts).mean())
    axes.set_xlabel(f"optimizer step (the busiest expert's load ÷ the mean, averaged over these steps: {worst:.2f})")
    axes.set_title(f"Expert load in {layer}, relative to an even share", fontsize=10)
    bar = figure.colorbar(image, ax=axes, ticks=[-1, 0, 1], fraction=0.04)
    bar.ax.set_yticklabels(["½× or less", "even", "2× or more"], fontsize=8)
    return figure


