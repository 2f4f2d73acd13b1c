"""The docs site's pages (docs/, mkdocs.yml), for the tests that read what the docs say."""

from __future__ import annotations

import importlib.util
import pathlib
import re
from types import ModuleType

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def page(name: str) -> str:
    """The Markdown of ``docs/<name>`` (``"operations/database.md"``)."""
    return (DOCS / name).read_text()


def all_pages() -> str:
    """Every page of the docs site, concatenated."""
    return "\n".join(path.read_text() for path in sorted(DOCS.rglob("*.md")))


def config_reference() -> ModuleType:
    """scripts/config_reference.py, which generates the configuration reference."""
    path = ROOT / "scripts" / "config_reference.py"
    spec = importlib.util.spec_from_file_location("config_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def section(text: str, heading: str) -> str:
    """From the line ``heading`` to the next heading of the same or a higher level (outside code)."""
    level = len(heading) - len(heading.lstrip("#"))
    start = text.index(f"{heading}\n")
    fenced = False
    offset = start + len(heading) + 1
    for line in text[offset:].splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(rf"#{{1,{level}}} ", line):
            return text[start:offset]
        offset += len(line)
    return text[start:]
