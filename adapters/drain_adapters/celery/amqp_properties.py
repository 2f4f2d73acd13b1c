"""A Celery message's AMQP properties (the headers table among them) encoded as py-amqp encodes
them for kombu, byte for byte, in a fraction of its time.

py-amqp writes the property flags, then each property present in ``amqp.Message.PROPERTIES``
order; a table is its size (long) and its entries (a short-string key, a type octet, the value),
with py-amqp's choice of types: text and bytes as ``S`` (UTF-8, ``surrogatepass``), ``t`` for a
bool, ``I`` for an int within +-2147483647 and ``L`` beyond, ``d`` for a float, ``F`` for a dict,
``A`` for a list or tuple, ``V`` for None. Celery's headers and the row's ``headers`` option
(JSON) hold nothing else. Any other value, or one out of range, is left to py-amqp's own encoder
(``fallback``), which then encodes or refuses the whole message as it always did.
tests/unit/test_amqp_frames.py checks the two agree on whatever hypothesis generates.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from typing import Any

import amqp

_LONG = struct.Struct(">I")
_SHORT = struct.Struct(">H")
_ITEM_HEAD = struct.Struct(">cI")  # a text item: "S", its size
_TEXT_HEAD = _ITEM_HEAD.pack
_INT = struct.Struct(">ci")
_LONG_INT = struct.Struct(">cq")
_FLOAT = struct.Struct(">cd")
_TRUE, _FALSE, _VOID = b"t\x01", b"t\x00", b"V"
INT32_LIMIT = 2147483647  # py-amqp writes ints beyond +- this as 64-bit
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

SHORT_STRINGS = frozenset(
    (
        "content_type", "content_encoding", "correlation_id", "reply_to", "expiration", "message_id",
        "type", "user_id", "app_id", "cluster_id",
    )
)  # fmt: skip
OCTETS = frozenset(("delivery_mode", "priority"))
ORDER: tuple[str, ...] = tuple(name for name, _kind in amqp.Message.PROPERTIES)
"""The properties in the order py-amqp writes them, the first flag bit first."""


class _Unusual(Exception):
    """A value this encoder leaves to py-amqp's."""


_KEYS: dict[str, bytes] = {}  # table keys as short strings (Celery's own names, mostly)
MAX_KEYS = 1024


def _key(key: Any) -> bytes:
    """A table key as a short string (its length octet first), as py-amqp writes it."""
    if type(key) is str:
        known = _KEYS.get(key)
        if known is not None:
            return known
        encoded = key.encode("utf-8", "surrogatepass")
    elif type(key) is bytes:
        encoded = key
    else:
        raise _Unusual
    if len(encoded) > 255:
        raise _Unusual
    short = bytes((len(encoded),)) + encoded
    if type(key) is str and len(_KEYS) < MAX_KEYS:
        _KEYS[key] = short
    return short


def _table(table: Mapping[Any, Any]) -> bytes:
    """A table, its size first. Text and None, most of Celery's values, are written inline."""
    parts: list[bytes] = []
    extend = parts.extend
    keys = _KEYS
    text_head = _TEXT_HEAD
    for key, value in table.items():
        short = keys.get(key) if type(key) is str else None
        if short is None:
            short = _key(key)
        kind = type(value)
        if kind is str:
            encoded = value.encode("utf-8", "surrogatepass")
            extend((short, text_head(b"S", len(encoded)), encoded))
        elif value is None:
            extend((short, _VOID))
        else:
            extend((short, _item(value)))
    data = b"".join(parts)
    return _LONG.pack(len(data)) + data


def _item(value: Any) -> bytes:
    """One value of a table or an array: its type octet, then the value."""
    kind = type(value)
    if kind is str or kind is bytes:
        encoded: bytes = value.encode("utf-8", "surrogatepass") if kind is str else value
        return _ITEM_HEAD.pack(b"S", len(encoded)) + encoded
    if kind is bool:
        return _TRUE if value else _FALSE
    if kind is int:
        if -INT32_LIMIT <= value <= INT32_LIMIT:
            return _INT.pack(b"I", value)
        if INT64_MIN <= value <= INT64_MAX:
            return _LONG_INT.pack(b"L", value)
        raise _Unusual
    if kind is float:
        return _FLOAT.pack(b"d", value)
    if kind is dict:
        return b"F" + _table(value)
    if kind is list or kind is tuple:
        data = b"".join([_item(element) for element in value])
        return b"A" + _LONG.pack(len(data)) + data
    if value is None:
        return _VOID
    raise _Unusual


def encode(properties: Mapping[str, Any], fallback: Callable[[], bytes]) -> bytes:
    """The property flags and list of ``properties`` (an ``amqp.Message``'s), as py-amqp's
    ``_serialize_properties`` writes them; ``fallback()`` (py-amqp's own) for what it leaves."""
    flags = 0
    out: list[bytes] = [b""]  # the flags, once known
    try:
        for bit, name in enumerate(ORDER):
            value = properties.get(name)
            if value is None:
                continue
            flags |= 1 << (15 - bit)
            if name in SHORT_STRINGS:
                kind = type(value)
                if kind is str:
                    encoded = value.encode("utf-8", "surrogatepass")
                elif kind is bytes or not value:  # py-amqp writes a falsy value as ""
                    encoded = value or b""
                else:
                    raise _Unusual
                if len(encoded) > 255:
                    raise _Unusual
                out.append(bytes((len(encoded),)) + encoded)
            elif name in OCTETS:
                if type(value) is not int or not 0 <= value <= 255:
                    raise _Unusual
                out.append(bytes((value,)))
            elif name == "application_headers" and type(value) is dict:
                out.append(_table(value))
            else:  # a timestamp, another type, a property this encoder does not know
                raise _Unusual
    except _Unusual:
        return fallback()
    out[0] = _SHORT.pack(flags)
    return b"".join(out)
