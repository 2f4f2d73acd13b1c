"""The shape of the code: modules and their sizes, the largest classes and functions, comments.

``python scripts/code_shape.py`` prints the figures the restructuring is measured by;
``tests/unit/test_code_shape.py`` holds every class to 200 lines and every function to 60.
"""

from __future__ import annotations

import ast
import io
import statistics
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (ROOT / "drain", ROOT / "adapters" / "drain_adapters")
MAX_CLASS_LINES = 200
MAX_FUNCTION_LINES = 60


@dataclass(frozen=True)
class Unit:
    kind: str  # "class" or "function"
    name: str  # module:Qualified.name
    lines: int


def modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in package.rglob("*.py") if "migrations" not in p.parts)


def units(path: Path, root: Path = ROOT) -> list[Unit]:
    tree = ast.parse(path.read_text(), str(path))
    module = path.relative_to(root).as_posix()
    found: list[Unit] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                kind = "class" if isinstance(child, ast.ClassDef) else "function"
                start = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                end = child.end_lineno or child.lineno
                found.append(Unit(kind, f"{module}:{name}", end - start + 1))
                visit(child, f"{name}.")

    visit(tree, "")
    return found


def oversized() -> list[Unit]:
    limit = {"class": MAX_CLASS_LINES, "function": MAX_FUNCTION_LINES}
    return [u for path in modules() for u in units(path) if u.lines > limit[u.kind]]


def comment_share(path: Path) -> tuple[int, int, int]:
    """(code lines, comment lines, docstring lines) of one module."""
    source = path.read_text()
    comments = {
        tok.start[0]
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            first = body[0] if body else None
            value = first.value if isinstance(first, ast.Expr) else None
            if first is not None and isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    nonblank = {i for i, line in enumerate(source.splitlines(), 1) if line.strip()}
    return len(nonblank - comments - docstrings), len(comments & nonblank), len(docstrings & nonblank)


def main() -> int:
    paths = modules()
    sizes = [len(p.read_text().splitlines()) for p in paths]
    every = [u for p in paths for u in units(p)]
    classes = sorted((u for u in every if u.kind == "class"), key=lambda u: -u.lines)
    functions = sorted((u for u in every if u.kind == "function"), key=lambda u: -u.lines)
    code = comments = docs = 0
    for p in paths:
        c, m, d = comment_share(p)
        code, comments, docs = code + c, comments + m, docs + d
    print(f"modules: {len(paths)}, lines: {sum(sizes)}, median module: {statistics.median(sizes):.0f} lines")
    print(f"largest classes: {', '.join(f'{u.name} {u.lines}' for u in classes[:3])}")
    print(f"largest functions: {', '.join(f'{u.name} {u.lines}' for u in functions[:3])}")
    print(f"per 100 code lines: {100 * comments / code:.1f} comment, {100 * docs / code:.1f} docstring lines")
    over = oversized()
    print(
        f"over the limits ({MAX_CLASS_LINES}-line classes, {MAX_FUNCTION_LINES}-line functions): {len(over)}"
    )
    for u in over:
        print(f"  {u.kind} {u.name} {u.lines}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
