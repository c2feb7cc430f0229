"""Every figure in ``benchmarks/RESULTS.md`` is printed by the command beside it: the prose ``run_all.py`` writes
around each table holds no measured figure of its own (only targets, published figures and the setup's sizes,
listed here with what they are), and a verdict says "inconclusive" where the rounds straddle its target."""

import ast
import re

from tests.launch import REPO, benchmark_modules

(run_all,) = benchmark_modules("run_all")

#: numbers run_all.py's own text may hold, none of them measured by a benchmark here: (figures, what they are)
_ALLOWED = [
    (("1.05", "1.02"), "targets: meshlight ÷ PyTorch step and bytes; the 1B GPT's size in billions"),
    (("1.2",), "target: expert load max/mean"),
    (("0.75", "1.25", "25%"), "target: planner within 25% of a published run"),
    (("0.50", "1.40"), "targets: activation checkpointing's bytes and time"),
    (("0.52×", "0.1×", "0.55×", "90%"), "targets: compression's bytes and accuracy"),
    (("0.8×", "10%", "0.05", "0.35", "50%", "1.03 ×", "1.05 ×"), "targets of other sections"),
    (("1.0",), "perfect balance, the scale's definition"),
    (("0.8",), "Megatron-Core's release r0.8.0, a source"),
    (("96 GB", "100s", "1.445", "1.445×", "62%"), "published: the sources' hardware, Float8 speedup and MFU"),
    (("24.12",), "NeMo 24.12, the version of a published source"),
    (("1.07 GB", "32 MB"), "the setup: the NVMe benchmark's moments, glibc's mmap threshold"),
    (("4 ×", "2 ×", "16 ×", "4 ms"), "the setup: batch shapes, layouts, simulated compute"),
    (("3.1", "8 ×"), "published: the name Llama 3.1, torchtitan's TP 8 × PP 8 layout"),
]
NOT_MEASURED = {figure: why for figures, why in _ALLOWED for figure in figures}
_FIGURE = re.compile(r"\d[\d,]*\.\d+\s*(?:×|%|s\b|ms\b|GB\b|MB\b)?|\d+\s*(?:×|%|ms\b|GB\b|MB\b)|\d+s\b")


def _prose(tree: ast.AST) -> list[tuple[int, str]]:
    """The literal text of run_all.py: string constants, and the literal parts of f-strings."""
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def test_run_alls_prose_holds_no_measured_figure():
    tree = ast.parse((REPO / "benchmarks" / "run_all.py").read_text())
    found = [(line, figure.strip()) for line, text in _prose(tree) for figure in _FIGURE.findall(text)]
    # formatting specs (".1f", ".0%") and the one-decimal rounding of f-strings' format parts are not figures
    found = [(line, figure) for line, figure in found if figure not in {"1%", "0%"}]
    unknown = [(line, figure) for line, figure in found if figure not in NOT_MEASURED]
    assert not unknown, f"figures in run_all.py's prose that no command prints (line, figure): {unknown}"


def test_a_recompute_verdict_is_inconclusive_where_the_rounds_straddle_the_target():
    def section(time_range, activation_ratio=0.3):
        rows = [{"recompute": "none", "activation_bytes": 10, "activation_ratio": 1.0, "step_seconds": 1.0,
                 "time_ratio": 1.0, "time_ratio_range": [1.0, 1.0]},
                {"recompute": "every block", "activation_bytes": 3, "activation_ratio": activation_ratio,
                 "step_seconds": 1.2, "time_ratio": sum(time_range) / 2, "time_ratio_range": time_range}]
        text = run_all.recompute_section({"model": "GPT", "seq": 8, "batch": 1, "threads": 1, "steps": 3,
                                          "rows": rows})
        return next(line for line in text.splitlines() if line.startswith("| every block")).split("|")[-2].strip()

    assert section([1.1, 1.3]) == "met"
    assert section([1.1, 1.5]) == "inconclusive"
    assert section([1.45, 1.5]) == "**not met**"
    assert section([1.1, 1.3], activation_ratio=0.6) == "**not met**"
