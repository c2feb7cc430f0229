"""Write docs/guides/errors.md: every error meshlight raises, read from the source, by exception class and site.

    python docs/gen_errors.py          # rewrite the catalogue after changing a raise
    python docs/gen_errors.py --check  # exit 1 if the committed catalogue is out of date (tests/docs does this)

Each entry is the raise's message as written, with the values filled in at run time shown as ``{expression}``;
a message built elsewhere shows the expression that builds it. Control flow (private exception classes, a bare
``raise``, an abstract method's ``NotImplementedError``) is left out: a user never sees it.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "meshlight"
CATALOGUE = ROOT / "docs" / "guides" / "errors.md"


class RaiseSite(NamedTuple):
    exception: str  # the class raised, as the source names it
    module: str  # meshlight.parallel.pipeline
    function: str  # qualified name of the enclosing function or class, "" at module level
    message: str


def _message(node: ast.expr | None) -> str:
    """The message text of a raise's first argument, runtime values shown as {expression}."""
    if node is None:
        return ""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            else:
                parts.append("{" + ast.unparse(value.value) + "}")
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _message(node.left) + _message(node.right)
    return "{" + ast.unparse(node) + "}"


def _raised(node: ast.Raise) -> tuple[str, str] | None:
    exc = node.exc
    if isinstance(exc, ast.BoolOp):  # `raise refused or CheckpointError(...)`: the fallback is what is documented
        exc = exc.values[-1]
    if isinstance(exc, ast.Call):
        name = ast.unparse(exc.func)
        return name, _message(exc.args[0] if exc.args else None)
    if isinstance(exc, ast.Name) and exc.id[:1].isupper():
        return exc.id, ""
    return None  # a bare raise, or re-raising a caught exception


def _sites(path: Path) -> Iterator[RaiseSite]:
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    module = module.removesuffix(".__init__")

    def visit(node: ast.AST, scope: list[str]) -> Iterator[RaiseSite]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield from visit(child, scope + [child.name])
            elif isinstance(child, ast.Raise):
                raised = _raised(child)
                if raised is None:
                    continue
                name, message = raised
                if name.split(".")[-1].startswith("_") or (name == "NotImplementedError" and not message):
                    continue
                yield RaiseSite(name, module, ".".join(scope), message)
            else:
                yield from visit(child, scope)

    yield from visit(ast.parse(path.read_text(), str(path)), [])


def raise_sites() -> list[RaiseSite]:
    """Every user-visible raise in the package, in file order."""
    return [site for path in sorted(PACKAGE.rglob("*.py")) for site in _sites(path)]


def exception_classes() -> dict[str, str]:
    """The exception classes meshlight defines: name -> module."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and any(
                ast.unparse(base).endswith(("Error", "Exception", "Changed")) for base in node.bases
            ):
                found[node.name] = module
    return found


def catalogue() -> str:
    by_class: dict[str, list[RaiseSite]] = defaultdict(list)
    for site in raise_sites():
        by_class[site.exception].append(site)
    lines = [
        "# Every error, where it is raised",
        "",
        "Generated from the source by `python docs/gen_errors.py` (a test checks it is current): each error meshlight "
        "raises, grouped by exception class, with the function that raises it and its message as written — "
        "`{...}` is filled in at run time. The [troubleshooting guide](troubleshooting.md) explains each group "
        "and its usual fix; the message itself names the fix for its case.",
        "",
    ]
    for name in sorted(by_class, key=lambda n: (-len(by_class[n]), n)):
        lines += [f"## `{name}`", "", f"{len(by_class[name])} site(s).", "", "| raised in | message |", "|---|---|"]
        for site in by_class[name]:
            where = f"`{site.module}.{site.function}`" if site.function else f"`{site.module}`"
            message = " ".join(site.message.split()).replace("|", "\\|").replace("`", "'") or "(no message)"
            lines.append(f"| {where} | `{message}` |" if message != "(no message)" else f"| {where} | {message} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    text = catalogue()
    if "--check" in sys.argv:
        if not CATALOGUE.exists() or CATALOGUE.read_text() != text:
            print(f"{CATALOGUE.relative_to(ROOT)} is out of date: run python docs/gen_errors.py", file=sys.stderr)
            return 1
        return 0
    CATALOGUE.write_text(text)
    print(f"wrote {CATALOGUE.relative_to(ROOT)}: {len(raise_sites())} raise sites")
    return 0


if __name__ == "__main__":
    sys.exit(main())
