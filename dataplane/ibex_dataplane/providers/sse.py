"""Incremental Server-Sent Events decoding for provider streams.

Owns the byte-level SSE framing (``text/event-stream``): the OpenAI-compatible adapter feeds it whatever the
socket delivered and gets back the ``data`` payload of every event completed so far, so each upstream chunk can
be forwarded the moment its blank line arrives. Comments (``:keep-alive``), ``event:``, ``id:`` and ``retry:``
fields are dropped; multi-line ``data`` is joined with ``\\n`` as the SSE specification says; ``\\n``, ``\\r\\n``
and ``\\r`` line endings are all accepted.
"""

from __future__ import annotations

__all__ = ["SSEDecoder"]


class SSEDecoder:
    """Feed bytes in arbitrary pieces; collect the ``data`` payloads of complete events."""

    __slots__ = ("_buffer", "_data", "_pending_cr")

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._data: list[bytes] = []
        self._pending_cr = False

    def feed(self, chunk: bytes) -> list[bytes]:
        """Add ``chunk``; return the data payloads of the events it completed, in order."""
        if self._pending_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]  # the "\n" of a "\r\n" split across two reads
        self._pending_cr = chunk.endswith(b"\r")
        if b"\r" in chunk:
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buffer = self._buffer
        buffer += chunk
        events: list[bytes] = []
        start = 0
        while (end := buffer.find(b"\n", start)) != -1:
            line = bytes(buffer[start:end])
            start = end + 1
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
            # comments and other fields carry nothing a chat stream needs
        del buffer[:start]
        return events

    def flush(self) -> list[bytes]:
        """At end of stream: the payload of an event whose closing blank line never came, if any."""
        line = bytes(self._buffer)
        self._buffer.clear()
        if line.startswith(b"data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(b" ") else value)
        events = [b"\n".join(self._data)] if self._data else []
        self._data = []
        return events
