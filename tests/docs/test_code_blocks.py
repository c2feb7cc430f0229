"""Every code block in README.md and docs/ runs on CPU at tiny sizes, or says why it cannot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.code_blocks import PREAMBLE, REPO, Block, all_blocks

BLOCKS = all_blocks()
CODE = [block for block in BLOCKS if block.kind and not block.illustrative]
SNIPPETS = [block for block in CODE if block.kind == "python" and not block.trains]


def _environment() -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}


def _run(command: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=_environment(), capture_output=True, text=True, timeout=timeout)


def test_every_block_is_labelled_and_its_directives_apply():
    problems = []
    for block in BLOCKS:
        if block.language not in ("python", "py", "bash", "sh", "text"):
            problems.append(f"{block.id}: language {block.language!r}; label it python, bash or text")
        elif block.illustrative is not None and not block.illustrative.strip():
            problems.append(f"{block.id}: an illustrative block must say why it cannot run")
        elif block.substitutions:
            try:
                block.runnable()
            except AssertionError as error:
                problems.append(str(error))
    assert not problems, "\n".join(problems)
    assert len(CODE) >= 15, f"only {len(CODE)} blocks run"


@pytest.fixture(scope="module")
def snippet_errors(tmp_path_factory) -> dict[str, str | None]:
    """All non-training Python snippets, run in one process (imports once)."""
    folder = tmp_path_factory.mktemp("snippets")
    listing = folder / "snippets.json"
    listing.write_text(json.dumps([[block.id, block.runnable()] for block in SNIPPETS]))
    result = _run([sys.executable, str(REPO / "tests/docs/run_snippets.py"), str(listing)], folder)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULTS ")]
    assert lines, f"the snippet runner failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return json.loads(lines[-1].removeprefix("RESULTS "))


@pytest.mark.parametrize("block", SNIPPETS, ids=lambda block: block.id)
def test_snippet_runs(block: Block, snippet_errors):
    assert snippet_errors[block.id] is None, f"{block.id} failed:\n{snippet_errors[block.id]}"


@pytest.mark.parametrize("block", [b for b in CODE if b.trains], ids=lambda block: block.id)
def test_training_block_runs_as_a_script(block: Block, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(PREAMBLE + "\n" + block.runnable())
    result = _run([sys.executable, str(script)], tmp_path)
    assert result.returncode == 0, f"{block.id} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


@pytest.mark.parametrize("block", [b for b in CODE if b.kind == "bash"], ids=lambda block: block.id)
def test_command_block_runs(block: Block, tmp_path):
    result = _run(["bash", "-e", "-c", block.runnable()], tmp_path)
    assert result.returncode == 0, f"{block.id} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
