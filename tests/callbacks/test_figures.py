"""The figures meshlight draws for TensorBoard carry what a reader needs: which rank and stage each row is, time
in milliseconds, what each colour means, which microbatch each bar computed; each expert's row, the steps, and
what the colours mean. Without matplotlib the callbacks fall back to the bare images."""

import numpy as np
import pytest
import torch

from meshlight.callbacks.figures import figure_image, load_heatmap_figure, timeline_figure
from meshlight.callbacks.pipeline_timeline import COLORS, IDLE, pipeline_bubble, render_timeline

pytest.importorskip("matplotlib")

MS = 1e-3
# 1F1B over 2 stages and 2 microbatches: rank 1 waits for rank 0's first forward, rank 0 for rank 1's backward
RANKS = [
    [("F", 0, 0, 0 * MS, 2 * MS), ("F", 0, 1, 2 * MS, 4 * MS), ("B", 0, 0, 8 * MS, 12 * MS),
     ("B", 0, 1, 12 * MS, 16 * MS)],
    [("F", 1, 0, 2 * MS, 4 * MS), ("B", 1, 0, 4 * MS, 8 * MS), ("F", 1, 1, 8 * MS, 10 * MS),
     ("B", 1, 1, 10 * MS, 14 * MS)],
]


def test_timeline_names_ranks_stages_time_kinds_and_microbatches():
    bubble = pipeline_bubble(RANKS, 16 * MS)
    figure = timeline_figure(RANKS, 16 * MS, step=5, schedule="1f1b", bubble=bubble)
    axes = figure.axes[0]
    assert [label.get_text() for label in axes.get_yticklabels()] == ["rank 0\nstage 0", "rank 1\nstage 1"]
    assert "ms" in axes.get_xlabel() and axes.get_xlim() == pytest.approx((0, 16))
    title = axes.get_title()
    assert "optimizer step 5" in title and "1f1b" in title and f"{bubble:.0%}" in title
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert legend == ["forward", "backward", "idle (waiting for another stage)"]
    assert sorted(text.get_text() for text in axes.texts) == ["0", "0", "0", "0", "1", "1", "1", "1"]
    image = figure_image(figure)
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
    colors = {tuple(pixel) for pixel in image.reshape(-1, 3)}
    assert {COLORS["F"], COLORS["B"], IDLE} <= colors


def test_heatmap_names_experts_steps_and_the_colour_scale():
    history = [torch.tensor([0.25, 0.5, 0.125, 0.125])] * 3  # 4 experts, steps 8, 9, 10
    figure = load_heatmap_figure(history, layer="layers.1.feed_forward", last_step=10)
    axes, bar = figure.axes
    assert [label.get_text() for label in axes.get_yticklabels()] == ["0", "1", "2", "3"]
    assert axes.get_ylabel() == "expert" and "optimizer step" in axes.get_xlabel()
    assert "2.00" in axes.get_xlabel()  # the busiest expert holds twice the mean
    assert axes.get_xlim() == pytest.approx((7.5, 10.5))
    assert "layers.1.feed_forward" in axes.get_title()
    assert [label.get_text() for label in bar.get_yticklabels()] == ["½× or less", "even", "2× or more"]
    assert figure_image(figure).shape[2] == 3


def test_bare_timeline_without_matplotlib_keeps_its_rows():
    image = render_timeline(RANKS, 16 * MS, width=160, row=10, gap=2)
    assert image.shape == (2 * 12 + 2, 160, 3)
    assert tuple(image[2 + 5, 1]) == COLORS["F"] and tuple(image[14 + 5, 1]) == IDLE  # rank 1 waits at first
