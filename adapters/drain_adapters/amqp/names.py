"""What an AMQP 0-9-1 broker takes as a name or a header, checked before anything is sent: shared
by the RabbitMQ backend and Celery on AMQP. Pure functions, no I/O.

A row names its queue, and on the default exchange (``""``) the routing key *is* a queue name:

- an empty name matches no queue (it is the server-named queue of a declaration);
- ``amq.`` names are the broker's own: a client may not declare them, and the ones that exist
  are other connections' private queues (``amq.gen-...`` reply queues) or RabbitMQ's direct
  reply-to pseudo-queue, which closes the channel of a publisher that does not consume from it;
- a short string holds at most 255 bytes of UTF-8, without NUL;
- a name with a carriage return or a line feed matches no queue: RabbitMQ strips both from the
  names of the queues and exchanges it declares (so its CLI and management UI can delete them),
  and answers with the stripped name. A binding key keeps them, so only a routing key on the
  default exchange, which names a queue, is refused for them.

The headers ``CC`` and ``BCC`` route copies of a message to more routing keys: RabbitMQ closes
the channel unless each is an array of strings, and on the default exchange each entry is a queue
name under the same rules. Text that is not Unicode (a lone surrogate) has no UTF-8 form: py-amqp
would write it as invalid UTF-8 (``surrogatepass``) and pika raises mid-publish.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SHORT_STRING_BYTES = 255
RESERVED_PREFIX = "amq."
ROUTED_COPY_HEADERS = ("CC", "BCC")
DEFAULT_EXCHANGE = ""
HEADER_FRAME_OVERHEAD_BYTES = 7 + 1 + 2 + 2 + 8
"""A content header frame beyond its encoded properties: 7 bytes of frame header, the frame-end
octet, class id (2), weight (2) and body size (8). The whole frame must fit ``frame_max``."""


def unicode_problem(text: str, what: str) -> str | None:
    """Why ``text`` has no UTF-8 form, or None."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return f"{what} is not valid Unicode (a lone surrogate)"
    return None


def short_string_problem(text: str, what: str) -> str | None:
    """Why ``text`` is no AMQP short string (valid UTF-8, at most 255 bytes, no NUL), or None."""
    problem = unicode_problem(text, what)
    if problem:
        return problem
    size = len(text.encode())
    if size > SHORT_STRING_BYTES:
        return f"{what} is {size} bytes in UTF-8; AMQP allows {SHORT_STRING_BYTES}"
    if "\x00" in text:
        return f"{what} contains a NUL character"
    return None


def queue_name_problem(name: str, what: str = "queue") -> str | None:
    """Why no client can publish to or declare a queue named ``name``, or None."""
    problem = short_string_problem(name, what)
    if problem:
        return problem
    if name == "":
        return f"{what} name is empty: no queue has it"
    if name.startswith(RESERVED_PREFIX):
        return f"{what} name {name[:60]!r} is reserved: {RESERVED_PREFIX} names are the broker's own"
    return line_break_problem(name, what)


def line_break_problem(name: str, what: str) -> str | None:
    """Why no queue or exchange can be named ``name`` (a CR or LF, which RabbitMQ strips), or None."""
    if "\r" in name or "\n" in name:
        return f"{what} name {name[:60]!r} contains a line break, which RabbitMQ strips from names"
    return None


def routed_copies_problem(headers: Mapping[str, Any], exchange: str) -> str | None:
    """Why the ``CC``/``BCC`` headers would close the channel or reach a reserved queue, or None."""
    for key in ROUTED_COPY_HEADERS:
        copies = headers.get(key)
        if copies is None:
            continue
        if not (isinstance(copies, list) and all(isinstance(name, str) for name in copies)):
            return f"header {key} must be an array of queue names (strings)"
        for name in copies:
            if exchange == DEFAULT_EXCHANGE:
                problem = queue_name_problem(name, f"a queue in header {key}")
            else:
                problem = short_string_problem(name, f"a routing key in header {key}")
            if problem:
                return problem
    return None


def header_text_problem(value: Any, path: str) -> str | None:
    """Why a header value (JSON: nested arrays and objects) holds text with no UTF-8 form, or None.
    Iterative: a value nested however deep is walked without recursion."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            problem = unicode_problem(item, where)
            if problem:
                return problem
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and (problem := unicode_problem(key, f"a key in {where}")):
                    return problem
                stack.append((child, f"{where}.{str(key)[:40]!r}"))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{index}]") for index, child in enumerate(item))
    return None
