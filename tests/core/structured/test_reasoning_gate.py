"""Structured output after reasoning, in the engine's manager: a real xgrammar grammar on the SmolLM2
tokenizer with `<think>` (49152) and `</think>` (49153) added as single tokens."""
import time

import numpy as np
import pytest
from corectl.errors import InvalidRequestError
from corectl.request import Request
from corectl.sampling_params import ReasoningGate, SamplingParams, StructuredOutputsParams
from corectl.structured.manager import StructuredOutputManager
from corectl.structured.reasoning import reasoning_gate
from corectl.structured.xgrammar_backend import XGrammarBackend
from corectl.tokenizer import Tokenizer
from support.models import save_think_tokenizer

EOS = 2
VOCAB = 49280  # the model's logits are wider than the tokenizer, as in the end-to-end tests
START, END = 49152, 49153
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def think_dir(tmp_path_factory, default_model_dir):
    return save_think_tokenizer(default_model_dir, tmp_path_factory.mktemp("think-tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(think_dir):
    return Tokenizer.from_dir(think_dir)


@pytest.fixture
def manager(think_dir):
    return StructuredOutputManager(XGrammarBackend, str(think_dir), VOCAB, [EOS], 10.0)


def request(req_id, gate=None, **params):
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True, reasoning=gate)
    return Request(req_id, [1, 2, 3], SamplingParams(structured_outputs=spec, **params), eos_token_id=EOS,
                   max_tokens=64)


def admit(manager, *reqs):
    for req in reqs:
        manager.add(req)
        deadline = time.monotonic() + 30
        while not manager.ready(req):
            assert not manager.failures() and time.monotonic() < deadline
            manager.wait_for_compile(0.05)


def rows(manager, reqs):
    """{request id: set of allowed tokens} for the requests that got a row."""
    mask = manager.bitmask(reqs)
    if mask is None:
        return {}
    words = np.frombuffer(mask.bitmask, dtype=np.int32).reshape(len(mask.req_ids), -1)
    bits = [np.unpackbits(row.view(np.uint8), bitorder="little") for row in words]
    return {req_id: set(np.flatnonzero(row).tolist()) for req_id, row in zip(mask.req_ids, bits)}


def feed(manager, req, tokens):
    for token in tokens:
        assert manager.accept(req, token), token
        req.append_output_token(token)


def test_the_prompt_decides_how_the_output_starts(tokenizer, default_model_dir):
    def gate(text, **kwargs):
        return reasoning_gate(tokenizer, tokenizer.encode(text, add_special_tokens=False), **kwargs)

    assert gate("<|im_start|>assistant\n<think>\n") == ReasoningGate(start=START, end=END, thinking=True)
    assert gate("<|im_start|>assistant\n<think>\n\n</think>\n\n") == ReasoningGate(end=END)
    assert gate("<|im_start|>assistant\n") == ReasoningGate(start=START, end=END)
    assert gate("<|im_start|>assistant\n", starts_thinking=True) == ReasoningGate(start=START, end=END, thinking=True)
    # A closed block earlier in the conversation leaves the new output free to open one.
    earlier = "<think>a</think>It is 4.<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n"
    assert gate(earlier) == ReasoningGate(start=START, end=END)
    # Markers that are not single tokens of the tokenizer cannot gate.
    plain = Tokenizer.from_dir(default_model_dir)
    assert reasoning_gate(plain, plain.encode("<think>\n", add_special_tokens=False)) is None


def test_the_gate_needs_two_different_markers():
    with pytest.raises(InvalidRequestError) as err:
        ReasoningGate(start=5, end=5)
    assert err.value.param == "structured_outputs.reasoning"


def test_a_thinking_request_samples_freely_until_the_end_marker(manager, tokenizer):
    plain, gated = request("plain"), request("gated", ReasoningGate(start=START, end=END, thinking=True))
    admit(manager, plain, gated)
    grammar_first = rows(manager, [plain])["plain"]
    hello = tokenizer.encode("Hello", add_special_tokens=False)[0]
    assert hello not in grammar_first and START not in grammar_first
    assert rows(manager, [plain, gated]) == {"plain": grammar_first}  # no row: it samples freely
    feed(manager, gated, [hello, START, hello, EOS - 1])
    assert rows(manager, [gated]) == {} and not manager.is_terminated(gated)
    feed(manager, gated, [END])
    assert rows(manager, [gated]) == {"gated": grammar_first}  # the grammar starts after the marker
    assert not manager.accept(gated, hello)
    feed(manager, gated, tokenizer.encode('{"ok": true}', add_special_tokens=False))
    assert rows(manager, [gated]) == {"gated": {EOS}}
    feed(manager, gated, [EOS])
    assert manager.is_terminated(gated)


def test_the_first_token_may_open_the_reasoning_or_answer(manager, tokenizer):
    plain = request("plain")
    thinks, answers = (request(name, ReasoningGate(start=START, end=END)) for name in ("thinks", "answers"))
    admit(manager, plain, thinks, answers)
    grammar_first = rows(manager, [plain])["plain"]
    assert rows(manager, [thinks, answers]) == {"thinks": grammar_first | {START}, "answers": grammar_first | {START}}
    feed(manager, thinks, [START])
    brace = tokenizer.encode("{", add_special_tokens=False)[0]
    feed(manager, answers, [brace])
    feed(manager, plain, [brace])
    after_brace = rows(manager, [plain])["plain"]
    assert rows(manager, [thinks, answers]) == {"answers": after_brace}
    assert START not in after_brace
    feed(manager, thinks, [END])
    assert rows(manager, [thinks])["thinks"] == grammar_first  # no second chance to open
    answered = request("answered", ReasoningGate(end=END))  # the prompt closed the reasoning
    admit(manager, answered)
    assert rows(manager, [answered])["answered"] == grammar_first


def test_min_tokens_holds_the_stop_tokens_back_while_thinking(manager):
    gated = request("gated", ReasoningGate(end=END, thinking=True), min_tokens=2)
    admit(manager, gated)
    assert rows(manager, [gated])["gated"] == set(range(VOCAB)) - {EOS}
    feed(manager, gated, [7, 8])
    assert rows(manager, [gated]) == {}


def test_the_gate_shares_the_compiled_grammar(manager):
    plain, gated = request("plain"), request("gated", ReasoningGate(end=END, thinking=True))
    admit(manager, plain)
    manager.add(gated)
    assert manager.ready(gated)  # cached by spec, gate aside
    manager.remove(gated)
    assert gated not in manager and plain in manager
