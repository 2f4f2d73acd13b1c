"""Each guarantee is one sentence, kept in one place: the README's table and the guarantees page
share it word for word, and the page adds each one's scope, bounds and tests."""

from __future__ import annotations

import re

from tests.support import docs

MAX_WORDS = 30
MAX_SECTION_WORDS = 350
ROW = re.compile(r"^\| (G\d+) \| (.+) \|$", re.MULTILINE)


def guarantees(text: str) -> dict[str, str]:
    return dict(ROW.findall(text))


def section(text: str, heading: str = "## What drain guarantees\n") -> str:
    start = text.index(heading)
    return text[start : text.index("\n## ", start + len(heading))]


def readme_section() -> str:
    return section(docs.README.read_text())


def page() -> str:
    return (docs.DOCS / "guarantees.md").read_text()


def test_the_readme_and_the_page_share_each_sentence() -> None:
    readme = guarantees(readme_section())
    assert list(readme) == [f"G{number}" for number in range(1, 11)]
    assert readme == guarantees(section(page()))


def test_each_guarantee_is_one_short_sentence() -> None:
    for name, sentence in guarantees(readme_section()).items():
        words = len(sentence.split())
        assert words <= MAX_WORDS, f"{name} has {words} words"


def test_the_readme_section_is_short() -> None:
    assert len(readme_section().split()) <= MAX_SECTION_WORDS


def test_every_guarantee_has_its_scope_on_the_page() -> None:
    scoped = re.findall(r"^### (G\d+)(?: and (G\d+))?:", page(), re.MULTILINE)
    assert {name for pair in scoped for name in pair if name} == set(guarantees(readme_section()))
