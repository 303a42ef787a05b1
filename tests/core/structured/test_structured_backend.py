"""StructuredOutputsParams, the xgrammar backend and the engine-side manager, on SmolLM2's tokenizer."""
import json
import time

import numpy as np
import pytest
from corectl.discovery import resolve_structured_output_backend
from corectl.errors import ConfigError, InvalidRequestError
from corectl.plugins import (
    PluginManager,
    StructuredOutputBackendSpec,
    hookimpl,
    reset_plugin_manager,
)
from corectl.sampling_params import StructuredOutputsParams
from corectl.structured.manager import StructuredOutputManager
from corectl.structured.xgrammar_backend import XGrammarBackend
from support.grammars import EOS, VOCAB, constrained, wait_ready
from transformers import AutoTokenizer



@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="module")
def backend(default_model_dir):
    return XGrammarBackend(str(default_model_dir), VOCAB, [EOS])


def make_manager(model_dir, timeout_s=10.0):
    return StructuredOutputManager(XGrammarBackend, str(model_dir), VOCAB, [EOS], timeout_s)


def allowed(bitmask_row):
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


@pytest.mark.parametrize("fields, param", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["b"]}, "structured_outputs"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"json": ""}, "structured_outputs.json"),
    ({"grammar": " "}, "structured_outputs.grammar"),
])
def test_params_set_exactly_one_valid_constraint(fields, param):
    with pytest.raises(InvalidRequestError) as err:
        StructuredOutputsParams(**fields)
    assert err.value.param == param


@pytest.mark.parametrize("fields, param", [
    ({"json": {"type": "objectx"}}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"regex": "(abc"}, "structured_outputs.regex"),
    ({"grammar": 'root ::= "a" | '}, "structured_outputs.grammar"),
    ({"structural_tag": '{"type": "nonsense"}'}, "structured_outputs.structural_tag"),
])
def test_validate_names_the_bad_field_without_a_tokenizer(fields, param):
    with pytest.raises(InvalidRequestError) as err:
        XGrammarBackend.validate(StructuredOutputsParams(**fields))
    assert err.value.param == param
    assert "/project/cpp" not in str(err.value)


def test_choice_allows_exactly_its_strings_then_stops(backend, tokenizer):
    matcher = backend.new_matcher(backend.compile(StructuredOutputsParams(choice=["Paris", "Lyon \"2\""])))
    bitmask = np.zeros((1, (VOCAB + 31) // 32), dtype=np.int32)
    for token in tokenizer.encode('Lyon "2"', add_special_tokens=False):
        matcher.fill_bitmask(bitmask, 0)
        assert token in allowed(bitmask[0])
        assert matcher.accept_token(token)
    matcher.fill_bitmask(bitmask, 0)
    assert allowed(bitmask[0]) == {EOS}
    assert not matcher.accept_token(tokenizer.encode("x", add_special_tokens=False)[0])
    assert matcher.accept_token(EOS) and matcher.is_terminated()


def test_manager_compiles_off_the_caller_and_shares_a_spec(default_model_dir):
    manager = make_manager(default_model_dir)
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    first, second = constrained("a", spec), constrained("b", spec)
    manager.add(first)
    wait_ready(manager, first)
    manager.add(second)
    assert manager.ready(second)  # the compiled grammar is cached by spec
    bitmask = np.frombuffer(manager.bitmask([first, second]).bitmask, dtype=np.int32).reshape(2, -1)
    assert (bitmask[0] == bitmask[1]).all() and allowed(bitmask[0])
    manager.remove(first)
    assert first not in manager and second in manager


def test_a_compile_error_or_overrun_fails_the_request_with_a_reason(default_model_dir):
    manager = make_manager(default_model_dir, timeout_s=1e-9)
    slow = constrained("slow", StructuredOutputsParams(json=json.dumps({"type": "array", "items": {"type": "string"}})))
    manager.add(slow)
    ((req, reason),) = manager.failures()
    assert req is slow and "structured_outputs.json took longer than" in reason

    manager = make_manager(default_model_dir)
    bad = constrained("bad", StructuredOutputsParams(regex="(abc"))
    manager.add(bad)
    deadline = time.monotonic() + 30
    while not manager.failures():
        assert time.monotonic() < deadline
        manager.wait_for_compile(0.05)
    ((req, reason),) = manager.failures()
    assert req is bad and "structured_outputs.regex cannot be compiled" in reason and not manager.ready(bad)


def test_min_tokens_holds_stop_tokens_back_unless_the_grammar_allows_nothing_else(default_model_dir, tokenizer):
    manager = make_manager(default_model_dir)
    optional = constrained("optional", StructuredOutputsParams(regex="(ab)*"), min_tokens=4)
    forced = constrained("forced", StructuredOutputsParams(choice=["ab"]), min_tokens=4)
    for req in (optional, forced):
        manager.add(req)
        wait_ready(manager, req)
    for token in tokenizer.encode("ab", add_special_tokens=False):
        assert manager.accept(forced, token)
        forced.append_output_token(token)
    rows = np.frombuffer(manager.bitmask([optional, forced]).bitmask, dtype=np.int32).reshape(2, -1)
    assert EOS not in allowed(rows[0]) and allowed(rows[0])
    assert allowed(rows[1]) == {EOS}


class _Plugin:
    @hookimpl
    def corectl_structured_output_backends(self):
        yield StructuredOutputBackendSpec("other", "corectl.structured.xgrammar_backend:XGrammarBackend")


def test_backends_resolve_by_name_through_the_hook():
    assert resolve_structured_output_backend("xgrammar") is XGrammarBackend
    manager = PluginManager()
    manager.register(_Plugin(), name="third-party")
    reset_plugin_manager(manager)
    try:
        assert resolve_structured_output_backend("other") is XGrammarBackend
    finally:
        reset_plugin_manager()
    with pytest.raises(ConfigError, match="unknown structured-output backend 'llguidance'; registered: xgrammar"):
        resolve_structured_output_backend("llguidance")


def test_rows_filled_on_threads_equal_rows_filled_one_by_one(default_model_dir, tokenizer):
    """xgrammar's batch matcher (several threads, without the GIL) writes the same rows, into the
    rows asked for and no others, as one matcher at a time."""
    threaded = XGrammarBackend(str(default_model_dir), VOCAB, [EOS], fill_threads=4)
    grammar = threaded.compile(StructuredOutputsParams(json={"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}))
    answer = tokenizer.encode('{"name": "Ada", "age": 36}', add_special_tokens=False)
    matchers = []
    for i in range(12):  # each at another point of the answer
        matcher = threaded.new_matcher(grammar)
        assert all(matcher.accept_token(token) for token in answer[:i % len(answer)])
        matchers.append(matcher)
    rows = [row for row in range(16) if row % 4 != 1]  # 12 rows with gaps, as thinking rows leave them
    assert len(rows) >= 8 and threaded.fill_threads == 4
    together = np.full((16, (VOCAB + 31) // 32), 7, dtype=np.int32)
    threaded.fill_bitmasks(matchers, together, rows)
    one_by_one = together.copy()
    for matcher, row in zip(matchers, rows):
        matcher.fill_bitmask(one_by_one, row)
    assert np.array_equal(together, one_by_one)
    assert all((together[row] == 7).all() for row in range(16) if row not in rows)
    assert len({together[row].tobytes() for row in rows}) > 2
