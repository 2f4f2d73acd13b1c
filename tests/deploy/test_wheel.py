"""drain as a package index hands it out: the sdist and the wheel built from a clean copy of the
repository, their metadata checked by ``twine check``, the wheel (never editable) installed with
each extra into a fresh virtualenv, and the installed ``drain`` run: ``--version``, the adapter
of that extra imported, and with ``[rq]`` the demo end to end (``drain migrate``, jobs staged in
transactions, ``drain run`` forwarding to a real ``rq worker``). The wheel carries ``py.typed``:
a typed snippet calling ``drain.stage`` passes ``mypy --strict`` against the installed package,
and a wrong call fails it (so the types are really seen).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
import zipfile
from pathlib import Path

import psycopg
import pytest

from drain import __version__
from tests import conftest
from tests.deploy import files

TIMEOUT_S = 900
EXTRAS = {"rq": "drain_adapters.rq", "rabbitmq": "drain_adapters.rabbitmq", "celery": "drain_adapters.celery"}
ADMIN_DSN = conftest.admin_dsn()  # the server the tests are pointed at (DRAIN_TEST_PG*)

pytestmark = pytest.mark.slow


def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, check=False, **kwargs)  # type: ignore[call-overload]
    assert done.returncode == 0, f"{argv}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result: subprocess.CompletedProcess[str] = done
    return result


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and the wheel, built from what git tracks (a clean copy: no venv, no caches)."""
    tmp = tmp_path_factory.mktemp("dist")
    source = tmp / "src"
    tracked = run(["git", "-C", str(files.ROOT), "ls-files", "-z"]).stdout.split("\0")
    for name in filter(None, tracked):
        origin = files.ROOT / name
        if origin.is_file():
            target = source / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(origin.read_bytes())
    out = tmp / "out"
    run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(out), str(source)])
    return out


@pytest.fixture(scope="module")
def wheel(dist: Path) -> Path:
    (found,) = dist.glob(f"jobdrain-{__version__}-py3-none-any.whl")
    return found


def venv_with(tmp: Path, wheel: Path, extra: str) -> Path:
    venv = tmp / f"venv-{extra}"
    run([sys.executable, "-m", "venv", str(venv)])
    run([str(venv / "bin" / "pip"), "install", "--quiet", f"{wheel}[{extra}]"])
    return venv


def test_twine_accepts_the_metadata_of_both(dist: Path) -> None:
    built = sorted(dist.iterdir())
    assert sorted(p.suffix for p in built) == [".gz", ".whl"], built
    done = run([sys.executable, "-m", "twine", "check", "--strict", *map(str, built)])
    assert done.stdout.count("PASSED") == 2, done.stdout


def test_the_wheel_ships_its_packages_sql_and_type_markers(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "drain/py.typed",
        "drain_adapters/py.typed",
        "drain/store/sql/schema.sql",
        "drain/cli/__init__.py",
        "drain_adapters/rq/__init__.py",
    ):
        assert expected in names, expected
    assert not [n for n in names if n.startswith(("tests/", "bench/")) or "__pycache__" in n]


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_each_extra_installs_and_runs(extra: str, wheel: Path, tmp_path: Path, redis_db: str) -> None:
    venv = venv_with(tmp_path, wheel, extra)
    assert run([str(venv / "bin" / "drain"), "--version"]).stdout.strip() == f"drain {__version__}"
    run([str(venv / "bin" / "python"), "-c", f"import {EXTRAS[extra]}"], cwd=tmp_path)
    if extra == "rq":
        demo_against(venv, tmp_path, redis_db)
        typed_snippet_against(venv, tmp_path)


def demo_against(venv: Path, tmp_path: Path, redis_url: str) -> None:
    """examples/demo.py with the installed drain and rq (its own database, Redis db and queue)."""
    database = f"drain_test_wheel_{uuid.uuid4().hex[:8]}"
    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "DEMO_ADMIN_DSN": ADMIN_DSN,
        "DEMO_DATABASE": database,
        "DEMO_QUEUE": f"wheel-demo-{uuid.uuid4().hex[:8]}",
        "DEMO_REDIS_URL": redis_url,
    }
    try:
        done = run(
            [str(venv / "bin" / "python"), str(files.ROOT / "examples" / "demo.py")], env=env, cwd=tmp_path
        )
        assert "committed but not run 0" in done.stdout and "rolled back but ran 0" in done.stdout, (
            done.stdout
        )
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")


SNIPPET = """
    from __future__ import annotations

    import uuid

    import psycopg

    import drain


    def welcome(conn: psycopg.Connection[tuple[object, ...]], user_id: int) -> uuid.UUID:
        staged: uuid.UUID = drain.stage(conn, "app.tasks.send_welcome", args=[user_id], queue="mail")
        return staged
"""


def typed_snippet_against(venv: Path, tmp_path: Path) -> None:
    good = tmp_path / "good.py"
    good.write_text(textwrap.dedent(SNIPPET))
    bad = tmp_path / "bad.py"
    bad.write_text(textwrap.dedent(SNIPPET).replace('"app.tasks.send_welcome"', "42"))
    mypy = [
        sys.executable,
        "-m",
        "mypy",
        "--strict",
        "--no-incremental",
        "--python-executable",
        str(venv / "bin" / "python"),
    ]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    run([*mypy, str(good)], cwd=tmp_path, env=env)
    refused = subprocess.run(
        [*mypy, str(bad)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert (
        refused.returncode == 1
        and ' matches argument types "Connection[tuple[object, ...]]", "int"' in refused.stdout
    ), refused.stdout
