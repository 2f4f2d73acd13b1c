"""A batch's ``basic.publish`` frames (``amqp.frames``) and a Celery message's properties
(``celery.amqp_properties``) are the bytes py-amqp itself writes for the same message, which is
what kombu hands it when ``send_task`` publishes: compared byte for byte with py-amqp's own frame
writer and property encoder, on bodies around the ``frame_max`` boundaries, unicode names and
headers, and empty bodies. No broker."""

from __future__ import annotations

import datetime
import decimal
import itertools
from typing import Any

import amqp
import amqp.method_framing
import amqp.serialization
import pytest
from drain_adapters.amqp import frames as amqp_frames
from drain_adapters.celery import amqp_properties
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

FRAME_MAXES = (4096, 8192, 131_072)
LONE_SURROGATE = "\ud800"


class _Connection:
    """What py-amqp's frame writer reads of a connection."""

    def __init__(self, frame_max: int) -> None:
        self.frame_max = frame_max
        self.bytes_sent = 0


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: Any) -> None:
        self.written.append(bytes(data))


def py_amqp_writes(
    channel: int, exchange: str, routing_key: str, message: amqp.Message, frame_max: int, *, mandatory: bool
) -> bytes:
    """What py-amqp's ``basic_publish`` hands its transport for ``message``."""
    transport = _Transport()
    writer = amqp.method_framing.frame_writer(_Connection(frame_max), transport)
    arguments = amqp.serialization.dumps("Bssbb", (0, exchange, routing_key, mandatory, False))
    writer(1, channel, (60, 40), arguments, message)
    return b"".join(transport.written)


def ours(frames: amqp_frames.PublishFrames, chunk_bytes: int = amqp_frames.WRITE_CHUNK_BYTES) -> bytes:
    return b"".join(chunk.data for chunk in frames.writes(chunk_bytes))


short_names = st.text(max_size=60).filter(lambda text: len(text.encode()) <= 255)
header_text = st.text(max_size=30) | st.sampled_from(
    ["é\u2028", "日本語", "\U0001f600", LONE_SURROGATE + "x"]
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.sampled_from([0, 2**31 - 1, 2**31, -(2**31) + 1, -(2**31), 2**63 - 1, -(2**63)])
    | st.floats(allow_nan=False)
    | header_text,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
headers = st.dictionaries(
    header_text.filter(lambda key: len(key.encode("utf-8", "surrogatepass")) <= 255), json_values, max_size=8
)


def body_sizes(frame_max: int) -> st.SearchStrategy[int]:
    chunk = frame_max - amqp_frames.FRAME_OVERHEAD_BYTES
    around = st.builds(lambda n, delta: max(0, n * chunk + delta), st.integers(0, 3), st.integers(-2, 2))
    return around | st.integers(0, 3 * chunk)


@st.composite
def messages(draw: st.DrawFn) -> tuple[int, str, str, amqp.Message, int]:
    frame_max = draw(st.sampled_from(FRAME_MAXES))
    body = bytes(draw(body_sizes(frame_max)))
    properties = {
        "content_type": "application/json",
        "content_encoding": "utf-8",
        "application_headers": draw(headers),
        "delivery_mode": 2,
        "priority": draw(st.integers(0, 255)),
        "correlation_id": draw(short_names),
    }
    message = amqp.Message(body, **properties)
    return draw(st.integers(1, 65535)), draw(short_names), draw(short_names), message, frame_max


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages(), st.booleans(), st.sampled_from([1, 100, 4096, amqp_frames.WRITE_CHUNK_BYTES]))
@example((1, "", "celery", amqp.Message(b""), 4096), True, amqp_frames.WRITE_CHUNK_BYTES)
@example((7, "", "q", amqp.Message(b"x" * (4096 - 8)), 4096), True, 1)
@example((7, "", "q", amqp.Message(b"x" * (4096 - 7)), 4096), False, 1)
def test_a_messages_frames_are_py_amqps(
    drawn: tuple[int, str, str, amqp.Message, int], mandatory: bool, chunk_bytes: int
) -> None:
    channel, exchange, routing_key, message, frame_max = drawn
    frames = amqp_frames.PublishFrames(channel, frame_max)
    properties = amqp.Message._serialize_properties(message)
    frames.add(exchange, routing_key, properties, message.body, mandatory=mandatory)
    expected = py_amqp_writes(channel, exchange, routing_key, message, frame_max, mandatory=mandatory)
    assert ours(frames, chunk_bytes) == expected
    assert list(frames.writes(chunk_bytes)) == [(expected, 1)]  # one message: one chunk, whole


@settings(max_examples=50, deadline=None)
@given(st.lists(messages(), min_size=1, max_size=5))
def test_a_batch_is_its_messages_frames_in_order(
    drawn: list[tuple[int, str, str, amqp.Message, int]],
) -> None:
    """One channel, one frame_max; the method frame is built once per exchange and routing key."""
    frames = amqp_frames.PublishFrames(3, 4096)
    expected = b""
    for _channel, exchange, routing_key, message, _frame_max in drawn + drawn[:1]:
        frames.add(
            exchange, routing_key, amqp.Message._serialize_properties(message), message.body, mandatory=True
        )
        expected += py_amqp_writes(3, exchange, routing_key, message, 4096, mandatory=True)
    assert ours(frames, 1000) == expected
    assert frames.count == len(drawn) + 1


def message_frames(frames: amqp_frames.PublishFrames, body_bytes: int, routing_key: str = "q") -> bytes:
    """Add a message of ``body_bytes`` to ``frames``; return its frames alone."""
    alone = amqp_frames.PublishFrames(frames.channel, frames.frame_max)
    for each in (frames, alone):
        each.add("", routing_key, b"\x00\x00", b"x" * body_bytes, mandatory=True)
    return b"".join(chunk.data for chunk in alone.writes())


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 20_000), min_size=1, max_size=12),
    st.sampled_from([1, 100, 4096, 10_000, 50_000]),
)
@example([0, 0, 0], 1)
@example([3000, 3000, 3000], 6100)
def test_chunks_end_on_message_boundaries_and_say_how_many_they_carry(
    body_sizes: list[int], chunk_bytes: int
) -> None:
    """Each chunk is whole messages, the next ones in order, and says how many: a writer that stops
    between two chunks knows which messages went. A chunk stays within ``chunk_bytes`` unless it
    is one message larger than that; two neighbours would not have fitted in one."""
    frames = amqp_frames.PublishFrames(5, 4096)
    each = [message_frames(frames, size, routing_key=f"q{n % 3}") for n, size in enumerate(body_sizes)]
    chunks = list(frames.writes(chunk_bytes))
    assert sum(chunk.messages for chunk in chunks) == len(each) == frames.count
    first = 0
    for chunk in chunks:
        assert chunk.messages >= 1
        assert chunk.data == b"".join(each[first : first + chunk.messages])
        assert len(chunk.data) <= chunk_bytes or chunk.messages == 1
        first += chunk.messages
    for chunk, after in itertools.pairwise(chunks):
        assert len(chunk.data) + len(after.data) > chunk_bytes  # else one chunk would hold both
    assert b"".join(chunk.data for chunk in chunks) == b"".join(each)


def test_a_large_batch_is_a_few_chunks_of_whole_messages() -> None:
    frames = amqp_frames.PublishFrames(1, 131_072)
    for _ in range(60):
        frames.add("", "q", b"\x00\x00", b"x" * 200_000, mandatory=True)
    chunks = list(frames.writes())
    assert [chunk.messages for chunk in chunks] == [5] * 12  # 5 of ~200 KB within 1 MiB
    assert not list(amqp_frames.PublishFrames(1, 4096).writes())


def test_a_message_that_cannot_be_framed_leaves_nothing_behind() -> None:
    frames = amqp_frames.PublishFrames(1, 4096)
    frames.add("", "q", b"\x00\x00", b"first", mandatory=True)
    before = ours(frames)
    with pytest.raises(ValueError, match="over frame_max"):
        frames.add("", "q", b"\x00" * 4096, b"body", mandatory=True)
    with pytest.raises(ValueError, match="255"):
        frames.add("", "é" * 128, b"\x00\x00", b"body", mandatory=True)
    assert ours(frames) == before and frames.count == 1


def no_fallback() -> bytes:
    raise AssertionError("py-amqp's encoder was used: the fast path left a JSON value")


property_values = st.fixed_dictionaries(
    {"application_headers": headers},
    optional={
        "content_type": short_names,
        "content_encoding": short_names,
        "delivery_mode": st.integers(1, 2),
        "priority": st.integers(0, 255),
        "correlation_id": short_names,
        "reply_to": short_names | st.just(""),
        "expiration": st.integers(0, 2**32 - 1).map(str),
    },
)


@settings(max_examples=400, deadline=None)
@given(property_values)
@example({"application_headers": {}})
@example({"application_headers": {"k": LONE_SURROGATE, LONE_SURROGATE: [2**31, -(2**31), 2**31 - 1]}})
@example({"application_headers": {"timelimit": [30, 20.5], "stamps": {}, "eta": None}, "reply_to": ""})
def test_properties_are_py_amqps_bytes(properties: dict[str, Any]) -> None:
    expected = amqp.Message._serialize_properties(amqp.Message(b"", **properties))
    assert amqp_properties.encode(properties, no_fallback) == expected


@pytest.mark.parametrize(
    "properties",
    [
        {"application_headers": {"big": 2**63}},  # py-amqp raises over 64 bits: so must this
        {"application_headers": {"when": datetime.datetime(2026, 1, 1)}},
        {"application_headers": {"n": decimal.Decimal("1.5")}},
        {"timestamp": 1_700_000_000},
        {"priority": True},
    ],
    ids=["int-over-64-bits", "datetime", "decimal", "timestamp", "bool-priority"],
)
def test_anything_else_is_left_to_py_amqp(properties: dict[str, Any]) -> None:
    used: list[bool] = []

    def fallback() -> bytes:
        used.append(True)
        encoded: bytes = amqp.Message._serialize_properties(amqp.Message(b"", **properties))
        return encoded

    try:
        expected: bytes | type[BaseException] = fallback()
    except Exception as exc:  # py-amqp's own refusal, which must be the same
        expected = type(exc)
    used.clear()
    if isinstance(expected, bytes):
        assert amqp_properties.encode(properties, fallback) == expected
    else:
        with pytest.raises(expected):
            amqp_properties.encode(properties, fallback)
    assert used == [True]
