"""deploy/Dockerfile: the lint rules of tests/deploy/dockerfile.py pass, and each rule can fail."""

from __future__ import annotations

import re

import pytest

from tests.deploy import dockerfile, files


@pytest.fixture(scope="module")
def text() -> str:
    return files.DOCKERFILE.read_text()


def test_the_dockerfile_passes_the_lint(text: str) -> None:
    assert dockerfile.lint(text) == []


def test_the_final_stage_is_the_built_venv_run_as_a_fixed_uid(text: str) -> None:
    stages = dockerfile.parse(text)
    assert len(stages) == 2
    assert stages[0].name == "build"
    assert dockerfile.final_user(stages) == (10001, 10001)
    assert dockerfile.exposed(stages) == {9464}


# Each edit breaks one rule; the lint must name it.
BREAKAGES = {
    "single stage": (r"(?s)FROM \$\{PYTHON_IMAGE\} AS build.*?(?=FROM \$\{PYTHON_IMAGE\}\n)", ""),
    "not pinned": (r"python:3\.11\.11-slim-bookworm", "python:3.11-slim"),
    "latest": (r"python:3\.11\.11-slim-bookworm", "python:latest"),
    "no numeric non-root USER": (r"USER 10001:10001", "USER drain"),
    "the final USER is root": (r"USER 10001:10001", "USER 0"),
    "ENTRYPOINT is not in exec form": (r'ENTRYPOINT \["drain"\]', "ENTRYPOINT drain"),
    "CMD is not in exec form": (r'CMD \["run"\]\s*$', "CMD run\n"),
    "no HEALTHCHECK": (r"(?s)HEALTHCHECK .*?timeout=4\)\"\]\n", ""),
    "STOPSIGNAL SIGKILL": (r"STOPSIGNAL SIGTERM", "STOPSIGNAL SIGKILL"),
    "builds or installs in the final stage": (
        r"COPY --from=build",
        "RUN apt-get install -y gcc\nCOPY --from=build",
    ),
    "copies the build context": (r"COPY --from=build /opt/drain /opt/drain", "COPY drain /opt/drain"),
}


@pytest.mark.parametrize("problem", list(BREAKAGES))
def test_each_rule_catches_its_mistake(text: str, problem: str) -> None:
    pattern, replacement = BREAKAGES[problem]
    broken, count = re.subn(pattern, replacement, text, count=1, flags=re.MULTILINE)
    assert count == 1, f"the edit for {problem!r} no longer applies"
    found = dockerfile.lint(broken)
    expected = problem.split(maxsplit=1)[0] if problem.startswith("STOPSIGNAL") else problem
    assert any(expected in line for line in found), found


def test_the_build_context_allowlist_covers_what_the_build_copies(text: str) -> None:
    ignore = (files.DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = {line[1:].removesuffix("/**") for line in ignore if line.startswith("!")}
    (build, _final) = dockerfile.parse(text)
    for copy in build.instructions:
        if copy.keyword == "COPY":
            *sources, _destination = copy.arguments.split()
            assert set(sources) <= allowed, sources
