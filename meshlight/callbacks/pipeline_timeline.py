"""The pipeline timeline: per rank, when each stage computed (forward, backward, weight gradient) and on which
microbatch during one training step, and the bubble (the share of the step a rank idles). TrainingMonitor draws it
for TensorBoard: labelled with matplotlib (:func:`meshlight.callbacks.figures.timeline_figure`), else as bare bars
(:func:`render_timeline`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np

__all__ = ["COLORS", "IDLE", "Event", "pipeline_bubble", "render_timeline"]

#: kind ("F", "B" or "W"), stage index, microbatch (None if unknown), start and end seconds into the step
Event = tuple[str, int, Optional[int], float, float]
COLORS = {"F": (66, 133, 244), "B": (234, 134, 0), "W": (52, 168, 83)}  # forward blue, backward orange, W green
IDLE, _GAP = (236, 236, 236), (255, 255, 255)


def render_timeline(ranks: Sequence[Sequence[Event]], step_seconds: float, width: int = 960, row: int = 24,
                    gap: int = 6) -> np.ndarray:
    """An unlabelled ``H × W × 3`` uint8 image: one row per rank (rank 0 on top), time left to right over the
    step; each compute call a bar in its kind's color (later virtual stages of a rank darker), idle time light
    grey."""
    image = np.full((len(ranks) * (row + gap) + gap, width, 3), _GAP, dtype=np.uint8)
    scale = width / max(step_seconds, 1e-9)
    for rank, events in enumerate(ranks):
        top = gap + rank * (row + gap)
        image[top:top + row] = IDLE
        stages = sorted({event[1] for event in events})
        for kind, stage, _, start, end in events:
            shade = 1.0 - 0.35 * stages.index(stage) / max(len(stages) - 1, 1)
            left, right = int(start * scale), max(int(end * scale), int(start * scale) + 1)
            image[top:top + row, max(left, 0):min(right, width)] = [int(c * shade) for c in COLORS[kind]]
    return image


def pipeline_bubble(ranks: Sequence[Sequence[Event]], step_seconds: float) -> float:
    """1 − busy / step time, averaged over ranks."""
    busy = [sum(end - start for *_, start, end in events) for events in ranks]
    return 1.0 - sum(busy) / (len(ranks) * step_seconds) if ranks and step_seconds > 0 else 0.0
