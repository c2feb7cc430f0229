"""Step time of meshlight at two commits, side by side: does a change slow any strategy down?

Each commit is checked out in a worktree of its own (``git worktree add``), with this checkout's
``benchmarks/overhead.py`` and ``benchmarks/common.py`` copied in so both run the same measurement. Per strategy,
``--rounds`` times: one launch of ``overhead.py --variants meshlight --rotations 1`` at each commit, back to back, the
order alternating between rounds, so a round's two medians are paired in time and the machine's drift cancels.
Reported per strategy: the median over rounds of new ÷ old, its quartiles and its lowest and highest round (the
noise), and a verdict: "inconclusive" where the quartiles lie further apart than ``--margin`` (the noise hides a
difference that small), else "within" when the median is at most ``1 + margin``, else "slower".

    python benchmarks/paired_commits.py OLD NEW [--rounds 10] [--strategies ddp zero3 tp pipeline moe loop]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import REPO

STRATEGIES = ("ddp", "zero3", "tp", "pipeline", "moe", "loop")


def worktree(commit: str, root: Path) -> Path:
    path = root / commit
    subprocess.run(["git", "worktree", "add", "--detach", str(path), commit], cwd=REPO, check=True,
                   capture_output=True)
    for name in ("overhead.py", "common.py"):
        shutil.copy(REPO / "benchmarks" / name, path / "benchmarks" / name)
    return path


def step_seconds(tree: Path, strategy: str, steps: int) -> float:
    """One launch of ``overhead.py`` in ``tree``: the meshlight variant's median step time for ``strategy``."""
    command = [sys.executable, str(tree / "benchmarks" / "overhead.py"), "--strategies", strategy, "--rotations", "1",
               "--steps", str(steps), "--variants", "meshlight"]
    result = subprocess.run(command, cwd=tree, capture_output=True, text=True, check=True, timeout=900)
    return json.loads(result.stdout)[0]["median_step_seconds"]["meshlight"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--margin", type=float, default=0.02)
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="paired-commits-"))
    trees = {"old": worktree(args.old, root), "new": worktree(args.new, root)}
    rows = []
    try:
        for strategy in args.strategies:
            ratios = []
            for round_index in range(args.rounds):
                order = ("old", "new") if round_index % 2 == 0 else ("new", "old")
                seconds = {which: step_seconds(trees[which], strategy, args.steps) for which in order}
                ratios.append(seconds["new"] / seconds["old"])
            median, (lower, _, upper) = statistics.median(ratios), statistics.quantiles(ratios, n=4)
            verdict = ("inconclusive" if upper - lower > args.margin else
                       "within" if median <= 1 + args.margin else "slower")
            rows.append({"strategy": strategy, "new_over_old": median, "quartiles": [lower, upper],
                         "lowest": min(ratios), "highest": max(ratios), "verdict": verdict, "round_ratios": ratios})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        for tree in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"old": args.old, "new": args.new, "rounds": args.rounds, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
