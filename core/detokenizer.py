"""Per-stream text output: incremental detokenization and stop strings.

Both run once per generated token per stream in the caller's process, so they stay small: the
detokenizer leans on the Rust `DecodeStream`, the matcher advances one automaton per stop string
over the new characters only.
"""
from __future__ import annotations

import functools

from tokenizers.decoders import DecodeStream

from .tokenizer import Tokenizer

# Prime with at least this many prompt tokens (fewer when the prompt is shorter), and give up looking
# for a tail that decodes to whole characters past the longer length.
_PRIME_MIN_TOKENS = 4
_PRIME_MAX_TOKENS = 16
_REPLACEMENT = "\ufffd"
_INVALID_PREFIX = "Invalid prefix encountered"


class IncrementalDetokenizer:
    """Turns generated token ids into text as soon as the text is final.

    The stream is primed with the prompt's tail so the first generated token decodes as it does in
    context (a sentencepiece word keeps its leading space). Text is held back while it ends in an
    incomplete UTF-8 sequence; `flush` gives what is still held when the request ends. The pieces
    concatenate to the decode of the generated ids in the context of the prompt tail, which for
    byte-level tokenizers is `tokenizer.decode(output_ids)` itself.
    """

    __slots__ = ("_backend", "_skip_special", "_stream", "_context", "_held_ids", "_added", "_prev_added")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = False):
        """`spaces_between_special_tokens`: put a space between an added token (e.g. `<|im_end|>`) and
        the text next to it, as transformers' slow tokenizers and vLLM's slow detokenizer do (the
        fast decoders join them without one); it matters only when special tokens are not skipped."""
        self._backend = tokenizer.backend_tokenizer
        self._skip_special = skip_special_tokens
        prime = self._prompt_tail(prompt_token_ids)
        self._stream = DecodeStream(ids=prime, skip_special_tokens=skip_special_tokens)
        self._context = prime  # ids decoded just before the held ones, for `flush`
        self._held_ids: list[int] = []  # ids whose text is still held back
        self._added = tokenizer.added_token_ids if spaces_between_special_tokens and not skip_special_tokens else None
        self._prev_added = None if self._added is None or not prompt_token_ids else prompt_token_ids[-1] in self._added

    def push(self, token_ids: list[int]) -> str:
        """Add generated ids; returns the text they finalised (possibly empty)."""
        pieces = []
        for token_id in token_ids:
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception as exc:
                piece = self._restart(exc, token_id)
            if self._added is not None:
                piece = self._spaced(token_id, piece)
            if piece is None:
                self._held_ids.append(token_id)
            else:
                pieces.append(piece)
                self._context = [token_id]
                if self._held_ids:
                    self._held_ids = []
        return "".join(pieces)

    def _spaced(self, token_id: int, piece: str | None) -> str | None:
        added = token_id in self._added
        if piece and self._prev_added is not None and (added or self._prev_added):
            piece = " " + piece
        self._prev_added = added
        return piece

    def flush(self) -> str:
        """Text still held back when generation ends: an unfinished character decodes to U+FFFD, as in
        a full decode of the output."""
        if not self._held_ids:
            return ""
        base = self._backend.decode(self._context, skip_special_tokens=self._skip_special)
        text = self._backend.decode(self._context + self._held_ids, skip_special_tokens=self._skip_special)
        self._held_ids = []
        return text[len(base):] if text.startswith(base) else text

    def _restart(self, exc: Exception, token_id: int) -> str | None:
        """`token_id`'s piece after the stream refused it with `exc`."""
        if _INVALID_PREFIX not in str(exc):
            raise exc
        # Byte-fallback decoders write one U+FFFD per stray byte, so a window the stream re-decodes
        # can stop extending the text it already sent (vLLM #17448): restart from this token.
        self._stream = DecodeStream(skip_special_tokens=self._skip_special)
        self._held_ids = []
        return self._stream.step(self._backend, token_id)

    def _prompt_tail(self, prompt_token_ids: list[int]) -> list[int]:
        """The shortest prompt tail that decodes to whole characters at both ends, or [] if none does
        (e.g. the prompt ends inside a character: the output then decodes on its own)."""
        longest = min(_PRIME_MAX_TOKENS, len(prompt_token_ids))
        for n in range(min(_PRIME_MIN_TOKENS, longest), longest + 1):
            tail = list(prompt_token_ids[-n:]) if n else []
            text = self._backend.decode(tail, skip_special_tokens=self._skip_special)
            if not text.startswith(_REPLACEMENT) and not text.endswith(_REPLACEMENT):
                return tail
        return []


class StopStringMatcher:
    """Cuts a text stream at the first stop string to complete.

    Text that might be the start of a stop string is held back (when the stop string is excluded from
    the output), so a stream never shows a partial match that is later cut. The first stop string to
    *complete* wins, so the result does not depend on how the text was split into deltas.

    Clients choose the stop strings, so time and memory stay linear in their length: each stop string
    is followed by a Knuth-Morris-Pratt automaton whose state is the longest suffix of the text so far
    that begins it. A character costs O(1) amortised per stop string, and at most the longest stop
    string's length minus one characters are held back.
    """

    __slots__ = ("_stops", "_include", "_borders", "_states", "_held", "_stopped")

    def __init__(self, stop: list[str], include_stop_str_in_output: bool):
        self._stops = tuple(stop)
        self._include = include_stop_str_in_output
        self._borders = [_borders(s) for s in self._stops]
        self._states = [0] * len(self._stops)
        self._held = ""  # text not emitted yet: it may begin a stop string
        self._stopped = False

    @property
    def watching(self) -> bool:
        """Whether a stop string may still end the text."""
        return bool(self._stops) and not self._stopped

    def feed(self, delta: str, armed: bool = True) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string hit or None). After a hit nothing more is
        emitted. Not `armed` (the request's min_tokens not generated yet), a stop string that
        completes in `delta` is passed over, as vLLM does; one completing later still counts."""
        if not self._stops:
            return delta, None
        if self._stopped:
            return "", None
        text = self._held + delta
        if not armed:
            for i, stop in enumerate(self._stops):
                self._states[i] = _advance_past_matches(stop, self._borders[i], self._states[i], delta)
        hit = self._first_hit(delta) if armed else None
        if hit is not None:
            stop, end = hit
            end += len(self._held)
            self._stopped, self._held = True, ""
            return text[:end if self._include else end - len(stop)], stop
        keep = 0 if self._include else max(self._states)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], None

    def flush(self) -> str:
        """Held-back text, for a request that ends without a stop string."""
        held, self._held = self._held, ""
        return held

    def _first_hit(self, delta: str) -> tuple[str, int] | None:
        """Advance every automaton over `delta`; the stop string that completes first (the longest
        of those completing at the same character) and where in `delta` it ends."""
        best: tuple[str, int] | None = None
        for i, stop in enumerate(self._stops):
            limit = len(delta) if best is None else best[1]
            self._states[i], end = _advance(stop, self._borders[i], self._states[i], delta, limit)
            if end >= 0 and (best is None or end < best[1] or len(stop) > len(best[0])):
                best = (stop, end)
        return best


@functools.lru_cache(maxsize=256)
def _borders(stop: str) -> tuple[int, ...]:
    """KMP failure function: entry k is the length of the longest proper border of stop[:k + 1].
    Cached, so the samples of an n > 1 request share their stop strings' tables."""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        char = stop[i]
        while k and stop[k] != char:
            k = table[k - 1]
        if stop[k] == char:
            k += 1
        table[i] = k
    return tuple(table)


def _advance_past_matches(stop: str, borders: tuple[int, ...], state: int, delta: str) -> int:
    """`_advance` over all of `delta`, going on after each complete match from its longest border."""
    start = 0
    while True:
        state, end = _advance(stop, borders, state, delta[start:], len(delta) - start)
        if end < 0:
            return state
        start += end
        state = borders[-1]


def _advance(stop: str, borders: tuple[int, ...], state: int, delta: str, limit: int) -> tuple[int, int]:
    """Run `stop`'s automaton from `state` over delta[:limit]; returns the new state and the end of
    the first complete match in `delta`, or -1. While nothing is matched, `str.find` skips ahead to
    the next occurrence of the stop string's first character."""
    j = 0
    while j < limit:
        if state == 0:
            j = delta.find(stop[0], j, limit)
            if j < 0:
                return 0, -1
            state = 1
        else:
            char = delta[j]
            while state and stop[state] != char:
                state = borders[state - 1]
            if stop[state] == char:
                state += 1
        j += 1
        if state == len(stop):
            return state, j
    return state, -1
