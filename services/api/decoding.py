"""Request bytes -> protobuf messages, never raising: an undecodable request becomes an ``Undecodable`` marker.

gRPC calls a handler's request deserializer before the handler runs; a deserializer that raises gives the caller
UNKNOWN and logs a traceback per call. ``tolerant_deserializer`` returns ``Undecodable`` instead, carrying a
message that names the offending field (``request_id: not valid UTF-8``, ``prompt.text: ...``,
``stop_strings[1]: ...``), found by ``describe_undecodable`` walking the protobuf wire format against the
message's descriptor; the handlers answer it with INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

M = TypeVar("M", bound=Message)

_VARINT, _FIXED64, _LENGTH, _START_GROUP, _END_GROUP, _FIXED32 = range(6)
_MAX_GROUP_DEPTH = 64  # unknown nested groups are skipped iteratively up to this depth
# fields the walk reads at most (a request of millions of tiny fields is answered without naming one): it runs
# where gRPC deserializes, on the serving event loop, so it stays bounded (< 1 ms) whatever the request holds
MAX_WALKED_FIELDS = 4096


@dataclass(frozen=True, slots=True)
class Undecodable:
    """A request that protobuf refused to parse; ``message`` is ``field: problem`` for the caller."""

    message: str


class _Malformed(Exception):
    """The wire format itself is broken (truncated, bad tag or wire type)."""


class _Unwalked(Exception):
    """The walk read ``MAX_WALKED_FIELDS`` fields without finding the problem."""


def tolerant_deserializer(cls: type[M]) -> Callable[[bytes], M | Undecodable]:
    """A gRPC request deserializer for ``cls`` that returns ``Undecodable`` where ``cls.FromString`` raises."""
    descriptor = cls.DESCRIPTOR

    def deserialize(data: bytes) -> M | Undecodable:
        try:
            return cls.FromString(data)
        except Exception as exc:  # DecodeError, or anything else the parser raises: never out of the deserializer
            return Undecodable(describe_undecodable(data, descriptor, exc))

    return deserialize


def describe_undecodable(data: bytes, descriptor: Descriptor, error: BaseException | None = None) -> str:
    """``field: problem`` for bytes that do not parse as ``descriptor``'s message (``request: ...`` when the
    problem is not in one field)."""
    try:
        problem = _first_problem(data, descriptor, "", [MAX_WALKED_FIELDS])
    except _Malformed as exc:
        return f"request: not a valid {descriptor.full_name} ({exc})"
    except _Unwalked:
        problem = None
    if problem is not None:
        return problem
    detail = f" ({error})" if error is not None else ""
    return f"request: not a valid {descriptor.full_name}{detail}"


def _first_problem(data: bytes, descriptor: Descriptor, prefix: str, budget: list[int]) -> str | None:
    """The first field of ``data`` (a message of type ``descriptor``) whose value is undecodable, as
    ``path: problem``; None if every known string and message field decodes. Raises ``_Malformed``, and
    ``_Unwalked`` once it has read ``budget[0]`` fields (nested ones included)."""
    seen: dict[int, int] = {}  # field number -> occurrences so far (the index of a repeated field's element)
    pos = 0
    while pos < len(data):
        budget[0] -= 1
        if budget[0] < 0:
            raise _Unwalked
        tag, pos = _varint(data, pos)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise _Malformed(f"field number 0 at byte {pos}")
        if wire != _LENGTH:
            pos = _skip(data, pos, number, wire, budget)
            continue
        size, pos = _varint(data, pos)
        end = pos + size
        if end > len(data):
            raise _Malformed(f"field {number} is truncated")
        value = data[pos:end]
        pos = end
        field = descriptor.fields_by_number.get(number)
        if field is None:
            continue  # an unknown field: kept by protobuf, never a decoding problem
        index = seen.get(number, 0)
        seen[number] = index + 1
        path = prefix + _field_path(field, index)
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                return f"{path}: not valid UTF-8"
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            try:
                inner = _first_problem(value, field.message_type, path + ".", budget)
            except _Malformed as exc:
                return f"{path}: not a valid {field.message_type.full_name} ({exc})"
            if inner is not None:
                return inner
    return None


def _field_path(field: FieldDescriptor, index: int) -> str:
    """``name``, ``name[i]`` for a repeated field, ``oneof.name`` for a member of a (real) oneof."""
    name = f"{field.name}[{index}]" if field.is_repeated else field.name
    oneof = field.containing_oneof
    synthetic = oneof is not None and len(oneof.fields) == 1 and oneof.name == f"_{field.name}"  # proto3 optional
    return f"{oneof.name}.{name}" if oneof is not None and not synthetic else name


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise _Malformed("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _skip(data: bytes, pos: int, number: int, wire: int, budget: list[int]) -> int:
    """The position after a value that is not length-delimited (after the whole group for ``_START_GROUP``; each
    field in it counted in ``budget``)."""
    groups: list[int] = []  # field numbers of the groups open around the current value
    while True:
        if wire == _VARINT:
            pos = _varint(data, pos)[1]
        elif wire in (_FIXED64, _FIXED32):
            pos += 8 if wire == _FIXED64 else 4
        elif wire == _LENGTH:
            size, pos = _varint(data, pos)
            pos += size
        elif wire == _START_GROUP:
            groups.append(number)
            if len(groups) > _MAX_GROUP_DEPTH:
                raise _Malformed("groups nested too deeply")
        elif wire == _END_GROUP:
            if not groups or groups.pop() != number:
                raise _Malformed(f"unmatched end of group {number}")
        else:
            raise _Malformed(f"invalid wire type {wire} of field {number}")
        if pos > len(data):
            raise _Malformed(f"field {number} is truncated")
        if not groups:
            return pos
        budget[0] -= 1
        if budget[0] < 0:
            raise _Unwalked
        tag, pos = _varint(data, pos)
        number, wire = tag >> 3, tag & 7
