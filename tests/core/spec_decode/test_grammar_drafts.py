"""Drafts under a grammar (the structured-output manager, SmolLM2's tokenizer): drafts are cut
before the first token the grammar refuses, a speculating request's mask rows are the masks it
would get accepting its drafts one by one, and its matcher ends where it started."""
import numpy as np
import pytest
from corectl.sampling_params import StructuredOutputsParams
from corectl.structured.manager import StructuredOutputManager
from corectl.structured.xgrammar_backend import XGrammarBackend
from support.grammars import EOS, VOCAB, constrained, wait_ready
from transformers import AutoTokenizer

PHONE = StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}")


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def _rows(mask) -> np.ndarray:
    return np.frombuffer(mask.bitmask, dtype=np.int32).reshape(-1, mask.width)


def test_masks_along_the_drafts_match_accepting_them_one_by_one(default_model_dir, tokenizer):
    manager = StructuredOutputManager(XGrammarBackend, str(default_model_dir), VOCAB, [EOS], 60.0)
    drafting, walking = constrained("drafting", PHONE), constrained("walking", PHONE)
    for req in (drafting, walking):
        manager.add(req)
        wait_ready(manager, req)
    phone = tokenizer.encode("555-1234", add_special_tokens=False)
    (letter,) = tokenizer.encode("x", add_special_tokens=False)
    # The letter is refused where the phone number stands: the drafts stop before it.
    assert manager.valid_drafts(drafting, [*phone[:3], letter, *phone[3:]]) == phone[:3]
    assert manager.valid_drafts(drafting, [*phone, letter]) == phone
    # EOS ends the grammar: no mask could follow it, so it is left to the verify step to sample.
    assert manager.valid_drafts(drafting, [*phone, EOS, letter]) == phone
    mask = manager.bitmask([drafting], {"drafting": phone})
    assert mask.req_ids == ["drafting"] and mask.num_rows == [len(phone) + 1]
    rows = _rows(mask)
    for position, token in enumerate([*phone, None]):
        np.testing.assert_array_equal(rows[position], _rows(manager.bitmask([walking]))[0])
        if token is not None:
            assert manager.accept(walking, token)
            walking.append_output_token(token)
    # After the last digit only EOS may follow; the drafting matcher is back at the start.
    assert (rows[-1].view(np.uint32)[EOS // 32] >> (EOS % 32)) & 1 and rows[-1].view(np.uint32).sum() == 1 << EOS
    np.testing.assert_array_equal(_rows(manager.bitmask([drafting]))[0], rows[0])
    assert manager.dead_end(drafting) is None


def test_a_dead_end_after_a_draft_is_marked_at_its_row(default_model_dir, tokenizer):
    manager = StructuredOutputManager(XGrammarBackend, str(default_model_dir), VOCAB, [EOS], 60.0)
    # "a" is allowed, but nothing can follow it.
    req = constrained("dead", StructuredOutputsParams(grammar='root ::= "b" | "a" x\nx ::= x'))
    manager.add(req)
    wait_ready(manager, req)
    (a,) = tokenizer.encode("a", add_special_tokens=False)
    assert manager.valid_drafts(req, [a]) == [a]
    rows = _rows(manager.bitmask([req], {"dead": [a]}))
    assert not (rows[0] == -1).all() and (rows[1] == -1).all()
    assert manager.dead_end_row(req) == 1 and "admits no string" in manager.dead_end(req)
    # The next step's masks start afresh: without the draft the first row allows "a" and "b".
    assert manager.bitmask([req]) is not None and manager.dead_end(req) is None
