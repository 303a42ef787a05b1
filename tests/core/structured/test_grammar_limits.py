"""Grammars that admit no string, and compiles that are slow, large or abandoned (issue 27, defects 1 and 6):
the xgrammar backend and the engine-side manager on SmolLM2's tokenizer, and the real engine."""
import json
import threading
import time

import numpy as np
import pytest
from corectl import SamplingParams
from corectl.errors import InvalidRequestError
from corectl.sampling_params import StructuredOutputsParams
from corectl.structured import compiles
from corectl.structured.compiles import GrammarCompiles, estimated_cost
from corectl.structured.manager import StructuredOutputManager
from corectl.structured.xgrammar_backend import XGrammarBackend
from support.grammars import EOS, VOCAB, constrained, wait_ready
from transformers import AutoTokenizer

LOOPING_REF = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
# A root that can be "b", or "a" followed by a rule that never ends: not empty, so it passes
# validation, but a request that writes "a" is at a dead end.
DEAD_END_AFTER_A = 'root ::= "b" | "a" x\nx ::= x'


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("fields", [
    {"regex": r"[^\s\S]"},
    {"regex": r"id-[^\s\S]+"},
    {"json": LOOPING_REF},
    {"json": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"], **LOOPING_REF}},
    {"json": {"$ref": "#/$defs/node", "$defs": {"node": {
        "type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}}}},
    {"grammar": 'root ::= "a" x\nx ::= x "b"'},
])
def test_a_grammar_that_admits_no_string_is_refused_naming_its_field(fields):
    spec = StructuredOutputsParams(**fields)
    with pytest.raises(InvalidRequestError, match="admits no string") as err:
        XGrammarBackend.validate(spec)
    assert err.value.param == f"structured_outputs.{spec.kind}" and err.value.code == "grammar_admits_no_string"


@pytest.mark.parametrize("fields", [
    {"regex": r"[^a]"},
    {"json": {"$ref": "#/$defs/node", "$defs": {"node": {
        "type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}}}},  # "next" is optional: {} ends it
    {"grammar": 'root ::= x\nx ::= "b" | x "a"'},
    {"grammar": DEAD_END_AFTER_A},
])
def test_recursive_grammars_that_can_end_are_accepted(fields):
    XGrammarBackend.validate(StructuredOutputsParams(**fields))


def test_a_mask_that_empties_marks_the_request_and_allows_every_token(default_model_dir, tokenizer):
    manager = StructuredOutputManager(XGrammarBackend, str(default_model_dir), VOCAB, [EOS], 60.0)
    req = constrained("dead", StructuredOutputsParams(grammar=DEAD_END_AFTER_A))
    manager.add(req)
    wait_ready(manager, req)
    assert manager.bitmask([req]) is not None and manager.dead_end(req) is None
    (a,) = tokenizer.encode("a", add_special_tokens=False)
    assert manager.accept(req, a)
    req.append_output_token(a)
    row = np.frombuffer(manager.bitmask([req]).bitmask, dtype=np.int32)
    assert (row == -1).all()  # the sampler never sees an all-forbidden row
    assert "structured_outputs.grammar admits no string that continues this output" in manager.dead_end(req)
    manager.remove(req)
    assert manager.dead_end(req) is None


def test_the_engine_ends_a_dead_end_request_with_the_reason_and_no_token(llm_int4):
    (a,) = llm_int4.get_tokenizer().encode("a", add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={a: 100.0},
                            structured_outputs=StructuredOutputsParams(grammar=DEAD_END_AFTER_A))
    dead, free = llm_int4.generate(["Say something.", "Say something."],
                                   [params, SamplingParams(temperature=0.0, max_tokens=3)], use_tqdm=False)
    assert dead.outputs[0].finish_reason == "abort" and dead.outputs[0].token_ids == [a]
    assert "admits no string that continues this output" in dead.outputs[0].error
    assert free.outputs[0].finish_reason == "length" and free.outputs[0].error is None
    assert not llm_int4.engine.has_unfinished_requests()


def test_cost_counts_the_text_and_its_bounds():
    assert estimated_cost(b'{"regex":"a"}') < compiles.SMALL_GRAMMAR_COST
    assert estimated_cost(b'{"regex":"[a-z]{0,2000}"}') >= compiles.SMALL_GRAMMAR_COST
    choices = json.dumps({"choice": [f"option {i:04d} " + "x" * 64 for i in range(300)]}).encode()
    assert estimated_cost(choices) >= compiles.SMALL_GRAMMAR_COST


class _Gate:
    """A compile function whose large specs block until released, as a slow compile does."""

    def __init__(self):
        self.release = threading.Event()
        self.started: list[str] = []

    def compile(self, spec):
        self.started.append(spec)
        if spec.startswith("large"):
            assert self.release.wait(30)
        return spec


def _key(name: str, cost: int) -> bytes:
    return name.encode().ljust(cost, b" ")


def test_small_grammars_never_wait_behind_large_ones_and_abandoned_ones_are_not_kept():
    gate = _Gate()
    lanes = GrammarCompiles(gate.compile, lambda grammar: 1000)
    large = [lanes.join(_key(f"large{i}", compiles.SMALL_GRAMMAR_COST), f"large{i}") for i in range(3)]
    deadline = time.monotonic() + 30
    while large[0].started_at is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    small = lanes.join(_key("small", 10), "small")
    assert small.future.result(timeout=30) == "small"  # while the large lane is still blocked
    assert large[1].started_at is None  # one large compile at a time
    assert "without starting" in large[1].describe_wait(time.monotonic())
    for job in large:
        lanes.leave(job)  # every waiter gave up (timed out or aborted)
    gate.release.set()
    assert large[1].future.cancelled() and large[2].future.cancelled()  # queued: never run
    assert large[0].future.result(timeout=30) == "large0"  # running: it finishes...
    assert gate.started == ["large0", "small"]
    assert lanes.cached_bytes == len(small.key) + 1000  # ...and is not cached
    again = lanes.join(_key("large0", compiles.SMALL_GRAMMAR_COST), "large0")
    assert again is not large[0]


def test_the_cache_is_bounded_in_bytes_least_recently_used_out():
    lanes = GrammarCompiles(lambda spec: spec, lambda grammar: 400, cache_bytes=1000)
    first = lanes.join(b"first", "first")
    first.future.result(timeout=30)
    second = lanes.join(b"second", "second")
    second.future.result(timeout=30)
    assert lanes.join(b"first", "first") is first  # a hit makes "first" the most recent
    third = lanes.join(b"third", "third")
    third.future.result(timeout=30)
    assert lanes.cached_bytes <= 1000
    assert lanes.join(b"first", "first") is first and lanes.join(b"second", "second") is not second
