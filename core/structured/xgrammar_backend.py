"""The built-in structured-output backend, on xgrammar (0.2.x).

xgrammar compiles a grammar against the tokenizer's vocabulary once (JSON schema ~130 ms, builtin
JSON ~7 ms, a regex under 1 ms here), then a matcher fills a request's next-token bitmask in ~0.01 ms.
It is imported only when a request asks for structured output.
"""
from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from ..errors import InvalidRequestError
from ..sampling_params import StructuredOutputsParams
from .backend import GrammarMatcher, StructuredOutputBackend
from .xgrammar_language import admits_some_string

# xgrammar's C++ errors start with a timestamp and a source location the user has no use for.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# xgrammar refusals that mean the grammar admits no string (0.2.9 refuses a loop of bare $refs
# itself, where 0.2.8 built `a ::= a` for `admits_some_string` to find): the same code either way.
_NO_STRING_REFUSALS = ("Circular $ref chain with no schema content",)
# Below this many rows handing them to threads costs more than filling them here (~0.01 ms a row).
PARALLEL_FILL_MIN_ROWS = 8


def _choice_ebnf(choices: list[str]) -> str:
    # JSON string escapes are EBNF string escapes.
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _json_schema_text(spec: StructuredOutputsParams) -> str:
    if isinstance(spec.json, dict):
        return json.dumps(spec.json)
    try:
        json.loads(spec.json)
    except ValueError as exc:
        raise InvalidRequestError(f"structured_outputs.json is not valid JSON: {exc}",
                                  param="structured_outputs.json") from exc
    return spec.json


def _structural_tag_args(text: str) -> tuple:
    """xgrammar's structural-tag JSON as is, or vLLM's older {"structures", "triggers"} form."""
    import xgrammar as xgr

    tag = json.loads(text)
    if isinstance(tag, dict) and "structures" in tag:
        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        return items, tag["triggers"]
    return (text,)


def _refusal(spec: StructuredOutputsParams, exc: Exception) -> InvalidRequestError:
    message = _CPP_PREFIX.sub("", str(exc).strip()).strip() or type(exc).__name__
    field = f"structured_outputs.{spec.kind}"
    if message.startswith(_NO_STRING_REFUSALS):
        return InvalidRequestError(f"{field} admits no string: {message}", param=field,
                                   code="grammar_admits_no_string")
    return InvalidRequestError(f"{field} cannot be compiled: {message}", param=field)


class XGrammarMatcher(GrammarMatcher):
    supports_rollback = True

    def __init__(self, matcher: Any):
        self._matcher = matcher

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class XGrammarBackend(StructuredOutputBackend):
    """`fill_threads`: threads that fill a step's bitmask rows together (xgrammar's batch matcher,
    which runs without the GIL); default `default_fill_threads()`, one."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, stop_token_ids: list[int], fill_threads: int | None = None):
        import xgrammar as xgr
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # The engine's manager caches compiled grammars by spec; a second cache would only hold memory.
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.fill_threads = fill_threads or default_fill_threads()
        self._batch = xgr.BatchGrammarMatcher(self.fill_threads) if self.fill_threads > 1 else None

    @classmethod
    def load_library(cls) -> None:
        import xgrammar  # noqa: F401

    @classmethod
    def validate(cls, spec: StructuredOutputsParams) -> None:
        import xgrammar as xgr

        kind, grammar = spec.kind, None
        try:
            if kind == "json":
                grammar = xgr.Grammar.from_json_schema(_json_schema_text(spec),
                                                       any_whitespace=not spec.disable_any_whitespace)
            elif kind == "regex":
                grammar = xgr.Grammar.from_regex(spec.regex)
            elif kind == "grammar":
                grammar = xgr.Grammar.from_ebnf(spec.grammar)
            elif kind == "structural_tag":
                grammar = xgr.Grammar.from_structural_tag(*_structural_tag_args(spec.structural_tag))
        except InvalidRequestError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError, ValueError, TypeError or its own errors
            raise _refusal(spec, exc) from exc
        if grammar is not None and not admits_some_string(grammar):
            raise InvalidRequestError(
                f"structured_outputs.{kind} admits no string: every way through it passes a part that can never "
                "end or match (a $ref that loops, a rule defined only by itself, a character class that excludes "
                "every character)", param=f"structured_outputs.{kind}", code="grammar_admits_no_string")

    def compile(self, spec: StructuredOutputsParams) -> Any:
        compiler, kind = self._compiler, spec.kind
        try:
            if kind == "json":
                return compiler.compile_json_schema(_json_schema_text(spec),
                                                    any_whitespace=not spec.disable_any_whitespace)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=not spec.disable_any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar(_choice_ebnf(spec.choice))
            if kind == "grammar":
                return compiler.compile_grammar(spec.grammar)
            return compiler.compile_structural_tag(*_structural_tag_args(spec.structural_tag))
        except InvalidRequestError:
            raise
        except Exception as exc:
            raise _refusal(spec, exc) from exc

    def new_matcher(self, grammar: Any) -> GrammarMatcher:
        import xgrammar as xgr

        return XGrammarMatcher(xgr.GrammarMatcher(grammar))

    def grammar_bytes(self, grammar: Any) -> int:
        return grammar.memory_size_bytes

    def fill_bitmasks(self, matchers: list[GrammarMatcher], bitmask: np.ndarray, rows: list[int]) -> None:
        if self._batch is None or len(rows) < PARALLEL_FILL_MIN_ROWS:
            super().fill_bitmasks(matchers, bitmask, rows)
        else:
            self._batch.batch_fill_next_token_bitmask([m._matcher for m in matchers], bitmask, rows)


def default_fill_threads() -> int:
    """One: rows fill one after another. Measured on an H100 host (16 cores, xgrammar 0.2.8,
    `corectl bench grammar --fill-threads 1,4,8`), the batch matcher's hand-off costs 2-3 ms a call
    whatever the rows, while 64 rows fill in 0.4 ms on one thread (docs/performance.md, W9)."""
    return 1
