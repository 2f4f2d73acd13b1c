"""The shape of the code: modules and their sizes, the largest classes and functions, comments.

``python scripts/code_shape.py`` prints the figures the restructuring is measured by;
``tests/unit/test_code_shape.py`` holds every class to 400 lines and every function to 80: a sanity
bound, not a design rule. A unit holds one concept whatever its length; split it when it holds two,
never to meet a count (a split that adds constructors, re-exports and delegations makes code longer).
"""

from __future__ import annotations

import ast
import io
import re
import statistics
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (ROOT / "drain", ROOT / "adapters" / "drain_adapters")
RELAY_AND_STORE = ("drain/relay", "drain/store")
BATCH_PATH = (
    "drain/relay/loop.py",
    "drain/relay/leadership.py",
    "drain/relay/forward.py",
    "drain/relay/settle.py",
    "drain/relay/reporting.py",
    "drain/store/session.py",
    "drain/store/writes.py",
)
"""The modules one batch crosses, select to delete (the relay's side; the adapter's are its own)."""
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 80


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


def relay_figures(root: Path = ROOT) -> tuple[int, int]:
    """(classes, non-blank lines) of the .py files of drain/relay and drain/store."""
    classes = lines = 0
    for folder in RELAY_AND_STORE:
        for path in sorted((root / folder).glob("*.py")):
            text = path.read_text().splitlines()
            lines += sum(1 for line in text if line.strip())
            classes += sum(1 for line in text if line.startswith(("class ", "    class ")))
    return classes, lines


def docstrings(path: Path) -> list[str]:
    """Every module, class and function docstring of one module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node)
            if text:
                found.append(text)
    return found


def sentences(text: str) -> list[str]:
    """The sentences of a docstring: a drawing (the indented block after ``::``) is left out, and
    a bullet or a heading ends a sentence as a full stop does."""
    kept: list[str] = []
    drawing = False
    for line in text.splitlines():
        if drawing and (not line.strip() or line.startswith(" ")):
            continue
        drawing = line.rstrip().endswith("::")
        stripped = line.strip()
        if stripped.startswith(("- ", "* ")) or (stripped.endswith(":") and len(stripped.split()) <= 6):
            kept.append(".")  # a bullet or a heading starts a new sentence
        kept.append(stripped.rstrip(":") if drawing else stripped)
    flat = " ".join(kept)
    parts = re.split(r"(?<=[.!?])\s+|(?<=[a-z)])\.(?=\s|$)", flat)
    return [part for part in parts if len(part.split()) > 1]


def words_per_sentence(paths: list[Path]) -> float:
    """Mean words per sentence of these modules' docstrings."""
    found = [sentence for path in paths for text in docstrings(path) for sentence in sentences(text)]
    return sum(len(sentence.split()) for sentence in found) / max(len(found), 1)


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
    classes_, lines_ = relay_figures()
    print(f"drain/relay + drain/store (.py): {classes_} classes, {lines_} non-blank lines")
    batch_path = [ROOT / name for name in BATCH_PATH if (ROOT / name).exists()]
    print(f"batch path docstrings: {words_per_sentence(batch_path):.1f} words a sentence")
    return 0


if __name__ == "__main__":
    sys.exit(main())
