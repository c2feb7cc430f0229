"""How the world's ranks are divided among the parallelisms, and the one device mesh built from that.

A :class:`ParallelLayout` is validated against the world size before any process group exists, so a
bad layout fails in every process at once with one sentence that names the fix, instead of hanging.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "DATA_AXES", "MESH_AXES", "ParallelLayout", "axis", "build_device_mesh", "data_sizes", "hybrid_mesh",
    "same_experts_axis", "seed_by_mesh_position",
]

#: Axes of the device mesh, outermost first: pipeline stages span the slowest links, tensor
#: parallelism the fastest, context parallelism (the sequence split over ranks) next to it. :func:`build_device_mesh`
#: adds flattened axes: ``"dp"`` (replicate × shard: the data-parallel replicas, each reading its own data) and
#: ``"stage"`` (dp × cp × tp: the ranks holding one pipeline stage); with ``cp > 1`` also ``"dp_cp"`` and
#: ``"dp_shard_cp"``, over which gradients are reduced and ZeRO shards (the cp ranks of one replica hold the same
#: weights). With expert parallelism the data axis it borrows from is split in two (see :func:`build_device_mesh`).
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
#: The data-parallel axes among them (replicate, shard).
DATA_AXES = MESH_AXES[1:3]

_SIZE_FIELDS = ("dp_replicate", "dp_shard", "pp", "tp", "ep", "cp")
_ZERO_STAGES = (0, 1, 2, 3)

Size = Union[int, Literal["auto"]]


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of each parallel dimension; their product ``dp_replicate·dp_shard·pp·cp·tp`` is the world size.

    ``zero`` is the ZeRO stage of the data-parallel dimension: 0 replicates everything (DDP), 1 shards
    optimizer state, 2 also gradients, 3 also parameters. Sharding happens over ``dp_shard``;
    ``dp_replicate`` keeps full copies (plain DDP, or the replicate half of hybrid sharding).
    Expert parallelism borrows ranks from data parallelism: ``ep`` divides ``dp_shard`` (``dp_replicate``
    with ``zero=0``, where nothing is sharded). Under tensor parallelism ``experts`` says where MoE layers' experts
    sit (:mod:`meshlight.parallel.expert_tensor`): ``"split"``, each expert over the tp ranks; ``"fold"``, whole
    experts, expert parallelism spanning the tp ranks too (``ep`` = tp × the data ranks it borrows); ``"auto"``
    (resolved here): folded where ``ep`` is a multiple of ``tp`` — each token then crosses the all-to-all once and
    the experts' matmuls stay whole, as Megatron-Core advises —, else split. ``cp`` splits
    each sequence over that many ranks (:mod:`meshlight.parallel.context`); they hold the same weights, so gradients
    are reduced and ZeRO shards over ``dp × cp``.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1
    zero: int = 0
    cp: int = 1
    experts: str = "auto"

    def __post_init__(self) -> None:
        for name in _SIZE_FIELDS:
            _check_size(name, getattr(self, name))
        _check_zero(self.zero)
        if self.zero == 0 and self.dp_shard > 1:
            raise ValueError(
                f"dp_shard={self.dp_shard} shards nothing with zero=0: set zero to 1, 2 or 3, or move those ranks to"
                f" dp_replicate={self.dp_replicate * self.dp_shard}."
            )
        if self.experts not in ("auto", "split", "fold"):
            raise ValueError(f"experts={self.experts!r}: choose 'split' (each expert split over the tp ranks), 'fold'"
                             " (whole experts, expert parallelism spanning the tp ranks) or 'auto'.")
        if self.experts == "auto":
            folds = self.tp > 1 and self.ep > 1 and self.ep % self.tp == 0
            object.__setattr__(self, "experts", "fold" if folds else "split")
        if self.folded:
            self._check_fold()
        borrowed = getattr(self, self.expert_axis)
        if borrowed % self.ep_data:
            folded = f" × tp={self.tp}" if self.folded else ""
            raise ValueError(
                f"ep={self.ep} does not divide {self.expert_axis}={borrowed}{folded}: expert parallelism borrows its"
                f" ranks from data parallelism{' and the tp ranks' if folded else ''}; choose ep in"
                f" {[d * (self.tp if self.folded else 1) for d in _divisors(borrowed)]}."
            )

    def _check_fold(self) -> None:
        valid = self.folded_ep_choices()
        if self.ep % self.tp:
            raise ValueError(
                f"ep={self.ep} cannot fold over tp={self.tp}: experts='fold' spreads the experts over the tp ranks and"
                f" data ranks, so ep must be a multiple of tp; choose ep in {valid}, or experts='split'."
            )

    def folded_ep_choices(self) -> list[int]:
        """The ep sizes that fold over this layout's tp ranks: tp × a divisor of the data ranks ep borrows."""
        return [self.tp * d for d in _divisors(getattr(self, self.expert_axis))]

    @property
    def folded(self) -> bool:
        """Whether expert parallelism spans the tp ranks (``experts="fold"`` under tensor parallelism)."""
        return self.experts == "fold" and self.tp > 1

    @property
    def ep_data(self) -> int:
        """The data ranks expert parallelism borrows: ``ep``, or ``ep / tp`` when folded over the tp ranks."""
        return self.ep // self.tp if self.folded else self.ep

    @property
    def dp(self) -> int:
        """Number of data-parallel replicas of the model (each reads different data)."""
        return self.dp_replicate * self.dp_shard

    @property
    def expert_axis(self) -> str:
        """The data axis expert parallelism borrows its ranks from."""
        return "dp_shard" if self.zero else "dp_replicate"

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @classmethod
    def for_world(
        cls,
        world_size: int,
        *,
        dp_replicate: Size = 1,
        dp_shard: Size = 1,
        pp: int = 1,
        tp: int = 1,
        ep: int = 1,
        zero: int = 0,
        cp: int = 1,
        experts: str = "auto",
    ) -> ParallelLayout:
        """Resolve one ``"auto"`` data-parallel size from ``world_size`` and check the product.

        Raises ``ValueError`` naming the nearest valid layout when the sizes cannot fill the world.
        """
        dp_sizes = {"dp_replicate": dp_replicate, "dp_shard": dp_shard}
        auto = [name for name, value in dp_sizes.items() if value == "auto"]
        if len(auto) > 1:
            raise ValueError("Only one of dp_replicate and dp_shard can be 'auto'.")
        # Check each fixed size first, so that e.g. tp=0 is reported as such and not as a world mismatch.
        for name, value in {**dp_sizes, "pp": pp, "tp": tp, "ep": ep, "cp": cp}.items():
            if value != "auto":
                _check_size(name, value)
        if auto:
            fixed = {name: value for name, value in dp_sizes.items() if value != "auto"}
            used = math.prod(fixed.values()) * pp * tp * cp
            if world_size % used:
                raise ValueError(
                    f"{_product_text(fixed, pp, tp, cp)} does not divide the {world_size} processes of the world."
                    f" {_fix_hint(world_size, pp, tp, cp)}"
                )
            dp_sizes[auto[0]] = world_size // used
        layout = cls(**dp_sizes, pp=pp, tp=tp, ep=ep, zero=zero, cp=cp, experts=experts)
        layout.check_world(world_size)
        return layout

    def check_world(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise ValueError(
                f"{self} uses {self.world_size} processes but the world has {world_size}:"
                f" dp_replicate·dp_shard·pp·cp·tp must equal {world_size}."
                f" {_fix_hint(world_size, self.pp, self.tp, self.cp)}"
            )

    def describe(self) -> str:
        """One line for logs: ``dp=8 (replicate 2 × shard 4, ZeRO-3) · pp=1 · tp=1 · ep=1`` (and ``· cp=4`` when the
        sequence is split)."""
        hybrid = min(self.dp_replicate, self.dp_shard) > 1
        parts = [f"replicate {self.dp_replicate} × shard {self.dp_shard}"] if hybrid else []
        parts.append(f"ZeRO-{self.zero}" if self.zero else "DDP")
        context = f" · cp={self.cp}" if self.cp > 1 else ""
        folded = " (folded over tp)" if self.folded and self.ep > 1 else ""
        return f"dp={self.dp} ({', '.join(parts)}) · pp={self.pp} · tp={self.tp} · ep={self.ep}{folded}{context}"


#: The meshes built in this process, by layout and device type, with the default group they were built in: a later
#: fit under the same layout reuses the mesh and its process groups. Torch frees no group it made, and each gloo group
#: left behind slows every later collective (a tp=2 all-reduce took 3.7 times as long after 100 meshes) and holds its
#: sockets, so a mesh per fit would leak both in a process that fits many times (a sweep, a notebook, a test suite).
_MESHES: dict[tuple[ParallelLayout, str], tuple[Any, DeviceMesh]] = {}


def build_device_mesh(layout: ParallelLayout, device_type: str) -> DeviceMesh:
    """The one mesh every process group comes from: axes ``MESH_AXES`` plus the flattened ``"dp"`` and
    ``"stage"`` (and, with ``cp > 1``, ``"dp_cp"`` and ``"dp_shard_cp"``, and with experts too ``"edp_*_cp"``).

    With ``ep > 1`` the data axis experts borrow from (:attr:`ParallelLayout.expert_axis`) is built as two
    axes, ``edp_shard × ep`` (or ``edp_replicate × ep``), and flattened back under its own name: ``ep``
    groups consecutive ranks, ``edp_*`` the ranks that hold the same experts.

    Must be called by every rank after the default process group is initialized. Built once per layout and device
    type in the default group's life (:data:`_MESHES`).
    """
    layout.check_world(dist.get_world_size())
    built = _MESHES.get((layout, device_type))
    if built is not None and built[0] is dist.group.WORLD:
        return built[1]
    for key in [key for key, (world, _) in _MESHES.items() if world is not dist.group.WORLD]:
        del _MESHES[key]  # built in a default group destroyed since: never reused, and not kept alive here
    mesh = _build_device_mesh(layout, device_type)
    _MESHES[layout, device_type] = (dist.group.WORLD, mesh)
    return mesh


def _build_device_mesh(layout: ParallelLayout, device_type: str) -> DeviceMesh:
    sizes = {name: getattr(layout, name) for name in MESH_AXES}
    # folded over tp, the ep ranks are those of an "ep_data" axis cut from the data axis × the tp axis
    ep_axis = "ep_data" if layout.folded else "ep"
    if layout.ep > 1:
        borrowed, outer = layout.expert_axis, same_experts_axis(layout.expert_axis)
        split = {outer: sizes[borrowed] // layout.ep_data, ep_axis: layout.ep_data}
        sizes = {k: v for name, size in sizes.items()
                 for k, v in (split.items() if name == borrowed else [(name, size)])}
    names = tuple(sizes)  # pp first, then the data axes, cp and tp last
    mesh = init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=names)
    if layout.ep > 1:
        mesh[outer, ep_axis]._flatten(layout.expert_axis)
        if layout.folded:
            mesh[ep_axis, "tp"]._flatten("ep")
    mesh[names[1:-2]]._flatten("dp")
    mesh[names[1:]]._flatten("stage")
    if layout.cp > 1:
        mesh[names[1:-1]]._flatten("dp_cp")
        shard = ("edp_shard", ep_axis) if layout.ep > 1 and layout.expert_axis == "dp_shard" else ("dp_shard",)
        mesh[(*shard, "cp")]._flatten("dp_shard_cp")
        if layout.ep > 1:  # the ranks holding the same experts, with the cp ranks beside them
            outer = same_experts_axis(layout.expert_axis)
            mesh[outer, "cp"]._flatten(outer + "_cp")
    return mesh


def hybrid_mesh(mesh: DeviceMesh, shard: str) -> DeviceMesh:
    """The 2-D ``dp_replicate × shard`` mesh of hybrid sharding (``shard`` may be a flattened axis, whose slicing
    from the root torch announces it will deprecate; no other way to build it exists yet)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)
        return mesh["dp_replicate", shard]


def same_experts_axis(data_axis: str) -> str:
    """The axis of the ranks holding the same experts, cut from ``data_axis`` under expert parallelism."""
    return "e" + data_axis


def data_sizes(dp: Optional[Size], zero: int) -> dict[str, Any]:
    """The data-parallel sizes of a layout with ``dp`` replicas (``None``: ``"auto"``) at ZeRO stage ``zero``: all
    replicated without ZeRO (DDP), all sharded with it — as :class:`ParallelLayout` and
    :meth:`ParallelLayout.for_world` take them."""
    dp = "auto" if dp is None else dp
    return {"dp_replicate": dp, "dp_shard": 1} if zero == 0 else {"dp_replicate": 1, "dp_shard": dp}


def axis(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The 1-D axis ``name`` of a mesh from :func:`build_device_mesh`, including the axes it flattened (``dp``,
    ``stage``, an expert-borrowed data axis): those are the meshes ``_flatten`` kept on the root mesh, since
    slicing a flattened axis from the root is deprecated in PyTorch (older versions keep them elsewhere and slice
    them without a warning)."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    flattened = getattr(root, "_flatten_mapping", {}).get(name)
    return flattened if flattened is not None else mesh[name]


def seed_by_mesh_position(mesh: DeviceMesh, seed: int, *, separate_tensor_ranks: bool) -> None:
    """Seed this rank's RNG so that data-parallel replicas, context-parallel ranks (different tokens of one
    sequence) and pipeline stages draw different random numbers (dropout masks) while the tensor-parallel ranks
    of one replica draw the same ones — required where they hold replicated activations. With sequence parallelism
    those ranks hold different tokens instead, so ``separate_tensor_ranks`` gives them separate streams too."""
    position = axis(mesh, "dp").get_local_rank() * mesh["cp"].size() + mesh["cp"].get_local_rank()
    stream = position * mesh["pp"].size() + mesh["pp"].get_local_rank()
    if separate_tensor_ranks:
        stream = stream * mesh["tp"].size() + mesh["tp"].get_local_rank()
    torch.manual_seed(seed + stream)


def _check_size(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not a valid size: every parallel size must be an integer >= 1.")


def _check_zero(zero: object) -> None:
    if zero not in _ZERO_STAGES or isinstance(zero, bool):
        raise ValueError(
            f"zero={zero!r} is not a ZeRO stage: choose 0 (plain data parallel), 1 (shard optimizer state),"
            " 2 (also gradients) or 3 (also parameters)."
        )


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (pairs up to its square root: planning walks worlds of thousands)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _product_text(sizes: dict[str, int], pp: int, tp: int, cp: int = 1) -> str:
    """``tp=8``, or ``pp=2·tp=4 (= 8)`` for several sizes."""
    named = [(name, value) for name, value in {**sizes, "pp": pp, "cp": cp, "tp": tp}.items() if value != 1]
    if len(named) == 1:
        return f"{named[0][0]}={named[0][1]}"
    return "·".join(f"{n}={v}" for n, v in named) + f" (= {math.prod(v for _, v in named)})" if named else "1"


def _fix_hint(world_size: int, pp: int, tp: int, cp: int = 1) -> str:
    model = pp * tp * cp
    if world_size % model == 0:
        kept = f"pp={pp}, tp={tp}" + (f", cp={cp}" if cp > 1 else "")
        return (
            f"For example keep {kept} and use data-parallel size {world_size // model}"
            " (leave it 'auto' to have it computed)."
        )
    if cp > 1:
        return f"pp·cp·tp={model} must divide {world_size}: lower cp, or run on a multiple of {model} processes."
    valid = [d for d in _divisors(world_size) if d > 1]
    nearest = "; ".join(f"dp={d} pp={p} tp={t}" for d, p, t in nearest_layouts(world_size, pp=pp, tp=tp))
    return f"pp·tp={model} must divide {world_size}; choose pp·tp in {[1, *valid]}. Nearest layouts: {nearest}."


def nearest_layouts(world_size: int, *, dp: Optional[int] = None, pp: int = 1, tp: int = 1,
                    count: int = 3) -> list[tuple[int, int, int]]:
    """The ``count`` (dp, pp, tp) whose product is ``world_size`` closest to the sizes asked for (distance in
    factors of two, summed over the sizes given; ``dp=None``: any), nearest first; ties prefer more data
    parallelism, then more tensor parallelism."""
    asked = {"dp": dp, "pp": pp, "tp": tp}
    layouts = [(world_size // (p * t), p, t) for p in _divisors(world_size) for t in _divisors(world_size // p)]

    def distance(layout: tuple[int, int, int]) -> float:
        return sum(abs(math.log2(size / asked[name])) for name, size in zip(asked, layout) if asked[name])

    return sorted(layouts, key=lambda layout: (distance(layout), -layout[0], -layout[2]))[:count]
