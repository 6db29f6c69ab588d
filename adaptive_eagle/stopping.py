"""Where one request's output ends, and its text as it grows: the one home of stop strings.

Owns: `TextStream` (incremental detokenisation that emits only text that can no longer change: never
a possible beginning of a stop string, never half a UTF-8 character; it finds the first stop string
by looking only at each new piece of text plus a tail as long as the longest stop string minus one)
and `StopCheck` (a request's end: after its first EOS (kept), after the token that completes its
first stop string (kept), or at max_tokens, whichever comes first, token by token, so that a verify
step that commits several tokens ends exactly where plain decoding would). Must not touch: models,
caches, tokenizers' internals (a `decode(token ids) -> str` is all it is given), networking.
Plain Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

INCOMPLETE = "\ufffd"  # what a decoder shows for the bytes of a character not finished yet


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """`text` up to its first stop string (the stop string excluded); all of it when none occurs."""
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return text[: min(hits)] if hits else text


class TextStream:
    """One request's text, token by token. `push` returns the new text that can be shown; once a stop
    string completes, `stop_at` says how many pushed tokens reach it and later pushes add nothing.
    `finish` decodes the kept tokens once more, whole, and returns what was not shown yet."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Iterable[str] = ()) -> None:
        self.decode, self.stop = decode, tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # a stop string's longest proper prefix
        self.ids: list[int] = []
        self.text = ""  # decoded so far (pieces that end on a whole character)
        self.emitted = ""
        self.stop_at: int | None = None  # tokens up to and including the one that completed a stop string
        self._cut: int | None = None  # where the first stop string starts in `text`
        self._prefix = self._read = 0  # decode window: ids[_prefix:_read] decode to `_prefix_text`
        self._prefix_text = ""

    @property
    def stopped(self) -> bool:
        return self.stop_at is not None

    def _append(self, token: int) -> str:
        """The text `token` adds ("" while it leaves a character unfinished). Decodes a short window
        that starts a few tokens back, so a tokenizer that joins or cleans across tokens is followed."""
        self.ids.append(token)
        new = self.decode(self.ids[self._prefix:])
        if len(new) <= len(self._prefix_text) or new.endswith(INCOMPLETE):
            return ""
        piece = new[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self.ids)
        self._prefix_text = self.decode(self.ids[self._prefix:self._read])
        return piece

    def _find_stop(self, piece: str) -> None:
        """A stop string that ends in the newest piece (none ended earlier: only that piece and a tail of
        `hold` characters before it can hold one)."""
        start = max(0, len(self.text) - len(piece) - self.hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self._cut, self.stop_at = min(hits), len(self.ids)

    def push(self, token_ids: Iterable[int]) -> str:
        """Feed tokens; returns the text that became final. Tokens after a completed stop string are
        ignored."""
        for t in token_ids:
            if self.stopped:
                break
            piece = self._append(int(t))
            if piece:
                self.text += piece
                if self.stop:
                    self._find_stop(piece)
        shown = self.text[: self._cut] if self.stopped else self.text[: max(0, len(self.text) - self.hold)]
        if len(shown) <= len(self.emitted) or not shown.startswith(self.emitted):
            return ""
        delta, self.emitted = shown[len(self.emitted):], shown
        return delta

    def finish(self, token_ids: Sequence[int]) -> tuple[str, str]:
        """(the whole text of `token_ids`, decoded at once and cut at the first stop string; the part of it
        not shown yet)."""
        text = cut_at_stop(self.decode(list(token_ids)), self.stop)
        return text, self.rest_of(text)

    def rest_of(self, text: str) -> str:
        """The part of the whole text (decoded at once, cut at its stop string) not shown yet ("" when the
        text shown so far is not a prefix of it)."""
        return text[len(self.emitted):] if text.startswith(self.emitted) else ""


@dataclass(frozen=True)
class Committed:
    """What one verify step adds to a request's output."""

    token_ids: tuple[int, ...]  # the step's tokens that are kept
    text: str  # text that became final with them ("" when nobody asked for text)
    finish: str | None  # "stop" (EOS or a stop string) | "length" | None: decoding goes on


class StopCheck:
    """A request's stop conditions over the tokens it commits, step by step. `text`: the request's
    TextStream (None: no stop strings and no text wanted)."""

    def __init__(self, eos_ids: set[int], max_tokens: int, text: TextStream | None) -> None:
        self.eos_ids, self.max_tokens, self.text = eos_ids, max_tokens, text
        self.kept: list[int] = []
        self.finish: str | None = None

    def commit(self, new: Sequence[int]) -> Committed:
        """Keep the part of `new` that plain decoding would have produced before stopping."""
        if self.finish is not None:
            raise RuntimeError("this request has finished")
        part = list(new[: self.max_tokens - len(self.kept)])
        eos = next((i for i, t in enumerate(part) if t in self.eos_ids), None)
        body = part if eos is None else part[:eos]
        delta = ""
        if self.text is not None:
            delta = self.text.push(body)
            if self.text.stopped:
                part, eos = part[: self.text.stop_at - len(self.kept)], None
                self.finish = "stop"
        if eos is not None:
            part, self.finish = part[: eos + 1], "stop"
        self.kept.extend(part)
        if self.finish is None and len(self.kept) >= self.max_tokens:
            self.finish = "length"
        return Committed(tuple(part), delta, self.finish)
