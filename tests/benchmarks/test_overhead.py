"""benchmarks/overhead.py's hand-written baselines are independent of meshlight's parallelism: the script imports
nothing from ``meshlight.parallel`` or ``meshlight.strategies``. (That they compute what meshlight does is in the
benchmark's own output, ``first_losses``; running it for tp, pipeline and moe takes ~45 s, too long for a test.)"""

import ast

from tests.launch import REPO

SCRIPT = REPO / "benchmarks" / "overhead.py"


def imported_modules(tree: ast.AST) -> set[str]:
    """Every module an ``import`` or ``from … import`` statement anywhere in ``tree`` names, and each name imported
    from one as ``module.name`` (a submodule imported that way)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_overhead_imports_nothing_of_meshlights_parallelism():
    imported = imported_modules(ast.parse(SCRIPT.read_text()))
    assert "meshlight.demos.LitGPT" in imported  # the model it measures: the walk sees the worker's imports
    assert [name for name in imported if name.startswith(("meshlight.parallel", "meshlight.strategies"))] == []


def test_the_import_check_catches_an_import_inside_a_function():
    tree = ast.parse("def worker():\n    from meshlight.parallel.tensor import apply_tensor_parallel\n"
                     "    from meshlight import parallel\n")
    assert {"meshlight.parallel.tensor", "meshlight.parallel"} <= imported_modules(tree)
