"""The prose in the source names what exists, and tells no process history.

- Every dotted path (``drain.relay.loop``, ``drain.store.session.Store``) in a docstring, a
  comment or a ``.sql`` comment resolves: to a module, or to a name in one. A reader who
  follows one reaches the code it names.
- No docstring or comment in ``drain/`` or ``adapters/`` tells how a case was found (a review's
  or an issue's number): that story belongs in the test that pins the case and in the commit.
"""

from __future__ import annotations

import ast
import importlib
import io
import itertools
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "drain", ROOT / "adapters" / "drain_adapters"]
DOTTED = re.compile(r"(?<![\w.`/-])(drain(?:_adapters)?(?:\.[A-Za-z_]\w*)+)")
HISTORY = re.compile(r"red[ -]?teams?\b|\bissues? #?\d+|\breview(?:er)?s? #?\d+", re.IGNORECASE)
NOT_CODE = {
    # names that are no Python path: the entry-point group third-party backends register in
    "drain.backends",
}


def _files(suffix: str) -> list[pathlib.Path]:
    return sorted(path for source in SOURCES for path in source.rglob(f"*{suffix}"))


def _python_prose(path: pathlib.Path) -> list[tuple[int, str]]:
    """The docstrings and comments of a module, with their first line numbers."""
    text = path.read_text(encoding="utf-8")
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                found.append((node.body[0].lineno, docstring))
        # an attribute's docstring: a string statement right after an assignment
        for field in ("body", "orelse"):
            statements = getattr(node, field, None)
            if not isinstance(statements, list):
                continue
            for before, after in itertools.pairwise(statements):
                if (
                    isinstance(before, ast.Assign | ast.AnnAssign)
                    and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)
                ):
                    found.append((after.lineno, after.value.value))
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            found.append((token.start[0], token.string))
    return found


def _sql_prose(path: pathlib.Path) -> list[tuple[int, str]]:
    return [
        (number, line.split("--", 1)[1])
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if "--" in line
    ]


def _prose() -> list[tuple[str, int, str]]:
    found = [
        (str(path.relative_to(ROOT)), line, text)
        for path in _files(".py")
        for line, text in _python_prose(path)
    ]
    found += [
        (str(path.relative_to(ROOT)), line, text)
        for path in _files(".sql")
        for line, text in _sql_prose(path)
    ]
    return found


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(target, name):
                return False
            target = getattr(target, name)
        return True
    return False


def test_every_dotted_path_in_the_prose_resolves() -> None:
    unresolved = sorted(
        {
            f"{where}:{line}: {dotted}"
            for where, line, text in _prose()
            for dotted in (match.rstrip(".") for match in DOTTED.findall(text))
            if dotted not in NOT_CODE and not _resolves(dotted)
        }
    )
    assert not unresolved, "dotted paths that name nothing:\n" + "\n".join(unresolved)


def test_the_source_tells_no_process_history() -> None:
    told = sorted(
        f"{where}:{line}: {match.group(0)}"
        for where, line, text in _prose()
        for match in HISTORY.finditer(text)
    )
    assert not told, "process history in the source (it belongs in tests and commits):\n" + "\n".join(told)


@pytest.mark.parametrize("dotted", ["drain.relay.loop", "drain.relay.loop.Relay", "drain_adapters.rq"])
def test_a_real_path_resolves(dotted: str) -> None:
    assert _resolves(dotted)


@pytest.mark.parametrize("dotted", ["drain.settling", "drain.relay.loop.Nothing", "drain_adapters.nope"])
def test_a_stale_path_does_not(dotted: str) -> None:
    assert not _resolves(dotted)
