"""Text out of generated tokens, for a stream: incremental detokenization and stop strings that never leak.

`TextStream` turns token ids into text pieces as they come: a piece is released once the decoded text is stable
(no half of a multi-byte character at its end) and cannot be the start of a stop string still being completed; when
a stop string appears, the text before it is the last piece and the stream is finished. Each token is decoded in a
short window of the tokens before it (the text of the window's tokens up to the new ones, then with them: the
difference is the new text), so a token costs the same at the end of a long generation as at its start, where
decoding the whole output each time would cost the square of its length. Streaming every piece and
decoding the whole output at once give the same text (the property tests check this over random stop strings
crossing token boundaries).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder gives for an incomplete UTF-8 sequence at the end


class TextStream:
    """Pieces of text from a growing list of token ids (see the module docstring)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()):
        self.decode = decode
        self.stops = [stop for stop in stops if stop]
        self.tokens: list[int] = []
        self.released = 0  # characters of the decoded text already given out
        self.stopped = False  # a stop string was found: nothing more comes
        self._text = ""  # the text of tokens[:_read]
        self._prefix = 0  # the window: tokens[_prefix:_read] give the context the next tokens are decoded in
        self._read = 0

    def push(self, token: int) -> str:
        """Add a token; the text that can be released now ('' while it may still be part of a stop string)."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        new = self._new_text()
        if new.endswith(REPLACEMENT):  # a character split across tokens: wait for the rest of it
            return ""
        self._take(new)
        return self._release(final=False)

    def finish(self) -> str:
        """The text held back at the end of the generation (a partial stop string that never completed)."""
        if self.stopped:
            return ""
        self._take(self._new_text())
        return self._release(final=True)

    def _new_text(self) -> str:
        """The text of the tokens not yet read, decoded after those of the window before them."""
        context = self.decode(self.tokens[self._prefix : self._read])
        return self.decode(self.tokens[self._prefix :])[len(context) :]

    def _take(self, new: str) -> None:
        self._text += new
        if new:  # a token that gave no text (a special one skipped) is no context: "▁word" after it keeps its space
            self._prefix, self._read = self._read, len(self.tokens)

    @property
    def text(self) -> str:
        """All text released so far."""
        return self._text[: self.released]

    def _release(self, *, final: bool) -> str:
        text = self._text
        found = [index for stop in self.stops if (index := text.find(stop, max(0, self.released - len(stop)))) >= 0]
        if found:
            end = min(found)
            self.stopped = True
        elif final:
            end = len(text)
        else:
            end = len(text) - self._held_back(text)
        end = max(end, self.released)
        piece, self.released = text[self.released : end], end
        return piece

    def _held_back(self, text: str) -> int:
        """Characters at the end of `text` that begin some stop string (released only once it cannot complete)."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    longest = max(longest, size)
                    break
        return longest


__all__ = ["TextStream"]
