"""The byte-counting conventions of CollectiveTraffic (the collectives themselves are counted in
tests/strategies and benchmarks/comm.py, on real process groups)."""

import pytest

from meshlight.parallel import bytes_sent_per_rank


@pytest.mark.parametrize(
    ("kind", "expected"),
    [("all_reduce", 2 * 300 * 3 / 4), ("all_gather", 300 * 3 / 4), ("reduce_scatter", 300 * 3 / 4),
     ("broadcast", 300 * 3 / 4), ("all_to_all", 300), ("send", 300)],
)
def test_bandwidth_optimal_cost_per_collective(kind, expected):
    assert bytes_sent_per_rank(kind, 300, 4) == expected


def test_a_group_of_one_sends_nothing():
    assert bytes_sent_per_rank("all_reduce", 10**6, 1) == 0


def test_unknown_collective_is_rejected():
    with pytest.raises(ValueError, match="Unknown collective kind"):
        bytes_sent_per_rank("gossip", 1, 2)
