"""The pipeline timeline: per rank, when each stage computed (forward, backward, weight gradient) during one
training step, drawn as an image for TensorBoard, and the bubble (the share of the step a rank idles)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["COLORS", "Event", "pipeline_bubble", "render_timeline"]

Event = tuple[str, int, float, float]  # kind ("F", "B" or "W"), stage index, start and end seconds into the step
COLORS = {"F": (66, 133, 244), "B": (234, 134, 0), "W": (52, 168, 83)}  # forward blue, backward orange, W green
_IDLE, _GAP = (236, 236, 236), (255, 255, 255)


def render_timeline(ranks: Sequence[Sequence[Event]], step_seconds: float, width: int = 960, row: int = 24,
                    gap: int = 6) -> np.ndarray:
    """An ``H × W × 3`` uint8 image: one row per rank (rank 0 on top), time left to right over the step; each
    compute call a bar in its kind's color (later virtual stages of a rank darker), idle time light grey."""
    image = np.full((len(ranks) * (row + gap) + gap, width, 3), _GAP, dtype=np.uint8)
    scale = width / max(step_seconds, 1e-9)
    for rank, events in enumerate(ranks):
        top = gap + rank * (row + gap)
        image[top:top + row] = _IDLE
        stages = sorted({stage for _, stage, _, _ in events})
        for kind, stage, start, end in events:
            shade = 1.0 - 0.35 * stages.index(stage) / max(len(stages) - 1, 1)
            left, right = int(start * scale), max(int(end * scale), int(start * scale) + 1)
            image[top:top + row, max(left, 0):min(right, width)] = [int(c * shade) for c in COLORS[kind]]
    return image


def pipeline_bubble(ranks: Sequence[Sequence[Event]], step_seconds: float) -> float:
    """1 − busy / step time, averaged over ranks."""
    busy = [sum(end - start for _, _, start, end in events) for events in ranks]
    return 1.0 - sum(busy) / (len(ranks) * step_seconds) if ranks and step_seconds > 0 else 0.0
