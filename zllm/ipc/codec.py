"""Messages to bytes and back. The only place that knows the wire format.

Every channel has a typed decoder for exactly the union of messages it may carry, so a frame
that is not one of them (garbage, a truncated frame, a wrong type) raises MessageError and
never yields a half-built object. Nothing here, or anywhere in zllm, unpickles.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")


# msgspec raises UnicodeDecodeError for invalid UTF-8 in a string and RecursionError for deeply
# nested data: both are just bad frames, not reasons for a process to die.
_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError)


class MessageError(ValueError):
    """A frame (or set of frames) that is not a valid message for its channel."""


class Codec(Generic[T]):
    def __init__(self, message_type: Any, max_frame_bytes: int | None = None) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(message_type)
        self._max_frame_bytes = max_frame_bytes  # a bigger frame is refused, not decoded

    def encode(self, message: Any) -> bytes:
        return self._encoder.encode(message)

    def decode(self, frame: bytes | memoryview) -> T:
        if self._max_frame_bytes is not None and len(frame) > self._max_frame_bytes:
            raise MessageError(f"a frame of {len(frame)} bytes exceeds the limit of {self._max_frame_bytes} bytes")
        try:
            return self._decoder.decode(frame)
        except _DECODE_ERRORS as error:
            raise MessageError(f"{type(error).__name__}: {error}"[:500]) from None

    def decode_frames(self, frames: list[bytes], expected: int = 1) -> T:
        """Decode a multipart message that must have exactly `expected` frames (the last is the body)."""
        if len(frames) != expected:
            raise MessageError(f"expected {expected} frame(s), got {len(frames)}")
        return self.decode(frames[-1])


def encode_json(value: Any) -> bytes:
    return msgspec.json.encode(value)


def decode_json(data: bytes | str, type_: type[T]) -> T:
    try:
        return msgspec.json.decode(data, type=type_)
    except _DECODE_ERRORS as error:
        raise MessageError(str(error)) from None


def convert(value: Any, type_: type[T]) -> T:
    """Build a typed object (e.g. SamplingParams) from plain data, validating types and values."""
    try:
        return msgspec.convert(value, type_)
    except msgspec.ValidationError as error:
        raise ValueError(str(error)) from None
