"""Whether an xgrammar grammar admits any string at all, decided before any request samples from it.

A grammar can parse and compile yet admit no string: a JSON schema whose `$ref`s loop
(`a ::= a`), an EBNF rule that only ever refers to itself, a regex class that excludes every
character (`[^\\s\\S]`). Sampling under one finds every token forbidden. Here a rule is
*productive* when some expansion of it reaches a finite string; the grammar admits a string only
when its root rule is productive (the standard fixed point over the rules).

It reads xgrammar's serialized grammar (`Grammar.serialize_json`, formats "v16" of 0.2.8 to "v18"
of 0.2.9: expressions as rows `[type, length, data...]`, kinds and rows alike in all three). A format it does not know is left unchecked: the engine still
ends a request whose mask empties mid-output (`StructuredOutputManager`), so this check only moves
the error earlier. Lookahead assertions are not analysed (they never make a rule productive).
"""
from __future__ import annotations

import json
from typing import Any

KNOWN_FORMATS = ("v16", "v17", "v18")
MAX_CODEPOINT = 0x10FFFF

# xgrammar's GrammarExprType, in its order.
BYTE_STRING, CHARACTER_CLASS, CHARACTER_CLASS_STAR, EMPTY_STR, RULE_REF, SEQUENCE, CHOICES, TAG_DISPATCH, REPEAT = (
    range(9))


def admits_some_string(grammar: Any) -> bool:
    """False only when the grammar provably admits no string (an `xgrammar.Grammar`)."""
    serialized = json.loads(grammar.serialize_json())
    if serialized.get("__VERSION__") not in KNOWN_FORMATS:
        return True
    return _Productivity(serialized).rule(serialized["root_rule_id"])


class _Productivity:
    """A worklist instead of whole rounds: a rule is looked at again only when a rule it refers
    to became productive, so a long chain of rules costs its size, not its size squared."""

    def __init__(self, serialized: dict):
        data = serialized["grammar_expr_data"]
        indptr = [*serialized["grammar_expr_indptr"], len(data)]  # the last row runs to the end
        self._exprs = [data[indptr[i]:indptr[i + 1]] for i in range(len(indptr) - 1)]
        bodies = [rule[1] for rule in serialized["rules"]]
        self._productive = [False] * len(bodies)
        referrers: list[set[int]] = [set() for _ in bodies]
        for rule_id, body in enumerate(bodies):
            for ref in self._refs(body):
                referrers[ref].add(rule_id)
        pending = list(range(len(bodies)))
        while pending:
            rule_id = pending.pop()
            if not self._productive[rule_id] and self._expr(bodies[rule_id]):
                self._productive[rule_id] = True
                pending.extend(referrers[rule_id])

    def rule(self, rule_id: int) -> bool:
        return self._productive[rule_id]

    def _refs(self, expr_id: int) -> list[int]:
        kind, _, *data = self._exprs[expr_id]
        if kind in (RULE_REF, REPEAT):
            return [data[0]]
        if kind in (SEQUENCE, CHOICES):
            return [ref for part in data for ref in self._refs(part)]
        return []

    def _expr(self, expr_id: int) -> bool:
        kind, _, *data = self._exprs[expr_id]
        if kind == RULE_REF:
            return self._productive[data[0]]
        if kind == SEQUENCE:
            return all(self._expr(part) for part in data)
        if kind == CHOICES:
            return any(self._expr(part) for part in data)
        if kind == REPEAT:
            rule_id, min_repeats = data[0], data[1]
            return min_repeats == 0 or self._productive[rule_id]
        if kind == CHARACTER_CLASS:
            return _class_has_a_character(data[0] != 0, data[1:])
        return True  # strings, the empty string, class stars, tag dispatch and anything newer


def _class_has_a_character(negated: bool, bounds: list[int]) -> bool:
    ranges = sorted(zip(bounds[::2], bounds[1::2]))
    if not negated:
        return bool(ranges)
    next_uncovered = 0
    for low, high in ranges:
        if low > next_uncovered:
            return True
        next_uncovered = max(next_uncovered, high + 1)
    return next_uncovered <= MAX_CODEPOINT
