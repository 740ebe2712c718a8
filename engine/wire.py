"""Typed, versioned msgpack frames for every socket in tandem (never pickle).

A message type is a slots dataclass registered under a short tag with `@message("tag")`. A frame
is the msgpack map `{"v": WIRE_VERSION, "t": tag, "d": {field: value}}`. Field values must be
msgpack-native (None, bool, int, float, str, bytes, list, dict) or another registered message
(nested dataclasses are encoded as frames' inner maps). Decoding checks the size limit before
unpacking, the version, the tag, the field names, and then runs the class's `__post_init__`
validation, so a malformed frame raises `WireError` and never reaches worker logic.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, TypeVar

import msgpack

WIRE_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024

_REGISTRY: dict[str, type] = {}
_TAGS: dict[type, str] = {}
_NESTED: dict[type, dict[str, type]] = {}

T = TypeVar("T")


class WireError(ValueError):
    """A frame that cannot be accepted: too large, not msgpack, unknown type, bad fields."""


def message(tag: str):
    """Register a dataclass as a wire message under `tag`."""

    def wrap(cls: type[T]) -> type[T]:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__} must be a dataclass")
        if tag in _REGISTRY and _REGISTRY[tag] is not cls:
            raise TypeError(f"wire tag {tag!r} already used by {_REGISTRY[tag].__name__}")
        _REGISTRY[tag] = cls
        _TAGS[cls] = tag
        return cls

    return wrap


def _nested_fields(cls: type) -> dict[str, type]:
    """Fields whose annotation is another registered message (resolved lazily, once)."""
    if cls not in _NESTED:
        hints = typing.get_type_hints(cls)
        nested = {}
        for f in dataclasses.fields(cls):
            hint = hints.get(f.name)
            for candidate in (hint, *typing.get_args(hint)):
                if isinstance(candidate, type) and (
                    candidate in _TAGS or hasattr(candidate, "from_dict")
                ):
                    nested[f.name] = candidate
                    break
        _NESTED[cls] = nested
    return _NESTED[cls]


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if hasattr(obj, "to_dict"):
            return obj.to_dict()
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_to_plain(x) for x in obj]
    if isinstance(obj, list):
        return [_to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    return obj


def _from_plain(cls: type[T], data: Any) -> T:
    """`cls` from its plain form; whatever is wrong with `data` (at any depth, in any
    nested message's own validation) is a WireError, never another exception type."""
    try:
        return _build(cls, data)
    except WireError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError, RecursionError) as e:
        raise WireError(f"{cls.__name__}: {e}"[:500]) from e


def _build(cls: type[T], data: Any) -> T:
    if hasattr(cls, "from_dict") and cls not in _TAGS:
        return cls.from_dict(data)
    if not isinstance(data, dict):
        raise WireError(f"{cls.__name__}: body must be a map, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:  # keys may be str or bytes: repr them, never sort mixed types
        raise WireError(f"{cls.__name__}: unknown fields {sorted(map(repr, unknown))[:10]}")
    kwargs = dict(data)
    for name, sub in _nested_fields(cls).items():
        if kwargs.get(name) is not None:
            kwargs[name] = _build(sub, kwargs[name])
    return cls(**kwargs)


def encode(msg: Any, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    tag = _TAGS.get(type(msg))
    if tag is None:
        raise TypeError(f"{type(msg).__name__} is not a registered wire message")
    frame = msgpack.packb({"v": WIRE_VERSION, "t": tag, "d": _to_plain(msg)}, use_bin_type=True)
    if len(frame) > max_bytes:
        raise WireError(f"{type(msg).__name__} frame is {len(frame)} bytes, over {max_bytes}")
    return frame


def decode(frame: bytes, max_bytes: int = DEFAULT_MAX_FRAME_BYTES, expect: type | None = None):
    """Decode one frame; raise WireError on anything malformed or unexpected."""
    if len(frame) > max_bytes:
        raise WireError(f"frame of {len(frame)} bytes is over the {max_bytes}-byte limit")
    try:
        outer = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise WireError(f"frame is not valid msgpack: {e}") from e
    if not isinstance(outer, dict) or set(outer) != {"v", "t", "d"}:
        raise WireError("frame must be a map with keys v, t, d")
    if outer["v"] != WIRE_VERSION:
        raise WireError(f"wire version {outer['v']!r} is not supported (this is {WIRE_VERSION})")
    cls = _REGISTRY.get(outer["t"]) if isinstance(outer["t"], str) else None
    if cls is None:
        raise WireError(f"unknown message type {outer['t']!r}")
    if expect is not None and not issubclass(cls, expect):
        raise WireError(f"expected {expect.__name__}, got {cls.__name__}")
    return _from_plain(cls, outer["d"])
