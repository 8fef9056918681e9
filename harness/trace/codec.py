"""JSON codec for the spec's frozen state values (the trace's optional state snapshots).

Encoding is structural: a dataclass becomes an object of its fields, an enum its
value, a tuple or frozenset a list (a frozenset sorted). Decoding is driven by
the dataclass field types of ``spec/state.py``, so a snapshot written by any
implementation is rebuilt into the same :class:`~spec.state.Observation` the
invariants read, and a malformed snapshot says which field is wrong.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


class CodecError(ValueError):
    """A snapshot value does not fit the spec's state type: ``path`` names the field."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def encode_value(value: Any) -> Any:
    """A JSON-ready form of a spec state value."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # A field marked ``metadata={"trace": False}`` is derived on reading (the checked
        # pairs of the stream claims) and not written.
        return {f.name: encode_value(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.metadata.get("trace", True)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, frozenset | set):
        return sorted(encode_value(v) for v in value)
    if isinstance(value, tuple | list):
        return [encode_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode_value(v) for k, v in value.items()}
    return value


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = get_type_hints(cls)
    return _HINTS[cls]


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def decode_value(kind: Any, raw: Any, path: str) -> Any:
    """Rebuild a value of type ``kind`` from its JSON form; raise :class:`CodecError`."""
    supertype = getattr(kind, "__supertype__", None)
    if supertype is not None:  # a NewType unit (TokenCount, PoolRow, ...)
        return decode_value(supertype, raw, path)
    origin = get_origin(kind)
    if origin is Union or origin is types.UnionType:
        options = get_args(kind)
        if raw is None and type(None) in options:
            return None
        errors: list[str] = []
        for option in options:
            if option is type(None):
                continue
            try:
                return decode_value(option, raw, path)
            except CodecError as error:
                errors.append(error.message)
        raise CodecError(path, " or ".join(errors) or f"unexpected {_describe(raw)}")
    if origin in (tuple, frozenset):
        if not isinstance(raw, list):
            raise CodecError(path, f"expected a list, got {_describe(raw)}")
        args = get_args(kind)
        if origin is frozenset:
            return frozenset(decode_value(args[0], v, f"{path}[{i}]") for i, v in enumerate(raw))
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode_value(args[0], v, f"{path}[{i}]") for i, v in enumerate(raw))
        if len(args) != len(raw):
            raise CodecError(path, f"expected {len(args)} items, got {len(raw)}")
        return tuple(decode_value(a, v, f"{path}[{i}]")
                     for i, (a, v) in enumerate(zip(args, raw, strict=True)))
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(raw)
        except ValueError:
            known = ", ".join(str(m.value) for m in kind)
            raise CodecError(path, f"unknown value {_describe(raw)} (known: {known})") from None
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        return decode_dataclass(kind, raw, path)
    if kind is bool:
        if not isinstance(raw, bool):
            raise CodecError(path, f"expected true or false, got {_describe(raw)}")
        return raw
    if kind is int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise CodecError(path, f"expected an integer, got {_describe(raw)}")
        return raw
    if kind is float:  # JSON keeps a Python float exactly (shortest repr round-trips)
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise CodecError(path, f"expected a number, got {_describe(raw)}")
        return float(raw)
    if kind is str:
        if not isinstance(raw, str):
            raise CodecError(path, f"expected a string, got {_describe(raw)}")
        return raw
    if kind is typing.Any:
        return raw
    if kind is object:  # a radix key's entry: a token, or a bigram written as a list
        return _as_tuples(raw)
    raise CodecError(path, f"no decoder for type {kind!r}")


def _as_tuples(raw: Any) -> Any:
    return tuple(_as_tuples(v) for v in raw) if isinstance(raw, list) else raw


def decode_dataclass(cls: type[T], raw: Any, path: str) -> T:
    """Rebuild dataclass ``cls``; fields with defaults may be omitted, unknown ones may not."""
    if not isinstance(raw, dict):
        raise CodecError(path, f"expected an object, got {_describe(raw)}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise CodecError(f"{path}.{unknown[0]}", "unknown field")
    values: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise CodecError(f"{path}.{name}", "missing field")
            continue
        values[name] = decode_value(hints[name], raw[name], f"{path}.{name}")
    return cls(**values)
