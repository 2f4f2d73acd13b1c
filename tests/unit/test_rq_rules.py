"""The RQ backend's build: every row becomes an RQ job RQ can read, or a rejection with a reason.

No sockets: ``RQAdapter.build`` and ``publish_batch``'s build step do no I/O.
"""

from __future__ import annotations

import datetime
import json
import math
import pickle
import uuid
import zlib
from typing import Any

import pytest
from drain_adapters import rq as rq_adapter
from drain_adapters.rq import message as rq_message
from drain_adapters.rq import rules as rq_rules
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from rq import job as rq_job
from rq import serializers
from rq import utils as rq_utils

from drain import backend, errors, models

ALLOWED = ["app.tasks.send", "app.tasks.send_email", "app.mail.send_email"]
NOW = rq_message.timestamp(datetime.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=datetime.UTC))


def adapter(
    serializer: str = "pickle", allowed: list[str] | None = ALLOWED, *, wildcards: bool = False
) -> rq_adapter.RQAdapter:
    values: dict[str, Any] = {"url": "redis://127.0.0.1:1/0", "serializer": serializer}
    if allowed is not None:
        values["allowed_jobs"] = allowed
    if wildcards:
        values["wildcards_with_checked_workers"] = True
    return rq_adapter.RQAdapter.from_options("default", values, publish_timeout_s=5)


def staged(
    job_name: str = "app.tasks.send",
    args: Any = (),
    kwargs: Any = None,
    queue: str = "q",
    options: Any = None,
) -> models.StagedJob:
    return models.StagedJob(
        id=7,
        job_id=uuid.uuid4(),
        job_name=job_name,
        args=args,
        kwargs=kwargs if kwargs is not None else {},
        queue=queue,
        backend="default",
        options=options if options is not None else {},
        created_at=datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC),
    )


def refusal(job: models.StagedJob, the_adapter: rq_adapter.RQAdapter | None = None) -> str:
    built, rejected = backend.build_each([job], lambda j: (the_adapter or adapter()).build(j, NOW), "default")
    assert not built, f"expected a rejection, built {built}"
    (result,) = rejected
    assert result.outcome is models.Outcome.REJECTED and result.error
    return result.error


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("print", "has no dot"),
        ("eval", "has no dot"),
        ("app.tasks.__builtins__", "not a plain identifier"),
        ("app.tasks._private", "not a plain identifier"),
        ("app.tasks.send.__class__", "not a plain identifier"),
        ("app..tasks", "not a plain identifier"),
        ("app.tasks.send email", "not a plain identifier"),
        ("app.tasks.ｓend", "not a plain identifier"),  # fullwidth: not ASCII
        ("app.tasks.os.system", "not in allowed_jobs"),
        ("app.tasks.check_output", "not in allowed_jobs"),  # what app.tasks may import
        ("os.system", "not in allowed_jobs"),
        ("app.mail.delete", "not in allowed_jobs"),
        ("", "non-empty dotted path"),
    ],
)
def test_job_names_an_rq_worker_must_not_resolve_are_refused(name: str, reason: str) -> None:
    assert reason in refusal(staged(job_name=name))


def test_builtin_and_underscore_rules_hold_without_allowed_jobs() -> None:
    open_adapter = adapter(allowed=None)
    assert "has no dot" in refusal(staged(job_name="exec"), open_adapter)
    assert "not a plain identifier" in refusal(staged(job_name="os.__dict__"), open_adapter)


def test_allowed_names_build() -> None:
    the_adapter = adapter()
    for name in ("app.tasks.send", "app.mail.send_email"):
        message = the_adapter.build(staged(job_name=name), NOW)
        assert message.fields[b"status"] == b"queued"


def test_double_star_is_refused_in_the_config() -> None:
    with pytest.raises(errors.ConfigError, match=r"allowed_jobs.*'\*\*' is not allowed"):
        adapter(allowed=["app.**"])
    with pytest.raises(errors.ConfigError, match=r"allowed_jobs.*'\*\*' is not allowed"):
        adapter(allowed=["app.**"], wildcards=True)


def test_a_wildcard_is_refused_in_one_line_that_says_what_to_do() -> None:
    """An existing config with app.tasks.* fails loudly instead of admitting what app.tasks imports."""
    with pytest.raises(errors.ConfigError) as refused:
        adapter(allowed=["app.tasks.*", "app.mail.send_?", "app.reports.build"])
    (problem,) = refused.value.problems
    assert "\n" not in problem
    assert problem.startswith("backends.default.allowed_jobs: 'app.tasks.*', 'app.mail.send_?': a wildcard")
    assert "`drain allowed-jobs app.tasks`" in problem
    assert "wildcards_with_checked_workers = true" in problem


def test_wildcards_are_accepted_only_on_the_operators_word_and_warn(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="drain_adapters.rq")
    the_adapter = adapter(allowed=["app.tasks.*"], wildcards=True)
    assert the_adapter.build(staged(job_name="app.tasks.anything"), NOW).fields[b"status"] == b"queued"
    assert "not in allowed_jobs" in refusal(staged(job_name="app.tasks.os.system"), the_adapter)
    assert [r.message.count("CheckedJob") for r in caplog.records] == [1]
    with pytest.raises(errors.ConfigError, match="only means something with allowed_jobs"):
        adapter(allowed=None, wildcards=True)


@pytest.mark.parametrize("entry", ["app", "app.tasks.send-mail", "app.tasks._private", "app.tasks.ｓend"])
def test_an_entry_no_row_could_match_is_refused(entry: str) -> None:
    with pytest.raises(errors.ConfigError, match=r"is not module\.function"):
        adapter(allowed=[entry])


def test_missing_allowed_jobs_warns_once_per_start(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="drain_adapters.rq")
    the_adapter = adapter(allowed=None)
    for _ in range(3):
        the_adapter.build(staged(job_name="any.module.function"), NOW)
    assert [r.message.count("no allowed_jobs") for r in caplog.records] == [1]


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"timeout": 0}, "timeout must be between 1 and"),
        ({"timeout": -5}, "timeout must be between 1 and"),
        ({"timeout": 2**31}, "timeout must be between 1 and"),  # the worker's signal.alarm overflows
        ({"timeout": 10**30}, "a huge integer"),
        ({"timeout": math.inf}, "must be an integer number of seconds"),
        ({"timeout": 1.5}, "must be an integer number of seconds"),
        ({"timeout": "1h"}, "must be an integer number of seconds"),
        ({"timeout": True}, "must be an integer number of seconds"),
        ({"ttl": 0}, "ttl must be between 1 and"),
        ({"ttl": -1}, "ttl must be between 1 and"),
        ({"ttl": 10**20}, "ttl must be between 1 and"),  # EXPIRE would refuse it inside EXEC
        ({"result_ttl": -2}, "result_ttl must be between 0 and"),
        ({"failure_ttl": 2**40}, "failure_ttl must be between 0 and"),
        ({"retry": {"max": 0}}, "max is 0"),
        ({"retry": {"max": "three"}}, "RQ option retry must be"),
        ({"retry": {"max": 3, "interval": -1}}, "interval -1"),
        ({"retry": {"max": 3, "interval": [10, -1]}}, "interval -1"),
        ({"retry": {"max": 3, "interval": [1.5]}}, "interval 1.5"),
        ({"retry": {"max": 3, "backoff": 2}}, "RQ option retry must be"),
        ({"retry": [3]}, "RQ option retry must be"),
        ({"at_front": "yes"}, "at_front must be true or false"),
        ({"at_front": 1}, "at_front must be true or false"),
        ({"description": 5}, "description must be a string"),
        ({"meta": [1, 2]}, "meta must be an object"),
        ({"priority": 5}, "unknown RQ option(s) priority"),
        ([1, 2], "options must be a JSON object"),
    ],
)
def test_options_rq_refuses_are_rejections(options: Any, reason: str) -> None:
    assert reason in refusal(staged(options=options))


def test_good_options_map_to_rq_fields() -> None:
    options = {
        "timeout": -1,
        "result_ttl": 0,
        "failure_ttl": -1,
        "ttl": 60,
        "retry": {"max": 3, "interval": [10, 60]},
        "at_front": True,
        "description": "hello",
        "meta": {"tenant": "a"},
    }
    message = adapter().build(staged(options=options), NOW)
    fields = message.fields
    assert fields[b"timeout"] == b"-1"
    assert fields[b"result_ttl"] == b"0"
    assert fields[b"failure_ttl"] == b"-1"
    assert fields[b"ttl"] == b"60"
    assert fields[b"retries_left"] == b"3"
    assert json.loads(fields[b"retry_intervals"]) == [10, 60]
    assert fields[b"description"] == b"hello"
    assert pickle.loads(fields[b"meta"]) == {"tenant": "a"}
    assert (message.ttl, message.at_front) == (60, True)
    assert fields[b"timeout"] and rq_message.DEFAULT_TIMEOUT_S == 180


def test_a_payload_the_serializer_cannot_write_is_a_rejection() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    assert "RecursionError" in refusal(staged(args=[deep]))
    assert "job_args must be a JSON array" in refusal(staged(args="text"))


def test_unencodable_text_is_a_rejection_in_the_build() -> None:
    # Postgres never hands out a lone surrogate, but a build must not leave it for the socket.
    assert "UnicodeEncodeError" in refusal(staged(options={"description": "\ud800"}))
    assert "UnicodeEncodeError" in refusal(staged(queue="q\ud800"))


# -- generated rows -------------------------------------------------------------------------------

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([10**300, -(10**300), 2**31 - 1, 2**31, -1, 0]),
    st.floats(allow_nan=False),
    st.sampled_from([math.inf, -math.inf]),  # what json.loads makes of 1e400 from jsonb
    st.text(),
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
option_value = (
    st.integers(min_value=-2, max_value=100)
    | st.sampled_from([1.5, -1.0, math.inf, "1h", True, [], {}, [1, 2], {"tenant": "a"}, "text"])
    | json_values
    | st.fixed_dictionaries({"max": json_values}, optional={"interval": json_values})
    | st.integers(min_value=-2, max_value=2**31 + 1)
)
known_options = st.dictionaries(st.sampled_from(rq_rules.KNOWN_OPTIONS), option_value, max_size=3)
option_values = st.dictionaries(
    st.sampled_from([*rq_rules.KNOWN_OPTIONS, "priority", ""]) | st.text(max_size=6),
    json_values
    | st.fixed_dictionaries({"max": json_values}, optional={"interval": json_values})
    | st.integers(min_value=-2, max_value=2**31 + 1),
    max_size=5,
)
names = st.one_of(
    st.sampled_from(["app.tasks.send", "app.mail.send"]),
    st.sampled_from(["app.tasks.send", "app.tasks.send_email"]),
    st.just("app.tasks.send"),
    st.text(max_size=30),
    st.lists(
        st.sampled_from(["app", "tasks", "send", "_x", "__builtins__", "os", "*", "ａ", ""]), max_size=5
    ).map(".".join),
)


def readable_by_rq(message: rq_message.RQMessage, loads: Any) -> None:
    """RQ itself can restore the job from the fields (a worker does exactly this)."""
    job = rq_job.Job(message.job_id.decode(), connection=object(), serializer=loads)  # type: ignore[arg-type]
    job.restore(message.fields)
    job._deserialize_data()
    assert job.origin
    assert job.get_status(refresh=False) == "queued"
    _ = job.meta


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=names,
    queue=st.text(max_size=20),
    args=st.lists(json_values, max_size=4) | json_values,
    kwargs=st.dictionaries(st.text(max_size=8), json_values, max_size=4) | json_values,
    options=known_options | known_options | option_values | st.just({}) | json_values,
    serializer=st.sampled_from(["pickle", "json"]),
)
def test_every_row_becomes_a_readable_job_or_a_reasoned_rejection(
    name: str, queue: str, args: Any, kwargs: Any, options: Any, serializer: str
) -> None:
    the_adapter = adapter(serializer, allowed=["app.tasks.*", "app.*.send"], wildcards=True)
    job = staged(job_name=name, args=args, kwargs=kwargs, queue=queue, options=options)
    built, rejected = backend.build_each([job], lambda j: the_adapter.build(j, NOW), "default")
    assert len(built) + len(rejected) == 1
    event("built" if built else "rejected")
    for result in rejected:
        assert result.error and result.error.strip() and "\n" not in result.error
    for _, message in built:
        loads = serializers.JSONSerializer if serializer == "json" else serializers.DefaultSerializer
        func_name, _, got_args, got_kwargs = loads.loads(zlib.decompress(message.fields[b"data"]))
        assert func_name == name
        assert isinstance(got_args, list) and isinstance(got_kwargs, dict)
        readable_by_rq(message, serializer)
        assert all(isinstance(k, bytes) and isinstance(v, bytes) for k, v in message.fields.items())


def test_the_job_class_is_found_by_its_path_and_by_its_former_one() -> None:
    # Workers started before the adapters became packages name drain_adapters.rq_job.CheckedJob.
    from drain_adapters.rq import job
    from rq import utils

    assert utils.import_attribute("drain_adapters.rq.job.CheckedJob") is job.CheckedJob
    assert utils.import_attribute("drain_adapters.rq_job.CheckedJob") is job.CheckedJob


@settings(max_examples=300, deadline=None)
@given(
    name=names,
    args=st.lists(json_values | st.text(min_size=70, max_size=90), max_size=4),
    kwargs=st.dictionaries(st.text(max_size=8), json_values | st.text(min_size=70, max_size=90), max_size=4),
)
def test_the_description_is_the_call_string_rq_writes(
    name: str, args: list[Any], kwargs: dict[str, Any]
) -> None:
    want = rq_utils.get_call_string(name, args, kwargs, max_length=rq_message.CALL_STRING_ARG_CHARS)
    assert rq_message.call_string(name, args, kwargs) == want
