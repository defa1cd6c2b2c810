"""Text out of generated tokens, for a stream: incremental detokenization and stop strings that never leak.

`TextStream` turns token ids into text pieces as they come: a piece is released once the decoded text is stable
(no half of a multi-byte character at its end) and cannot be the start of a stop string still being completed; when
a stop string appears, the text before it is the last piece and the stream is finished. Each token is decoded in a
short window of the tokens before it (the text of the window's tokens up to the new ones, then with them: the
difference is the new text), so a token costs the same at the end of a long generation as at its start, where
decoding the whole output each time would cost the square of its length. The tokens waiting for the rest of a
character are at most MAX_PENDING while what they decode to ends in more than one replacement character: a run of
tokens that never make valid UTF-8 (a model's garbage) is released as it decodes, replacement characters included,
rather than decoded again and again as it grows. Text ending in one replacement character is an incomplete character
at its end, as byte-level vocabularies make with tokens that end one character and begin the next: those wait for
the token that completes it, up to MAX_WAITING tokens. Streaming every piece and
decoding the whole output at once give the same text (the property tests check this over random stop strings
crossing token boundaries, and characters split over tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder gives for an incomplete UTF-8 sequence at the end
# UTF-8 takes at most 4 bytes a character, and a token at least one byte: a character split over tokens is whole by
# its 4th token, so 4 tokens that still end in an incomplete character hold some that never will be one (a special
# token, which gives no byte, inside a character is the exception: that character comes out as replacements)
MAX_PENDING = 4
# tokens that each end a character and begin the next (the text keeps ending in one incomplete character) wait this
# long for a token that ends on a character's end: real text gives one within a few; beyond, it is garbage after all
MAX_WAITING = 32
# tokens that gave no text are kept after the context up to this many (beyond: special tokens, skipped): enough for
# the last bytes of the context's last character (3) after a full window of tokens read at once (MAX_PENDING)
MAX_CONTEXT = 2 * MAX_PENDING


class TextStream:
    """Pieces of text from a growing list of token ids (see the module docstring)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()):
        self.decode = decode
        self.stops = [stop for stop in stops if stop]
        self.tokens: list[int] = []
        self.released = 0  # characters of the decoded text already given out
        self.stopped = False  # a stop string was found: nothing more comes
        self._text = ""  # the text of the tokens read: all but the pending ones
        # the last tokens read that gave text (and any read after them that gave none): the next are decoded after them
        self._context: list[int] = []
        self._pending: list[int] = []  # tokens not read yet (at most MAX_PENDING): part of a character, or no text

    def push(self, token: int) -> str:
        """Add a token; the text that can be released now ('' while it may still be part of a stop string)."""
        if self.stopped:
            return ""
        self.tokens.append(token)
        self._pending.append(token)
        new = self._new_text()
        if not new or new.endswith(REPLACEMENT):  # no text yet, or a character split across tokens: wait for more
            incomplete = new.endswith(REPLACEMENT) and not new.endswith(2 * REPLACEMENT)  # one character's start
            if self._stops_in(new.rstrip(REPLACEMENT)):  # a stop string whole before that start: nothing more comes
                self._take(new, len(self._pending))
            elif len(self._pending) < (MAX_WAITING if incomplete else MAX_PENDING):
                return ""
            else:
                self._settle(new)
        else:
            self._take(new, len(self._pending))
        return self._release(final=False)

    def finish(self) -> str:
        """The text held back at the end of the generation (a partial stop string that never completed)."""
        if self.stopped:
            return ""
        self._take(self._new_text(), len(self._pending))
        return self._release(final=True)

    def _new_text(self, pending: int | None = None) -> str:
        """The text of the first `pending` tokens not yet read (all by default), decoded after the context's."""
        context = self.decode(self._context)
        return self.decode(self._context + self._pending[:pending])[len(context) :]

    def _take(self, new: str, count: int) -> None:
        """Read the first `count` pending tokens, whose text is `new`."""
        self._text += new
        read, self._pending = self._pending[:count], self._pending[count:]
        if new:  # a token that gave no text (a special one skipped) is no context: "▁word" after it keeps its space
            self._context = read
        elif len(self._context) + len(read) <= MAX_CONTEXT:  # the rest of the context's last character, or special
            self._context = self._context + read  # tokens: kept after the context, so its bytes stay as they came

    def _settle(self, new: str) -> None:
        """MAX_PENDING tokens and still no whole text (`new`): read the first of them, before the last ones that may
        be the start of a character the next tokens complete (so that one comes out whole after garbage too), keeping
        as many as add text of their own; all of them when no such split keeps the text the same."""
        for kept in range(MAX_PENDING - 1, 0, -1):
            released = self._new_text(len(self._pending) - kept)
            if len(released) < len(new) and new.startswith(released):
                self._take(released, len(self._pending) - kept)
                return
        self._take(new, len(self._pending))  # text that never decodes whole, or tokens that give none (special ones)

    def _stops_in(self, new: str) -> bool:
        """Whether a stop string ends within `new`, the whole text of tokens not read yet (after what is read)."""
        text = self._text + new
        return any(text.find(stop, max(0, self.released - len(stop))) >= 0 for stop in self.stops)

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
