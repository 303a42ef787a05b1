"""Per-stream text output: incremental detokenization and stop strings.

Both run once per generated token per stream in the caller's process, so they stay small: the
detokenizer leans on the Rust `DecodeStream`, the matcher scans only the last few characters.
"""
from __future__ import annotations

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

    __slots__ = ("_backend", "_skip_special", "_stream", "_context", "_pending")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool):
        self._backend = tokenizer.backend_tokenizer
        self._skip_special = skip_special_tokens
        prime = self._prompt_tail(prompt_token_ids)
        self._stream = DecodeStream(ids=prime, skip_special_tokens=skip_special_tokens)
        self._context = prime  # ids decoded just before the pending ones, for `flush`
        self._pending: list[int] = []  # ids whose text is still held back

    def push(self, token_ids: list[int]) -> str:
        """Add generated ids; returns the text they finalised (possibly empty)."""
        pieces = []
        for token_id in token_ids:
            piece = self._step(token_id)
            if piece is None:
                self._pending.append(token_id)
            else:
                pieces.append(piece)
                self._context = [token_id]
                if self._pending:
                    self._pending = []
        return "".join(pieces)

    def flush(self) -> str:
        """Text still held back when generation ends: an unfinished character decodes to U+FFFD, as in
        a full decode of the output."""
        if not self._pending:
            return ""
        base = self._backend.decode(self._context, skip_special_tokens=self._skip_special)
        text = self._backend.decode(self._context + self._pending, skip_special_tokens=self._skip_special)
        self._pending = []
        return text[len(base):] if text.startswith(base) else text

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as exc:
            if _INVALID_PREFIX not in str(exc):
                raise
            # Byte-fallback decoders write one U+FFFD per stray byte, so a window the stream re-decodes
            # can stop extending the text it already sent (vLLM #17448): restart from this token.
            self._stream = DecodeStream(skip_special_tokens=self._skip_special)
            self._pending = []
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
    """

    __slots__ = ("_stops", "_include", "_prefixes", "_first_chars", "_window_max", "_window", "_held",
                 "_stopped")

    def __init__(self, stop: list[str], include_stop_str_in_output: bool):
        self._stops = tuple(stop)
        self._include = include_stop_str_in_output
        self._prefixes = frozenset(s[:k] for s in stop for k in range(1, len(s)))
        self._first_chars = frozenset(s[0] for s in stop if s)
        # A stop string can span deltas: keep this many trailing characters to search again.
        self._window_max = max((len(s) for s in stop), default=1) - 1
        self._window = ""  # the last characters seen, emitted or held
        self._held = 0  # how many of the window's trailing characters are not emitted yet
        self._stopped = False

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string hit or None). After a hit nothing more is
        emitted."""
        if not self._stops:
            return delta, None
        if self._stopped:
            return "", None
        text = self._window + delta
        emitted = len(self._window) - self._held
        hit = self._first_hit(text)
        if hit is not None:
            stop, start = hit
            self._stopped, self._window, self._held = True, "", 0
            return text[emitted:start + len(stop) if self._include else start], stop
        held = 0 if self._include else self._partial_suffix_len(text)
        self._window = text[-self._window_max:] if self._window_max else ""
        self._held = held
        return text[emitted:len(text) - held], None

    def flush(self) -> str:
        """Held-back text, for a request that ends without a stop string."""
        held = self._window[len(self._window) - self._held:] if self._held else ""
        self._held = 0
        return held

    def _first_hit(self, text: str) -> tuple[str, int] | None:
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[2], best[1])

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that begins some stop string."""
        for k in range(min(self._window_max, len(text)), 0, -1):
            if text[-k] in self._first_chars and text[-k:] in self._prefixes:
                return k
        return 0
