"""DESIGN's layer order, enforced on every module of the package (function-level imports included): ``parallel/``,
``nn/`` and ``models/`` import no Lightning and nothing above them; ``strategies/`` imports neither callbacks nor the
trainer; and Lightning's private names are spelled only in ``strategies/lightning_internals.py``."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "meshlight"
DOOR = "meshlight/strategies/lightning_internals.py"
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities")

#: package -> the packages it must not import
FORBIDDEN = {
    "meshlight.parallel": ("meshlight.strategies", "meshlight.callbacks", "meshlight.trainer", *LIGHTNING),
    "meshlight.nn": ("meshlight.strategies", "meshlight.callbacks", "meshlight.trainer", *LIGHTNING),
    "meshlight.models": ("meshlight.strategies", "meshlight.callbacks", "meshlight.trainer", *LIGHTNING),
    "meshlight.strategies": ("meshlight.callbacks", "meshlight.trainer"),
}

#: Lightning modules that are internals as a whole, whatever the names taken from them
INTERNAL_MODULES = ("lightning.pytorch.trainer.connectors", "lightning.pytorch.loops",
                    "pytorch_lightning.trainer.connectors", "pytorch_lightning.loops")

#: private members of Lightning's objects (Trainer and its connectors, loops, Strategy, LightningModule, Callback,
#: launchers, the signal connector) that meshlight has used: reached, overridden or named in a getattr, only in the door
LIGHTNING_PRIVATE = frozenset({
    # Trainer and its connectors
    "_signal_connector", "_checkpoint_connector", "_logger_connector", "_accelerator_connector",
    "_callback_connector", "_data_connector", "_results", "hpc_save_path", "dump_checkpoint",
    # loops
    "_data_source", "_broadcast_sigterm_tensor", "_should_accumulate", "_num_ready_batches_reached",
    "_accumulated_batches_reached",
    # LightningModule
    "_trainer",
    # Strategy
    "_launcher", "_configure_launcher", "_reset_optimizers_and_schedulers", "_setup_model", "_setup_optimizer",
    "_setup_model_and_optimizers", "_forward_redirection", "_lightning_module", "_lightning_optimizers",
    "_precision_plugin", "_checkpoint_io", "_layer_sync", "_parallel_devices", "_determine_device_ids",
    # Callback
    "_generate_state_key",
    # signal connector and launchers
    "_sigterm_notifier_fn", "_slurm_sigusr_handler_fn", "_sigterm_handler_fn", "_call_children_scripts",
    "_check_can_spawn_children",
})
#: Lightning's private names that meshlight's own classes also use for attributes of their own: flagged on
#: other objects only (``module._device_mesh``), not on ``self``
LIGHTNING_PRIVATE_NOT_ON_SELF = frozenset({"_device_mesh", "_model", "_optimizers"})


@dataclass(frozen=True)
class Module:
    name: str  # meshlight.parallel.offload
    path: str  # meshlight/parallel/offload.py
    tree: ast.Module


def _modules() -> list[Module]:
    out = []
    for file in sorted(PACKAGE.rglob("*.py")):
        relative = file.relative_to(PACKAGE.parent)
        parts = list(relative.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append(Module(".".join(parts), relative.as_posix(), ast.parse(file.read_text(), str(relative))))
    return out


MODULES = _modules()


def _imports(module: Module) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, imported module, names taken from it) for every import statement, relative ones resolved."""
    found = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.name.split(".")
                if not module.path.endswith("__init__.py"):
                    package.pop()
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            names = tuple(alias.name for alias in node.names)
            found.append((node.lineno, base, names))
            # ``from meshlight import callbacks`` imports the package meshlight.callbacks
            found += [(node.lineno, f"{base}.{name}", ()) for name in names]
    return found


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def test_the_layer_walk_finds_every_layer():
    names = {m.name for m in MODULES}
    assert {"meshlight.parallel.offload", "meshlight.nn.moe", "meshlight.models.gpt", "meshlight.strategies.mesh",
            "meshlight.callbacks.checkpoint", "meshlight.trainer.trainer"} <= names
    assert any(m.path == DOOR for m in MODULES)


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_each_layer_imports_only_layers_below_it(layer):
    wrong = [f"{m.path}:{line} imports {name}"
             for m in MODULES if _within(m.name, (layer,))
             for line, name, _ in _imports(m) if _within(name, FORBIDDEN[layer])]
    assert not wrong, "\n".join(wrong)


def test_private_lightning_names_are_imported_only_through_the_door():
    wrong = []
    for m in MODULES:
        if m.path == DOOR:
            continue
        for line, name, names in _imports(m):
            if not _within(name, LIGHTNING):
                continue
            private = [n for n in names if n.startswith("_")]
            if private or any(part.startswith("_") for part in name.split(".")) or _within(name, INTERNAL_MODULES):
                wrong.append(f"{m.path}:{line} imports {', '.join(private) or name} from {name}")
    assert not wrong, "\n".join(wrong)


def _private_uses(module: Module) -> list[str]:
    """Lightning's private names this module reaches (``x._name``), overrides (``def _name``) or names as a string
    (``getattr(x, "_name")``)."""
    found = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Attribute):
            on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if node.attr in LIGHTNING_PRIVATE or (node.attr in LIGHTNING_PRIVATE_NOT_ON_SELF and not on_self):
                found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in LIGHTNING_PRIVATE:
            found.append((node.lineno, f"def {node.name}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "hasattr", "setattr", "delattr"):
            names = [a.value for a in node.args[1:2] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            found += [(node.lineno, f"{node.func.id}(…, {n!r})") for n in names
                      if n in LIGHTNING_PRIVATE | LIGHTNING_PRIVATE_NOT_ON_SELF]
    return [f"{module.path}:{line} {use}" for line, use in sorted(found)]


def test_private_lightning_members_are_reached_only_through_the_door():
    wrong = [use for m in MODULES if m.path != DOOR for use in _private_uses(m)]
    assert not wrong, "\n".join(wrong)


def test_the_checks_catch_what_they_are_for():
    """The scanner itself: a parallel/ module importing Lightning, a private import and private reaches are seen."""
    source = '''
import lightning.pytorch as pl
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.pytorch.trainer.connectors.signal_connector import log
def f(trainer, module):
    from meshlight.strategies import mesh
    trainer._checkpoint_connector.dump_checkpoint()
    getattr(module, "_trainer", None)
    module._device_mesh = None
    self._device_mesh = None
class Launcher:
    def _call_children_scripts(self): ...
'''
    module = Module("meshlight.parallel.example", "meshlight/parallel/example.py", ast.parse(source))
    imported = {name for _, name, _ in _imports(module)}
    assert {"lightning.pytorch", "meshlight.strategies", "meshlight.strategies.mesh"} <= imported
    assert [line for line, name, names in _imports(module) if "_init_dist_connection" in names] == [3]
    uses = _private_uses(module)
    assert [use.split(" ", 1)[1] for use in uses] == [
        "._checkpoint_connector", ".dump_checkpoint", "getattr(…, '_trainer')", "._device_mesh",
        "def _call_children_scripts"], uses
