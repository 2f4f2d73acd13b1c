"""A small Dockerfile reader and the lint rules that matter for the drain's image.

No hadolint here (not a Debian package), so the rules this project relies on are checked directly:
multi-stage with the final stage copying from an earlier one, every base image pinned to a full
version (or a digest), a numeric non-root USER, exec-form ENTRYPOINT/CMD/HEALTHCHECK, a HEALTHCHECK
on /healthz, SIGTERM as the stop signal, and nothing in the final stage that builds or installs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

BUILD_TOOLS = re.compile(
    r"\b(gcc|g\+\+|clang|make|build-essential|libpq-dev|python3?-dev|pip\s+install|pip\s+wheel|"
    r"apt-get\s+install|apk\s+add|setup\.py|hatch|poetry)\b"
)
PINNED_TAG = re.compile(r":\d+\.\d+\.\d+[\w.-]*$")


@dataclass
class Instruction:
    keyword: str
    arguments: str
    line: int


@dataclass
class Stage:
    image: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)


def instructions(text: str) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped."""
    found: list[Instruction] = []
    pending = ""
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        keyword, _, arguments = whole.partition(" ")
        found.append(Instruction(keyword.upper(), arguments.strip(), start))
    return found


def parse(text: str) -> list[Stage]:
    """The stages, with global ARG defaults substituted into each FROM."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for instruction in instructions(text):
        if instruction.keyword == "ARG" and not stages:
            name, _, default = instruction.arguments.partition("=")
            args[name] = default
        elif instruction.keyword == "FROM":
            words = [w for w in instruction.arguments.split() if not w.startswith("--")]
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), words[0])
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(image, name))
        elif stages:
            stages[-1].instructions.append(instruction)
    return stages


def _of(stage: Stage, keyword: str) -> list[Instruction]:
    return [i for i in stage.instructions if i.keyword == keyword]


def _exec_form(arguments: str) -> list[str] | None:
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def final_user(stages: list[Stage]) -> tuple[int, int]:
    """The final stage's last USER as (uid, gid); ValueError unless both are numeric."""
    users = _of(stages[-1], "USER")
    if not users:
        raise ValueError("no USER in the final stage")
    uid, _, gid = users[-1].arguments.partition(":")
    return int(uid), int(gid or uid)


def exposed(stages: list[Stage]) -> set[int]:
    return {int(port.split("/")[0]) for i in _of(stages[-1], "EXPOSE") for port in i.arguments.split()}


def lint(text: str) -> list[str]:
    """Every problem found, as one line each; an empty list for a good Dockerfile."""
    stages = parse(text)
    if not stages:
        return ["no FROM"]
    problems: list[str] = []
    final = stages[-1]
    if len(stages) < 2:
        problems.append("single stage: build in one stage, copy the result into a clean final stage")
    earlier = {stage.name for stage in stages[:-1] if stage.name}
    copied_from = {
        m.group(1) for i in _of(final, "COPY") for m in [re.search(r"--from=(\S+)", i.arguments)] if m
    }
    if len(stages) >= 2 and not copied_from & earlier:
        problems.append("the final stage copies nothing from a build stage")
    for stage in stages:
        if "@sha256:" not in stage.image and not PINNED_TAG.search(stage.image):
            problems.append(f"base image not pinned to a full version or digest: {stage.image}")
    try:
        uid, _gid = final_user(stages)
        if uid == 0:
            problems.append("the final USER is root")
    except ValueError as error:
        problems.append(f"no numeric non-root USER in the final stage ({error})")
    for keyword in ("ENTRYPOINT", "CMD"):
        for instruction in _of(final, keyword):
            if _exec_form(instruction.arguments) is None:
                problems.append(f"{keyword} is not in exec form (JSON array): signals would go to a shell")
    if not _of(final, "ENTRYPOINT"):
        problems.append("no ENTRYPOINT")
    checks = _of(final, "HEALTHCHECK")
    if not checks:
        problems.append("no HEALTHCHECK")
    for check in checks:
        _, _, command = check.arguments.partition("CMD")
        if _exec_form(command.strip()) is None or "/healthz" not in command:
            problems.append("HEALTHCHECK is not an exec-form CMD on /healthz")
    for signal in _of(final, "STOPSIGNAL"):
        if signal.arguments not in ("SIGTERM", "15"):
            problems.append(f"STOPSIGNAL {signal.arguments}: the drain stops gracefully on SIGTERM")
    for instruction in final.instructions:
        if instruction.keyword == "RUN" and BUILD_TOOLS.search(instruction.arguments):
            problems.append(f"line {instruction.line}: builds or installs in the final stage")
        if instruction.keyword == "ADD":
            problems.append(f"line {instruction.line}: ADD (use COPY)")
        if instruction.keyword == "COPY" and "--from=" not in instruction.arguments:
            problems.append(f"line {instruction.line}: copies the build context into the final stage")
    return problems
