"""Typed, versioned msgpack frames for every socket in tandem: msgspec Structs, never pickle.

A message type is a `Frame` (a msgspec Struct: slots, unknown fields refused) registered under a
short tag with `@message("tag")`. Its annotations are its schema: types (strict: a bool is never
an int, a str never a number), bounds and lengths (`Annotated[int, Meta(ge=0)]`), nested Frames.
Rules across fields are the class's `check()`. A frame is the msgpack map
`{"v": WIRE_VERSION, "t": tag, "d": <the Struct as a map>}`.

Decoding a frame (`decode`): (1) its size, before a byte is unpacked; (2) the envelope, with
exactly the keys v, t, d (`d` left packed); the version; the tag; `expect`; (3) `d`, by the
tag's cached typed Decoder: types and constraints at every depth, and each Struct's `check()`
as it is built. Whatever is wrong is a `WireError`, never another exception type.

A value is checked once per process. Built in Python, `Frame.__post_init__` validates it
against the same annotations (`msgspec.convert`, which also makes declared tuples tuples) and
runs `check()`; decoded, the decoder did the first part and `__post_init__` only runs `check()`.
"""

from __future__ import annotations

import threading
from typing import Any, TypeVar

import msgspec

WIRE_VERSION = 2  # 2: msgspec Structs (typed fields); 1 was dataclasses checked by hand
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024

T = TypeVar("T")
_REGISTRY: dict[str, type[Frame]] = {}
_TAGS: dict[type, str] = {}
_DECODERS: dict[type, msgspec.msgpack.Decoder] = {}
_ENCODER = msgspec.msgpack.Encoder()
# Set while msgspec builds Structs whose fields it has validated (decode, and the convert in
# `Frame.__post_init__`), so their `__post_init__` does not validate them again.
_decoding = threading.local()


class WireError(ValueError):
    """A frame that cannot be accepted: too large, not msgpack, unknown type, bad fields."""


class Frame(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Base of every wire message and of the Structs nested in them (SamplingParams).

    Fields left at their defaults are not sent (`omit_defaults`): a field added with a default
    (a new request setting) leaves the frames that do not use it readable by a peer that
    predates it, so a rolling upgrade keeps serving; a frame that uses it is refused there as
    an unknown field, by name."""

    def __post_init__(self) -> None:
        if getattr(_decoding, "on", False):
            self.check()
            return
        _decoding.on = True
        try:  # the copy is built (and `check`ed) by msgspec from our fields, as if decoded
            checked = msgspec.convert(msgspec.structs.asdict(self), type(self))
        except msgspec.ValidationError as e:
            raise ValueError(f"{type(self).__name__}: {e}") from None
        finally:
            _decoding.on = False
        for name in self.__struct_fields__:
            msgspec.structs.force_setattr(self, name, getattr(checked, name))

    def check(self) -> None:
        """Rules across fields (raise ValueError); the fields themselves are already valid."""


def trusted(cls: type[T], *args: Any, **kwargs: Any) -> T:
    """`cls(*args, **kwargs)` with only its `check()`: for records a process builds from values
    it made itself and holds as valid (the engine's per-token `TokenMessage`s, a hot path: the
    full check costs ~15x the construction). Never for values from a client or a socket."""
    was = getattr(_decoding, "on", False)
    _decoding.on = True
    try:
        return cls(*args, **kwargs)
    finally:
        _decoding.on = was


class _Envelope(msgspec.Struct, forbid_unknown_fields=True):
    v: int
    t: str
    d: msgspec.Raw


_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)


def message(tag: str):
    """Register a Frame subclass as a wire message under `tag`."""

    def wrap(cls: type[T]) -> type[T]:
        if not issubclass(cls, Frame):
            raise TypeError(f"{cls.__name__} must be an engine.wire.Frame")
        if tag in _REGISTRY and _REGISTRY[tag] is not cls:
            raise TypeError(f"wire tag {tag!r} already used by {_REGISTRY[tag].__name__}")
        _REGISTRY[tag] = cls
        _TAGS[cls] = tag
        return cls

    return wrap


def encode(msg: Any, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    tag = _TAGS.get(type(msg))
    if tag is None:
        raise TypeError(f"{type(msg).__name__} is not a registered wire message")
    frame = _ENCODER.encode({"v": WIRE_VERSION, "t": tag, "d": msg})
    if len(frame) > max_bytes:
        raise WireError(f"{type(msg).__name__} frame is {len(frame)} bytes, over {max_bytes}")
    return frame


def decode(frame: bytes, max_bytes: int = DEFAULT_MAX_FRAME_BYTES, expect: type | None = None):
    """Decode one frame; raise WireError on anything malformed or unexpected."""
    if len(frame) > max_bytes:
        raise WireError(f"frame of {len(frame)} bytes is over the {max_bytes}-byte limit")
    was = getattr(_decoding, "on", False)
    _decoding.on = True
    try:
        outer = _ENVELOPE.decode(frame)
        if outer.v != WIRE_VERSION:
            raise WireError(f"wire version {outer.v} is not supported (this is {WIRE_VERSION})")
        cls = _REGISTRY.get(outer.t)
        if cls is None:
            raise WireError(f"unknown message type {outer.t!r:.80}")
        if expect is not None and not issubclass(cls, expect):
            raise WireError(f"expected {expect.__name__}, got {cls.__name__}")
        decoder = _DECODERS.get(cls)
        if decoder is None:
            decoder = _DECODERS[cls] = msgspec.msgpack.Decoder(cls)
        return decoder.decode(outer.d)
    except WireError:
        raise
    except Exception as e:  # noqa: BLE001 - msgspec's errors, RecursionError (deep nesting), ...
        raise WireError(f"malformed frame: {e}"[:500]) from e
    finally:
        _decoding.on = was
