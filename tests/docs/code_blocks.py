"""The fenced code blocks of README.md and docs/, and how the test suite runs them.

A block's language says what it is: ``python`` and ``bash`` blocks are code and run; ``text`` is output or a
listing. HTML comments right above a block's fence (invisible on the rendered page) steer its test:

    <!-- illustrative: why it cannot run here -->        it is not run, for that reason
    <!-- test: devices=8 -> devices=2; max_steps=1000 -> max_steps=3 -->    run at tiny sizes

Python blocks run after the preamble the guides promise (docs/getting-started.md, "The snippets in these
guides"): each block as a script of its own when it trains (calls ``fit``), the others together in one process,
each in a fresh namespace. Bash blocks run in ``bash -e`` from the repository's root, as the guides' commands
are written, with the virtual environment's commands on the PATH and ``$DOCS_TMP`` a fresh folder. YAML blocks
must parse.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LANGUAGES = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "yaml": "yaml", "text": None}

PREAMBLE = '''\
import lightning as L
import torch
from torch import nn
import meshlight as ml
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook as my_torch_comm_hook

model = ml.demos.LitGPT()
data = ml.demos.AdditionDataModule()


class MyBlock(nn.Module):
    pass


class MyAttention(nn.Module):
    pass


class MyGate(nn.Module):
    pass


def train_step():
    pass
'''

_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")
_COMMENT = re.compile(r"^\s*<!--\s*(?P<kind>illustrative|test):\s*(?P<text>.*?)\s*-->\s*$")
_TRAINS = re.compile(r"\.(fit|validate|test|predict)\(")


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str  # as written after the fence
    code: str  # dedented to the fence
    illustrative: str | None = None  # the reason
    substitutions: list[tuple[str, str]] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def kind(self) -> str | None:
        """'python', 'bash', 'yaml' or None (not code); KeyError for a language the test does not know."""
        return LANGUAGES[self.language]

    @property
    def trains(self) -> bool:
        return self.kind == "python" and bool(_TRAINS.search(self.code))

    def runnable(self) -> str:
        """The code with the test's substitutions made; each must apply."""
        code = self.code
        for old, new in self.substitutions:
            if old not in code:
                raise AssertionError(f"{self.id}: the test substitution {old!r} -> {new!r} matches nothing")
            code = code.replace(old, new)
        return code


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent = len(fence.group("indent"))
        end = i + 1
        while not re.match(r"^\s*```\s*$", lines[end]):
            end += 1
        block = Block(path, i + 1, fence.group("lang"), "\n".join(line[indent:] for line in lines[i + 1:end]) + "\n")
        above = i - 1
        while above >= 0 and (match := _COMMENT.match(lines[above])):
            if match.group("kind") == "illustrative":
                block.illustrative = match.group("text")
            else:
                for pair in match.group("text").split(";"):
                    old, new = (part.strip() for part in pair.split("->"))
                    block.substitutions.append((old, new))
            above -= 1
        found.append(block)
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for path in documents() for block in blocks(path)]
