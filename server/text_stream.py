"""A generation's text as it streams: token pieces in, text out, with stop strings and UTF-8 boundaries handled
incrementally (each token costs work on its own bytes and the longest stop string, not on the whole text so far).

Rules, as llama-cpp-python's `create_completion` and llama-server apply them: a stop string ends the text where it
starts (the earliest one found wins) and is not part of it; text that could still become a stop string is held back
until it cannot; an incomplete UTF-8 sequence is held back until its last byte arrives, and dropped if the generation
ends first."""
from __future__ import annotations

import codecs


def _incomplete_tail(b: bytes) -> int:
    """How many bytes at the end of `b` start a UTF-8 sequence that is not complete yet."""
    for k in range(1, min(3, len(b)) + 1):
        c = b[-k]
        if c & 0xC0 == 0x80:
            continue  # a continuation byte: look further back for its lead byte
        need = 2 if c & 0xE0 == 0xC0 else 3 if c & 0xF0 == 0xE0 else 4 if c & 0xF8 == 0xF0 else 1
        return k if need > k else 0
    return 0


class TextStream:
    def __init__(self, stop: list[str] | None = None):
        self.stops = [s.encode("utf-8") for s in (stop or []) if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.buf = bytearray()
        self.sent = 0                 # bytes of buf handed out
        self.stopped_by = ""          # the stop string that ended the text, if one did
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="ignore")

    def push(self, piece: bytes) -> str:
        """Add a token's bytes; the text that can be handed out now ("" while held back). After a stop string was
        found, `stopped_by` is set and the text up to it is returned."""
        start = max(0, len(self.buf) - self.longest + 1)
        self.buf += piece
        if self.stops:
            hit, at = None, len(self.buf)
            for s in self.stops:
                i = self.buf.find(s, start)
                if 0 <= i < at:
                    hit, at = s, i
            if hit is not None:
                self.stopped_by = hit.decode("utf-8")
                return self._emit(max(at, self.sent), final=True)
        hold = _incomplete_tail(self.buf)
        for s in self.stops:  # hold back a tail that is the start of a stop string
            for k in range(min(len(s) - 1, len(self.buf) - self.sent), hold, -1):
                if self.buf.endswith(s[:k]):
                    hold = k
                    break
        end = len(self.buf) - hold
        return self._emit(end)

    def finish(self) -> str:
        """The generation ended without a stop string: what was held back (an incomplete UTF-8 tail is dropped)."""
        return self._emit(len(self.buf), final=True)

    def _emit(self, end: int, final: bool = False) -> str:
        out = self._decoder.decode(bytes(self.buf[self.sent:end]), final) if end > self.sent else \
            (self._decoder.decode(b"", True) if final else "")
        self.sent = max(self.sent, end)
        return out
