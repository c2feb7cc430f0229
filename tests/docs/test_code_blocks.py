"""Every code block in README.md and docs/ runs on CPU at tiny sizes, or says why it cannot; and a newcomer's path,
from the README's first link to a tensor-parallel fine-tune of a Hugging Face model, runs page by page in order."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.docs.code_blocks import LANGUAGES, PREAMBLE, REPO, Block, all_blocks


def newcomer_path() -> list[Path]:
    """The README's first link (Getting started), then that page's link to the Hugging Face guide."""
    first = re.search(r"\]\(([^)#]+)\)", (REPO / "README.md").read_text())[1]
    start = (REPO / first).resolve()
    link = re.search(r"\]\(([^)#]*hf-and-litgpt\.md)\)", start.read_text())
    assert link, f"{first} does not link to the Hugging Face guide"
    return [start, (start.parent / link[1]).resolve()]


PATH = newcomer_path()
BLOCKS = all_blocks()
CODE = [block for block in BLOCKS if block.kind and not block.illustrative]
ELSEWHERE = [block for block in CODE if block.path not in PATH]  # the path's blocks run in test_newcomer_path
SNIPPETS = [block for block in ELSEWHERE if block.kind == "python" and not block.trains]


def _environment(**extra: str) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), **extra}


def _run(command: list[str], cwd: Path, timeout: float = 600, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=_environment(**extra), capture_output=True, text=True,
                          timeout=timeout)


def test_every_block_is_labelled_and_its_directives_apply():
    problems = []
    for block in BLOCKS:
        if block.language not in LANGUAGES:
            problems.append(f"{block.id}: language {block.language!r}; label it one of {sorted(LANGUAGES)}")
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


@pytest.mark.parametrize("block", [b for b in ELSEWHERE if b.trains], ids=lambda block: block.id)
def test_training_block_runs_as_a_script(block: Block, tmp_path):
    _run_block(block, tmp_path)


def _run_block(block: Block, tmp_path: Path) -> None:
    """A Python block as a script of its own (after the preamble), a bash block from the repository's root."""
    if block.kind == "python":
        script = tmp_path / "block.py"
        script.write_text(PREAMBLE + "\n" + block.runnable())
        result = _run([sys.executable, str(script)], tmp_path)
    else:
        result = _run(["bash", "-e", "-c", block.runnable()], REPO, DOCS_TMP=str(tmp_path))
    assert result.returncode == 0, f"{block.id} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    for claimed in re.findall(r"#\s*best:\s*(.+?)\s*$", block.code, re.MULTILINE):  # the winner the page promises
        winner = re.search(rf"^{re.escape(claimed)} (wins\b|is the only layout)", result.stdout, re.MULTILINE)
        assert winner, f"{block.id}: its comment says {claimed!r} wins; the command printed:\n{result.stdout[-2000:]}"


def test_newcomer_path_to_a_tensor_parallel_hf_fine_tune(tmp_path):
    """README → Getting started → the Hugging Face guide: every command on those pages, in order, ending in a
    tensor-parallel fine-tune of a Hugging Face model."""
    assert [page.name for page in PATH] == ["getting-started.md", "hf-and-litgpt.md"]
    steps = [block for block in CODE if block.path in PATH and block.kind in ("python", "bash")]
    steps.sort(key=lambda block: (PATH.index(block.path), block.line))
    hf_steps = [block for block in steps if block.path == PATH[1]]
    assert any("transformers" in block.code and '"tp"' in block.code for block in hf_steps)
    assert any("finetune_hf.py --strategy tp" in block.code for block in hf_steps)
    for i, block in enumerate(steps):
        folder = tmp_path / str(i)
        folder.mkdir()
        _run_block(block, folder)


@pytest.mark.parametrize("block", [b for b in ELSEWHERE if b.kind == "bash"], ids=lambda block: block.id)
def test_command_block_runs(block: Block, tmp_path):
    _run_block(block, tmp_path)


@pytest.mark.parametrize("block", [b for b in ELSEWHERE if b.kind == "yaml"], ids=lambda block: block.id)
def test_yaml_block_parses(block: Block):
    assert isinstance(yaml.safe_load(block.runnable()), dict)
