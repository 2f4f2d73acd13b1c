"""drain.store.reading without a database: each select_due row becomes a job or
that row's refusal, never an exception; a batch takes rows while their weight fits its budget;
the weight is an upper bound of what a decoded row takes (tracemalloc, on the worst shapes)."""

from __future__ import annotations

import datetime
import gc
import json
import sys
import tracemalloc
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from drain import models
from drain.store import reading

NOW = datetime.datetime(2024, 5, 1, 12, 0, tzinfo=datetime.UTC)
MIB = 1 << 20


def row(
    *,
    id_: int = 1,
    args: str | bytes | None = "[1]",
    kwargs: str | bytes | None = "{}",
    options: str | bytes | None = "{}",
    job_name: str | bytes = "app.tasks.send",
    queue: str | bytes = "default",
    backend: str | bytes = "default",
    created_at: datetime.datetime | None = NOW,
    created_at_text: str | None = None,
    run_at: datetime.datetime | None = None,
    sent: bool = True,
    row_bytes: int | None = None,
    attempts: int = 0,
    ordering_key: str | bytes | None = None,
) -> tuple[Any, ...]:
    """A row as select_due returns it (columns in drain.store.reading's order)."""
    if row_bytes is None:
        parts = (args, kwargs, options, job_name, queue, backend)
        row_bytes = sum(len(p.encode() if isinstance(p, str) else p) for p in parts if p is not None)
    return (
        id_,
        uuid.UUID(int=id_),
        attempts,
        row_bytes,
        sent,
        job_name,
        queue,
        backend,
        args if sent else None,
        kwargs if sent else None,
        options if sent else None,
        created_at,
        created_at_text,
        run_at,
        0.25,
        ordering_key,
    )


def refusal(text_row: tuple[Any, ...]) -> str | None:
    (job,) = reading.take([text_row], batch_max_bytes=64 * MIB, budget_bytes=64 * MIB, read_at=1.0).jobs
    return job.unreadable


def test_a_plain_row_is_a_job() -> None:
    (job,) = reading.take(
        [row(args='[1, "é😀", {"a": null}]', kwargs='{"k": [true, 1.5]}', run_at=NOW)],
        batch_max_bytes=64 * MIB,
        budget_bytes=64 * MIB,
        read_at=7.0,
    ).jobs
    assert job.unreadable is None
    assert (job.id, job.job_id, job.job_name, job.queue, job.backend) == (
        1,
        uuid.UUID(int=1),
        "app.tasks.send",
        "default",
        "default",
    )
    assert list(job.args) == [1, "é😀", {"a": None}]
    assert dict(job.kwargs) == {"k": [True, 1.5]}
    assert dict(job.options) == {}
    assert (job.created_at, job.run_at, job.age_s, job.read_at) == (NOW, NOW, 0.25, 7.0)
    assert job.memory_bytes == reading.weight(
        row(args='[1, "é😀", {"a": null}]', kwargs='{"k": [true, 1.5]}')
    )


def test_decode_fills_each_field_from_its_own_column() -> None:
    """decode builds the job positionally (the cheaper call): every field, each given a value no
    other field has, lands where the same job built by keyword has it."""
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    options = {"traceparent": trace, "tracestate": "a=1", "drain_schedule": "nightly"}
    options["drain_tick"] = "2024-05-01T12:00:00Z"
    text = row(
        id_=7,
        args="[1]",
        kwargs='{"k": 2}',
        options=json.dumps({**options, "ttl": 5}),
        job_name="app.a",
        queue="q",
        backend="b",
        run_at=NOW + datetime.timedelta(seconds=1),
        attempts=3,
        ordering_key="key",
    )
    job = reading.decode(text, 9.0, 123)
    expected = models.StagedJob(
        id=7,
        job_id=uuid.UUID(int=7),
        job_name="app.a",
        args=[1],
        kwargs={"k": 2},
        queue="q",
        backend="b",
        options={"ttl": 5},
        created_at=NOW,
        attempts=3,
        run_at=NOW + datetime.timedelta(seconds=1),
        age_s=0.25,
        read_at=9.0,
        traceparent=trace,
        tracestate="a=1",
        schedule="nightly",
        tick="2024-05-01T12:00:00Z",
        ordering_key="key",
        unreadable=None,
        memory_bytes=123,
    )
    assert job == expected


def test_trace_context_leaves_the_options_when_read() -> None:
    parent = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    (job,) = reading.take(
        [row(options=json.dumps({"traceparent": parent, "timeout": 5}))],
        batch_max_bytes=64 * MIB,
        budget_bytes=64 * MIB,
        read_at=1.0,
    ).jobs
    assert (job.traceparent, dict(job.options)) == (parent, {"timeout": 5})


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"args": deep(65)}, "job_args is nested deeper than 64 levels"),
        ({"args": deep(5000)}, "job_args is nested deeper than 64 levels"),  # past Python's recursion limit
        ({"kwargs": '{"a": ' + deep(70) + "}"}, "job_kwargs is nested deeper than 64 levels"),
        ({"args": "[" + "9" * 4301 + "]"}, "job_args holds an integer of more than 4300 digits"),
        ({"args": "[-" + "9" * 20000 + "]"}, "job_args holds an integer of more than 4300 digits"),
        ({"args": "[" + "9" * 400 + ".5]"}, "too large for a float"),
        ({"args": '{"a": 1}'}, "job_args must be a JSON array, not an object"),
        ({"args": "5"}, "job_args must be a JSON array, not a number"),
        ({"kwargs": "[]"}, "job_kwargs must be a JSON object, not an array"),
        ({"kwargs": "[1]"}, "job_kwargs must be a JSON object, not an array"),
        ({"options": '"x"'}, "options must be a JSON object, not a string"),
        ({"options": "null"}, "options must be a JSON object, not null"),
        ({"args": "[1] x"}, "job_args is not JSON"),
        ({"args": "[1"}, "job_args is not JSON"),
        ({"args": ""}, "job_args is not JSON"),
        ({"args": b"[\xff]"}, "job_args is not UTF-8"),
        ({"job_name": "n" * 1025}, "job_name is longer than 1024 bytes"),
        ({"queue": "é" * 513}, "queue is longer than 1024 bytes"),
        ({"backend": b"\xe9"}, "backend is not UTF-8"),
        ({"created_at": None, "created_at_text": "-infinity"}, "created_at -infinity is outside the dates"),
        ({"created_at": None, "created_at_text": "10000-01-01 00:00:00+00"}, "created_at 10000-01-01"),
    ],
)
def test_a_row_that_cannot_be_read_is_refused_with_one_line(fields: dict[str, Any], says: str) -> None:
    reason = refusal(row(**fields))
    assert reason is not None and says in reason, reason
    assert reason.startswith("the drain cannot read this row: ") and "\n" not in reason
    assert len(reason) < 300  # never the content


@pytest.mark.parametrize(
    "fields",
    [
        {"args": deep(64)},
        {"args": "[" + "9" * 4300 + "]"},
        {"args": "[" + "9" * 300 + ".5, 1e-400]"},
        {"job_name": "é" * 512, "queue": "q" * 1024},
        {"run_at": None},
        {"args": b"[1]", "job_name": b"app.tasks.x"},  # a SQL_ASCII database hands bytes over
    ],
)
def test_what_the_limits_allow_is_read(fields: dict[str, Any]) -> None:
    assert refusal(row(**fields)) is None


def test_the_digit_limit_holds_when_the_process_lifted_pythons(monkeypatch: pytest.MonkeyPatch) -> None:
    previous = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # PYTHONINTMAXSTRDIGITS=0
    try:
        reason = refusal(row(args="[" + "9" * 5000 + "]"))
        assert refusal(row(args="[" + "9" * 4300 + "]")) is None
    finally:
        sys.set_int_max_str_digits(previous)
    assert reason is not None and "more than 4300 digits" in reason


def test_a_refused_row_carries_no_content_and_short_names() -> None:
    (job,) = reading.take(
        [row(job_name="n" * 5000, args="[1, 2]", options='{"timeout": 1}')],
        batch_max_bytes=64 * MIB,
        budget_bytes=64 * MIB,
        read_at=1.0,
    ).jobs
    assert job.unreadable is not None
    assert (tuple(job.args), dict(job.kwargs), dict(job.options)) == ((), {}, {})
    assert len(job.job_name) == reading.SHOWN_NAME_CHARS and job.memory_bytes == 0


def test_a_row_too_large_to_fetch_is_refused_unread_and_one_that_does_not_fit_is_held_back() -> None:
    rows = [
        row(id_=1),
        row(id_=2, sent=False, row_bytes=16 * MIB + 1, created_at=None, created_at_text="infinity"),
        row(id_=3, sent=False, row_bytes=1000),  # within the cap, beyond this select's text
        row(id_=4, sent=False, row_bytes=50 * MIB),
    ]
    taken = reading.take(rows, batch_max_bytes=64 * MIB, budget_bytes=64 * MIB, read_at=1.0)
    assert [job.id for job in taken.jobs] == [1, 2, 4]
    assert taken.over_budget
    too_large = taken.jobs[1].unreadable
    assert too_large is not None and "16777217 bytes as text, over batch_max_bytes / 4" in too_large
    assert taken.jobs[1].created_at == reading.UNREADABLE_AT


def test_a_batch_takes_rows_while_their_weight_fits_its_budget() -> None:
    rows = [row(id_=n, args=json.dumps(["x" * 100_000])) for n in range(1, 11)]
    each = reading.weight(rows[0])
    taken = reading.take(rows, batch_max_bytes=64 * MIB, budget_bytes=3 * each + 1, read_at=1.0)
    assert [job.id for job in taken.jobs] == [1, 2, 3]
    assert taken.over_budget and taken.weight == 3 * each == sum(job.memory_bytes for job in taken.jobs)


def test_a_row_heavier_than_the_whole_budget_is_refused_not_held() -> None:
    heavy = "[" + ",".join(["[]"] * 100_000) + "]"  # 300 kB of text, ~10 MB estimated decoded
    rows = [row(id_=1, args=heavy), row(id_=2)]
    taken = reading.take(rows, batch_max_bytes=4 * MIB, budget_bytes=4 * MIB, read_at=1.0)
    assert [job.id for job in taken.jobs] == [1, 2]
    assert (
        taken.jobs[0].unreadable is not None and "over batch_max_bytes = 4194304" in taken.jobs[0].unreadable
    )
    assert taken.jobs[1].unreadable is None and not taken.over_budget


def test_a_row_that_fits_the_batch_but_not_what_is_left_is_held_back() -> None:
    taken = reading.take([row(id_=1)], batch_max_bytes=64 * MIB, budget_bytes=10, read_at=1.0)
    assert (taken.jobs, taken.over_budget) == ([], True)


def test_the_reader_asks_for_the_text_that_can_fit_and_fewer_rows_after_holding_back() -> None:
    reader = reading.Reader(64 * MIB)
    assert reader.params(500, 64 * MIB)["chunk_bytes"] == 16 * MIB  # 4 bytes a character at least
    heavy = "[" + ",".join(["1"] * 10_000) + "]"  # a value every 2 characters: ~52 bytes a character
    rows = [row(id_=n, args=heavy) for n in range(1, 4)] + [row(id_=4, sent=False, row_bytes=20_000)]
    params = reader.params(500, 64 * MIB)
    taken = reader.take(rows, 64 * MIB, 1.0)
    assert taken.over_budget
    assert reader.bytes_per_text_byte > 40
    params = reader.params(500, 64 * MIB)
    assert params["chunk_bytes"] < 2 * MIB
    assert params["limit"] == max(2 * 3, reading.MIN_LIMIT_CAP)  # twice the rows that fitted
    assert params["first_bytes"] == 16 * MIB  # the first row can always come
    full = reader.take([row(id_=n) for n in range(1, params["limit"] + 1)], 64 * MIB, 1.0)
    assert full.over_budget, "a capped select that came back full: more may be due"
    assert reader.params(500, 64 * MIB)["limit"] == 2 * params["limit"]
    reader.take([row(id_=1)], 64 * MIB, 1.0)
    assert reader.params(500, 64 * MIB)["limit"] == 500


def test_nothing_a_row_holds_raises() -> None:
    weird: list[Any] = [None, 5, 1.5, object(), b"\xff", "\ud800", ["a"], "\x00"]
    cases = [(field, value) for field in ("args", "kwargs", "options") for value in weird]
    rows = [row(id_=n, row_bytes=100, **{field: value}) for n, (field, value) in enumerate(cases, start=1)]
    taken = reading.take(rows, batch_max_bytes=64 * MIB, budget_bytes=64 * MIB, read_at=1.0)
    assert len(taken.jobs) == len(rows)
    assert all(job.unreadable for job in taken.jobs)  # none of these is JSON text


def shapes(n: int) -> Iterator[tuple[str, str]]:
    """JSON that costs CPython the most per byte of text (each value in its cheapest spelling)."""
    yield "empty objects", "[" + ",".join(["{}"] * n) + "]"
    yield "empty arrays", "[" + ",".join(["[]"] * n) + "]"
    yield "one-member objects", "[" + ",".join(['{"a":1}'] * n) + "]"
    yield "one-element arrays", "[" + ",".join(["[0]"] * n) + "]"
    yield "chains of arrays", "[" + ",".join(["[" * 60 + "0" + "]" * 60] * (n // 60)) + "]"
    yield "chains of objects", "[" + ",".join(['{"a":' * 60 + "0" + "}" * 60] * (n // 60)) + "]"
    yield "two-letter strings", "[" + ",".join(['"ab"'] * n) + "]"
    yield "distinct integers", "[" + ",".join(str(1000 + i) for i in range(n)) + "]"
    yield "floats", "[" + ",".join(f"{i}.5" for i in range(n)) + "]"
    yield "distinct keys", "[{" + ",".join(f'"{i}":{i}' for i in range(n)) + "}]"
    yield "one astral character", json.dumps(["a" * n + "😀"], ensure_ascii=False)


@pytest.mark.parametrize(("shape", "text"), list(shapes(50_000)), ids=[name for name, _ in shapes(1)])
def test_the_weight_is_an_upper_bound_of_the_decoded_job(shape: str, text: str) -> None:
    gc.collect()
    tracemalloc.start()
    try:
        taken = reading.take([row(args=text)], batch_max_bytes=1 << 30, budget_bytes=1 << 30, read_at=1.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    (job,) = taken.jobs
    assert job.unreadable is None, job.unreadable
    assert peak <= job.memory_bytes, f"{shape}: decoding took {peak} bytes, weighed {job.memory_bytes}"


def test_an_ordering_key_is_read_within_its_bounds() -> None:
    assert refusal(row(ordering_key="order-42")) is None
    taken = reading.take([row(ordering_key="é" * 255)], batch_max_bytes=MIB, budget_bytes=MIB, read_at=1.0)
    (job,) = taken.jobs
    assert job.ordering_key == "é" * 255  # 255 bytes in a LATIN1 database's check
    # A key the table's check would refuse (staged while drain_key_check was off) makes the row
    # unreadable, not a job with a key no backend carries; the reason never echoes the key.
    for bad in ("é" * 256, "k" * 256, " \t", b"\xff"):
        why = refusal(row(ordering_key=bad))
        assert why is not None and "ordering_key" in why, bad
        assert "kkk" not in why


@pytest.mark.parametrize(
    ("lanes", "led", "through_the_index"),
    [
        (8, 1, True),
        (8, 2, True),
        (8, 3, True),
        (8, 4, True),
        (8, 5, False),
        (16, 5, True),
        (16, 6, False),
        (256, 22, True),
        (256, 23, False),
        (256, 128, False),
    ],
)
def test_a_member_reads_through_the_lanes_index_while_it_leads_k_of_n_lanes_with_k_squared_at_most_2n(
    lanes: int, led: int, through_the_index: bool
) -> None:
    """Lane by lane a select reads k windows, walking about N / k and the rows the other members
    deleted: a red team measured 128 of 256 lanes through the index at 139 ms a select against 17
    walking; bench/bench_lanes.py, 2 drains of 8 lanes (4 each), 1.43 times one drain's rate
    through the index, 1.00 walking."""
    reader = reading.Reader(1 << 20)
    reader.lane_count, reader.led_count, reader.lanes_indexed = lanes, led, True
    assert (reader.indexed_lanes() == lanes) is through_the_index
    reader.lanes_indexed = False
    assert reader.indexed_lanes() is None
