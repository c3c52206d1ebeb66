"""Request decoding that never fails inside grpc: a message that does not parse becomes a
`Malformed` value, which the error interceptor turns into INVALID_ARGUMENT.

grpc.aio decodes a request before any interceptor code runs; a deserializer that raises
(google.protobuf.message.DecodeError: invalid UTF-8 in a string field, a truncated varint)
ends the call as UNKNOWN with a traceback logged at ERROR. `safe_deserializer` catches that,
and names the field when the cause is a string that is not UTF-8 (found by walking the wire
format against the message's descriptor).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

_MAX_DEPTH = 32


@dataclass(frozen=True)
class Malformed:
    """A request that could not be decoded, with the reason to give the caller."""

    message: str


def safe_deserializer(deserialize: Callable[[bytes], Any] | None
                      ) -> Callable[[bytes], Any] | None:
    """`deserialize`, returning a Malformed instead of raising DecodeError."""
    if deserialize is None:
        return None
    descriptor: Descriptor | None = getattr(getattr(deserialize, "__self__", None),
                                            "DESCRIPTOR", None)

    def decode(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as exc:
            return Malformed(describe_failure(descriptor, data, exc))
    return decode


def describe_failure(descriptor: Descriptor | None, data: bytes, exc: Exception) -> str:
    """Why `data` did not decode as `descriptor`'s message, for the caller."""
    if descriptor is None:
        return f"the request could not be decoded: {exc}"
    path = invalid_utf8_field(descriptor, data)
    if path is not None:
        return (f"malformed {descriptor.full_name}: field {path!r} is not valid UTF-8 (string "
                "fields must be UTF-8)")
    return f"malformed {descriptor.full_name}: not a valid encoding of the message ({exc})"


def invalid_utf8_field(descriptor: Descriptor, data: bytes, depth: int = 0) -> str | None:
    """The dotted path of the first string field in `data` whose bytes are not UTF-8 (map
    entries show as their map field), or None when there is none or the bytes do not parse."""
    pos, end = 0, len(data)
    try:
        while pos < end:
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                length, pos = _varint(data, pos)
                chunk, pos = data[pos:pos + length], pos + length
                found = _in_field(descriptor.fields_by_number.get(number), chunk, depth)
                if found is not None:
                    return found
            else:
                return None  # groups or garbage: no field to name
    except IndexError:
        return None
    return None


def _in_field(field: FieldDescriptor | None, chunk: bytes, depth: int) -> str | None:
    if field is None:
        return None
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            chunk.decode("utf-8")
        except UnicodeDecodeError:
            return field.name
        return None
    if field.type == FieldDescriptor.TYPE_MESSAGE and depth < _MAX_DEPTH:
        inner = invalid_utf8_field(field.message_type, chunk, depth + 1)
        if inner is not None:
            is_map = field.message_type.GetOptions().map_entry
            return field.name if is_map else f"{field.name}.{inner}"
    return None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")
