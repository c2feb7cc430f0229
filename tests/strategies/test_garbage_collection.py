"""Garbage collection while training: automatic collections off from the start of training to its end (or a failed
fit's teardown), a young-generation collection every n batches, Python's setting restored; None leaves it alone."""

import gc

import pytest

from meshlight.strategies.garbage_collection import TrainingGarbageCollection


@pytest.fixture
def collections(monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation))
    yield calls
    gc.enable()


def test_collects_the_young_generations_every_n_batches_and_restores_automatic_gc(collections):
    assert gc.isenabled()
    training = TrainingGarbageCollection(3)
    training.start()
    assert not gc.isenabled() and collections == [1]
    for _ in range(7):
        training.at_batch()
    assert collections == [1, 1, 1]  # at the start, after batches 3 and 6
    training.stop()
    assert gc.isenabled() and collections == [1, 1, 1, 1]
    training.stop()  # teardown after on_train_end: nothing more
    assert collections == [1, 1, 1, 1]


def test_a_disabled_gc_stays_disabled_and_none_leaves_python_alone(collections):
    gc.disable()
    training = TrainingGarbageCollection(2)
    training.start()
    training.stop()
    assert not gc.isenabled()
    gc.enable()
    untouched = TrainingGarbageCollection(None)
    untouched.start()
    untouched.at_batch()
    untouched.stop()
    assert gc.isenabled() and collections == [1, 1]


def test_a_step_count_below_one_is_refused_naming_the_value():
    with pytest.raises(ValueError, match=r"gc_every_n_steps=0 must be >= 1, or None"):
        TrainingGarbageCollection(0)
