"""The image's install steps, without a container engine: the wheel built from exactly what the
Dockerfile copies, a fresh venv, the wheel installed with the image's extras, pip removed; then the
image's command runs: ``drain --version`` and ``drain check`` against the local services.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from drain import __version__
from tests.deploy import dockerfile, files

DEV_TOOLS = ("pytest", "mypy", "ruff", "hypothesis", "lint-imports", "pip")
TIMEOUT_S = 600


def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False, **kwargs)  # type: ignore[call-overload]
    assert done.returncode == 0, f"{argv}: {done.stdout}\n{done.stderr}"
    result: subprocess.CompletedProcess[str] = done
    return result


@pytest.fixture(scope="module")
def image_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """/opt/drain as the Dockerfile's build stage makes it, in a temporary folder."""
    tmp = tmp_path_factory.mktemp("image")
    build, _final = dockerfile.parse(files.DOCKERFILE.read_text())
    extras = next(
        i.arguments.partition("=")[2] for i in build.instructions if i.arguments.startswith("DRAIN_EXTRAS=")
    )
    source = tmp / "src"
    source.mkdir()
    for copy in build.instructions:
        if copy.keyword == "COPY":
            for name in copy.arguments.split()[:-1]:
                origin = files.ROOT / name
                if origin.is_dir():
                    shutil.copytree(origin, source / name, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy(origin, source / name)
    wheels = tmp / "wheels"
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--wheel-dir",
            str(wheels),
            str(source),
        ]
    )
    (wheel,) = wheels.glob("jobdrain-*.whl")
    venv = tmp / "opt-drain"
    run([sys.executable, "-m", "venv", str(venv)])
    run([str(venv / "bin" / "pip"), "install", "--quiet", f"{wheel}[{extras}]"])
    run([str(venv / "bin" / "pip"), "uninstall", "--quiet", "--yes", "pip", "setuptools"])
    return venv


def test_the_image_venv_holds_the_drain_and_no_dev_tools(image_venv: Path) -> None:
    for tool in DEV_TOOLS:
        assert not (image_venv / "bin" / tool).exists(), tool
    done = run(
        [str(image_venv / "bin" / "python"), "-c", "import drain, drain_adapters.rq, drain_adapters.rabbitmq"]
    )
    assert done.returncode == 0


def test_drain_version_and_check_run_from_the_image_venv(
    image_venv: Path, database: str, redis_db: str, tmp_path: Path
) -> None:
    drain = str(image_venv / "bin" / "drain")
    done = run([drain, "--version"])
    assert done.stdout.strip() == f"drain {__version__}"
    # The image's environment (ENV lines) plus the secrets an operator provides; no venv of ours.
    (_build, final) = dockerfile.parse(files.DOCKERFILE.read_text())
    env = {"PATH": f"{image_venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}
    for instruction in final.instructions:
        if instruction.keyword == "ENV":
            for key, value in re.findall(r"(\w+)=(\S+)", instruction.arguments):
                env[key] = value.replace("$PATH", env["PATH"]).replace("/opt/drain", str(image_venv))
    env["DRAIN_CONFIG"] = str(files.EXAMPLE_CONFIG)  # the image's /etc/drain/drain.toml
    env.update(DRAIN_DSN=database, REDIS_URL=redis_db)
    assert env["PATH"].startswith(str(image_venv / "bin"))
    checked = subprocess.run(
        [drain, "check"], env=env, capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    broken = subprocess.run(
        [drain, "check"],
        env={**env, "REDIS_URL": "redis://127.0.0.1:1/0"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert broken.returncode == 3, broken.stdout + broken.stderr
