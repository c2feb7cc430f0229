"""Processes and mesh for :class:`~meshlight.strategies.MeshStrategy`: this process's ranks, the layout resolved
for the world, the launcher that starts the other ranks, the process group and the device mesh."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from meshlight.parallel.layout import ParallelLayout, build_device_mesh
from meshlight.strategies import lightning_internals as lightning
from meshlight.strategies.launcher import ForkingScriptLauncher
from meshlight.strategies.process_group import connect

__all__ = ["MeshEnvironment"]


class MeshEnvironment(ParallelStrategy):
    """Resolves the layout from ``_sizes`` when the world size is known, starts the processes and builds the mesh."""

    _sizes: dict[str, Any]
    _layout: Optional[ParallelLayout] = None
    _device_mesh: Optional[DeviceMesh] = None
    _process_group_backend: Optional[str] = None
    _timeout: Optional[timedelta] = None

    @property
    def layout(self) -> ParallelLayout:
        if self._layout is None:
            raise RuntimeError("The layout is known once the Trainer knows the world size: create the Trainer first.")
        return self._layout

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists once processes have started (from `setup_environment` on).")
        return self._device_mesh

    def set_world_ranks(self) -> None:
        """Called by the Trainer at construction, before any process is launched: resolves the layout."""
        self._set_ranks()
        self._layout = self._resolve_layout()

    def _set_ranks(self) -> None:
        """This process's ranks, from its cluster environment (again in a rank the launcher forked)."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def _resolve_layout(self) -> Optional[ParallelLayout]:
        """The layout for this world (None while it cannot be known yet: a planner waiting for the model)."""
        return ParallelLayout.for_world(self.world_size, **self._sizes)

    def make_launcher(self) -> Optional[ForkingScriptLauncher]:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return None
        return ForkingScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes, self.root_device,
                                     self._set_ranks)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or lightning.default_backend(self.root_device)
        assert self.cluster_environment is not None
        connect(self.cluster_environment, backend, self._timeout,
                self.root_device if self.root_device.type != "cpu" else None)
        if self._device_mesh is None:  # once: `fit` then `test` reuse the mesh the model was parallelized on
            self._device_mesh = build_device_mesh(self.layout, self.root_device.type)
        assert self.lightning_module is not None
        lightning.set_device_mesh(self.lightning_module, self._device_mesh)
        rank_zero_info(f"meshlight {type(self).__name__}: {self.layout.describe()} on {self.world_size} processes")
