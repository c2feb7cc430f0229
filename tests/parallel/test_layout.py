"""ParallelLayout: sizes are validated, one 'auto' size fills the world, and every rejection names the fix."""

import pytest

from meshlight.parallel import ParallelLayout
from meshlight.parallel.layout import MESH_AXES, data_sizes, nearest_layouts


def test_auto_fills_the_data_parallel_size_from_the_world():
    layout = ParallelLayout.for_world(8, dp_shard="auto", pp=2, tp=2, zero=3)
    assert (layout.dp_replicate, layout.dp_shard, layout.pp, layout.tp) == (1, 2, 2, 2)
    assert layout.dp == 2 and layout.world_size == 8


def test_hybrid_sharding_splits_data_parallel_ranks():
    layout = ParallelLayout.for_world(8, dp_replicate=2, dp_shard="auto", zero=2)
    assert (layout.dp_replicate, layout.dp_shard, layout.dp) == (2, 4, 8)
    assert layout.describe() == "dp=8 (replicate 2 × shard 4, ZeRO-2) · pp=1 · tp=1 · ep=1"
    assert ParallelLayout(dp_replicate=2).describe() == "dp=2 (DDP) · pp=1 · tp=1 · ep=1"


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"dp_replicate": 2, "tp": 3}, "uses 6 processes but the world has 8"),
        ({"dp_replicate": "auto", "tp": 3}, "tp=3 does not divide the 8 processes of the world"),
        ({"dp_shard": "auto", "pp": 3, "tp": 2, "zero": 3}, r"pp=3·tp=2 \(= 6\) does not divide the 8 processes"),
        ({"dp_replicate": "auto", "zero": 4}, "zero=4 is not a ZeRO stage"),
        ({"dp_replicate": "auto", "tp": 0}, "tp=0 is not a valid size"),
        ({"dp_replicate": "auto", "pp": -1}, "pp=-1 is not a valid size"),
        ({"dp_replicate": 1, "dp_shard": 8, "zero": 0}, "dp_shard=8 shards nothing with zero=0"),
        ({"dp_replicate": "auto", "ep": 3}, "ep=3 does not divide dp_replicate=8"),
        ({"dp_replicate": 2, "dp_shard": "auto", "ep": 8, "zero": 1}, r"ep=8 does not divide dp_shard=4.*\[1, 2, 4\]"),
        ({"dp_replicate": "auto", "dp_shard": "auto", "zero": 1}, "Only one of dp_replicate and dp_shard"),
    ],
)
def test_invalid_layouts_fail_with_one_sentence_naming_the_fix(sizes, message):
    with pytest.raises(ValueError, match=message):
        ParallelLayout.for_world(8, **sizes)


def test_experts_borrow_from_the_sharded_axis_or_from_replicas_without_zero():
    zero = ParallelLayout.for_world(8, dp_replicate=2, dp_shard="auto", ep=4, zero=3)
    assert zero.expert_axis == "dp_shard" and zero.describe().endswith("ep=4")
    ddp = ParallelLayout.for_world(8, dp_replicate="auto", ep=8, zero=0)
    assert ddp.expert_axis == "dp_replicate"


def test_world_mismatch_suggests_a_layout_that_fits():
    with pytest.raises(ValueError, match="use data-parallel size 4"):
        ParallelLayout.for_world(8, dp_replicate=3, tp=2)
    with pytest.raises(ValueError, match=r"choose pp·tp in \[1, 2, 4, 8\]. Nearest layouts: dp=2 pp=1 tp=4; "):
        ParallelLayout.for_world(8, dp_replicate=1, tp=3)


def test_nearest_layouts_fill_the_world_closest_to_the_sizes_asked_for():
    assert nearest_layouts(6, dp=2, pp=2, tp=2) == [(3, 1, 2), (3, 2, 1), (2, 1, 3)]  # ties: more dp, then tp
    assert nearest_layouts(8, pp=2, tp=3)[0] == (1, 2, 4)
    assert all(d * p * t == 12 for d, p, t in nearest_layouts(12, dp=5, count=20))


def test_layout_is_frozen():
    layout = ParallelLayout(dp_replicate=2)
    with pytest.raises(AttributeError):
        layout.tp = 2


@pytest.mark.parametrize(
    ("sizes", "names", "dp", "stage"),
    [
        (dict(dp_replicate=2, dp_shard=2, pp=2, tp=2, zero=1), MESH_AXES, [0, 2, 4, 6], list(range(8))),
        # experts borrow from replicas without ZeRO, from shards with it: that axis is built as e<axis> × ep
        (dict(dp_replicate=4, pp=2, tp=2, ep=2, experts="split"), ("pp", "edp_replicate", "ep", "dp_shard", "cp",
                                                                     "tp"), [0, 2, 4, 6], list(range(8))),
        (dict(dp_replicate=2, dp_shard=4, tp=2, ep=4, zero=3, experts="split"),
         ("pp", "dp_replicate", "edp_shard", "ep", "cp", "tp"), list(range(0, 16, 2)), list(range(16))),
        # experts folded over tp: the data axis gives ep / tp ranks (ep_data), and ep is ep_data × tp
        (dict(dp_replicate=2, dp_shard=4, tp=2, ep=4, zero=3), ("pp", "dp_replicate", "edp_shard", "ep_data", "cp",
                                                                "tp"), list(range(0, 16, 2)), list(range(16))),
        # context parallelism: cp between the data axes and tp; a replica's ranks read the same data
        (dict(dp_replicate=2, pp=2, cp=2, tp=2), MESH_AXES, [0, 4], list(range(8))),
        (dict(dp_shard=4, cp=2, tp=2, ep=2, zero=1, experts="split"), ("pp", "dp_replicate", "edp_shard", "ep", "cp",
                                                                        "tp"),
         [0, 4, 8, 12], list(range(16))),
    ],
)
def test_the_mesh_has_the_layouts_axes_pp_outermost_and_tp_innermost(sizes, names, dp, stage):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshlight.parallel.layout import axis, build_device_mesh

    dist.init_process_group("fake", rank=0, world_size=16, store=FakeStore())
    mesh = build_device_mesh(ParallelLayout(**sizes), "cpu")
    assert mesh.mesh_dim_names == names
    assert axis(mesh, "dp").mesh.tolist() == dp and axis(mesh, "stage").mesh.tolist() == stage
    assert axis(mesh, "tp").mesh.tolist() == [0, 1]


@pytest.mark.parametrize(("sizes", "ep", "same_experts", "describe"), [
    # auto: folded where ep is a multiple of tp — ep spans the tp ranks, then the data ranks
    (dict(dp_shard=4, tp=2, ep=4, zero=1), [0, 1, 2, 3], [0, 4], "ep=4 (folded over tp)"),
    (dict(dp_shard=4, tp=2, ep=2, zero=1), [0, 1], [0, 2, 4, 6], "ep=2 (folded over tp)"),
    # split: ep over the data ranks, each expert over tp
    (dict(dp_shard=4, tp=2, ep=2, zero=1, experts="split"), [0, 2], [0, 4], "ep=2"),
    (dict(dp_shard=4, tp=4, ep=2, zero=1), [0, 4], [0, 8], "ep=2"),  # ep not a multiple of tp: split
])
def test_experts_fold_over_tp_where_ep_is_a_multiple_of_it_unless_split_is_asked(sizes, ep, same_experts, describe):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshlight.parallel.expert import expert_data_mesh
    from meshlight.parallel.layout import axis, build_device_mesh

    dist.init_process_group("fake", rank=0, world_size=16 if sizes["tp"] == 4 else 8, store=FakeStore())
    layout = ParallelLayout(**sizes)
    mesh = build_device_mesh(layout, "cpu")
    assert axis(mesh, "ep").mesh.tolist() == ep
    assert expert_data_mesh(mesh, 1).mesh.tolist() == same_experts
    assert layout.describe().endswith(describe)


def test_a_layout_built_again_in_the_same_default_group_reuses_its_mesh():
    """Torch frees no process group it makes, and each gloo group left behind slows every later collective: a second
    fit under the same layout gets the first's mesh (its groups); another layout, or a new default group, its own —
    and the meshes of a destroyed default group are let go."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshlight.parallel.layout import _MESHES, build_device_mesh

    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    mesh = build_device_mesh(ParallelLayout(dp_replicate=2, pp=2, tp=2), "cpu")
    assert build_device_mesh(ParallelLayout(dp_replicate=2, pp=2, tp=2), "cpu") is mesh
    assert build_device_mesh(ParallelLayout(dp_shard=2, pp=2, tp=2, zero=3), "cpu") is not mesh
    dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    assert build_device_mesh(ParallelLayout(dp_replicate=2, pp=2, tp=2), "cpu") is not mesh
    assert [world for world, _ in _MESHES.values()] == [dist.group.WORLD]


def test_context_parallel_ranks_join_the_data_parallel_reductions():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshlight.parallel.data_parallel import data_parallel_mesh
    from meshlight.parallel.layout import axis, build_device_mesh

    dist.init_process_group("fake", rank=0, world_size=16, store=FakeStore())
    mesh = build_device_mesh(ParallelLayout(dp_replicate=2, dp_shard=2, cp=2, tp=2, zero=3), "cpu")
    assert axis(mesh, "cp").mesh.tolist() == [0, 2]
    assert axis(mesh, "dp").mesh.tolist() == [0, 4, 8, 12]  # the replicas, each reading its own data
    assert axis(mesh, "dp_cp").mesh.tolist() == [0, 2, 4, 6, 8, 10, 12, 14]
    hybrid = data_parallel_mesh(mesh, 3)  # replicate 2 × shard (dp_shard · cp = 4)
    assert hybrid.mesh_dim_names == ("dp_replicate", "dp_shard_cp") and hybrid.mesh.tolist() == [[0, 2, 4, 6],
                                                                                                    [8, 10, 12, 14]]


@pytest.mark.parametrize(("zero", "sizes", "experts"), [
    # ZeRO: ep borrows from the shards; the same experts sit on the other shard groups' ranks and on the cp ranks
    (1, dict(dp_shard=4), [0, 2, 8, 10]),
    # DDP: ep borrows from the replicas
    (0, dict(dp_replicate=4), [0, 2, 8, 10]),
])
def test_under_context_parallelism_experts_are_data_parallel_over_their_cp_ranks_too(zero, sizes, experts):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshlight.parallel.expert import expert_data_mesh
    from meshlight.parallel.layout import axis, build_device_mesh

    dist.init_process_group("fake", rank=0, world_size=16, store=FakeStore())
    mesh = build_device_mesh(ParallelLayout(**sizes, cp=2, tp=2, ep=2, zero=zero, experts="split"), "cpu")
    assert axis(mesh, "ep").mesh.tolist() == [0, 4]
    assert expert_data_mesh(mesh, zero).mesh.tolist() == experts
    assert axis(mesh, "dp_cp").mesh.tolist() == [0, 2, 4, 6, 8, 10, 12, 14]


@pytest.mark.parametrize(("zero", "sizes"), [(1, dict(dp_shard=4)), (3, dict(dp_shard=4)), (0, dict(dp_replicate=4))])
def test_under_context_parallelism_experts_fold_over_tp_and_the_cp_ranks_hold_the_same_ones(zero, sizes):
    # ep=4 folds over tp=2 by default under cp too: 2 data ranks × the 2 tp ranks, the cp ranks beside them
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshlight.parallel.data_parallel import data_parallel_mesh
    from meshlight.parallel.expert import expert_data_mesh
    from meshlight.parallel.layout import axis, build_device_mesh

    dist.init_process_group("fake", rank=0, world_size=16, store=FakeStore())
    layout = ParallelLayout(**sizes, cp=2, tp=2, ep=4, zero=zero)
    mesh = build_device_mesh(layout, "cpu")  # with ZeRO the shards with the cp ranks flattened across ep_data
    assert layout.describe().endswith("ep=4 (folded over tp) · cp=2")
    assert axis(mesh, "ep").mesh.tolist() == [0, 1, 4, 5]
    assert expert_data_mesh(mesh, zero).mesh.tolist() == [0, 2, 8, 10]
    assert axis(mesh, "dp_cp").mesh.tolist() == [0, 2, 4, 6, 8, 10, 12, 14]
    if zero:
        assert data_parallel_mesh(mesh, zero).mesh.tolist() == [0, 2, 4, 6, 8, 10, 12, 14]


def test_context_parallel_sizes_count_in_the_world_and_are_described():
    layout = ParallelLayout.for_world(8, dp_shard="auto", cp=4, zero=3)
    assert (layout.dp, layout.cp, layout.world_size) == (2, 4, 8)
    assert layout.describe() == "dp=2 (ZeRO-3) · pp=1 · tp=1 · ep=1 · cp=4"
    with pytest.raises(ValueError, match=r"cp=3 does not divide the 8 processes.*lower cp, or run on a multiple of 3"):
        ParallelLayout.for_world(8, dp_replicate="auto", cp=3)


def test_data_sizes_replicate_without_zero_and_shard_with_it():
    assert data_sizes(4, 0) == {"dp_replicate": 4, "dp_shard": 1}
    assert data_sizes(None, 3) == {"dp_replicate": 1, "dp_shard": "auto"}
    layout = ParallelLayout.for_world(8, **data_sizes("auto", 2), tp=2, zero=2)
    assert (layout.dp_replicate, layout.dp_shard) == (1, 4)
