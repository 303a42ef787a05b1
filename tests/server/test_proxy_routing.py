"""How `corectl proxy` picks a prefill instance (`server/proxy/routing.py`): the least busy, ties in
turn, and none when every one holds `--max-prefill-queue` prompts (conditional disaggregation: the
decode instance computes that prompt itself)."""
from __future__ import annotations

import pytest
from corectl.server.cli.main import main
from corectl.server.proxy.routing import PrefillInstances, decode_body, disaggregates, prefill_body

A, B = "http://a:1", "http://b:2"


def test_the_least_busy_instance_takes_the_prompt_and_ties_go_in_turn():
    pool = PrefillInstances([A + "/", B], max_queue=None)
    assert [pool.acquire(), pool.acquire()] == [A, B]
    pool.release(A)
    assert pool.acquire() == A  # B still holds one
    picks = [pool.acquire() for _ in range(4)]
    assert picks in ([A, B, A, B], [B, A, B, A])  # equal loads alternate
    assert pool.in_flight == {A: 3, B: 3}


def test_a_full_queue_everywhere_sends_the_prompt_to_the_decode_instance():
    pool = PrefillInstances([A, B], max_queue=2)
    taken = [pool.acquire() for _ in range(4)]
    assert sorted(taken) == [A, A, B, B]
    assert pool.acquire() is None and pool.in_flight == {A: 2, B: 2}
    pool.release(B)
    assert pool.acquire() == B and pool.acquire() is None


def test_past_both_bounds_a_prompt_queues_at_the_prefill_instance():
    pool = PrefillInstances([A], max_queue=1, max_local=1)
    assert pool.acquire() == A
    assert pool.acquire() is None and pool.local == 1  # the decode instance computes this one
    assert pool.acquire() == A and pool.in_flight == {A: 2}  # both full: it waits for the prefill instance
    pool.release_local()
    assert pool.acquire() is None and pool.local == 1


def test_a_local_prompt_counts_until_its_first_token_event():
    from corectl.server.proxy.app import _LocalPrompt

    pool = PrefillInstances([A], max_queue=1, max_local=2)
    pool.acquire(), pool.acquire(), pool.acquire()
    chat, completion = _LocalPrompt(pool, 2), _LocalPrompt(pool, 1)
    assert pool.local == 2
    chat.seen(b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n')
    assert pool.local == 2  # the role alone: the prompt may still be computing
    completion.seen(b'data: {"choices": [{"text": "x"}]}\n\n')
    chat.seen(b'data: {"choices": [{"delta": {"content": "y"}}]}\n\ndata: {"choices": []}\n\n')
    assert pool.local == 0
    chat.release(), completion.release()  # the stream's end releases nothing twice
    assert pool.local == 0


def test_the_two_halves_of_a_request():
    body = {"prompt": "x", "max_tokens": 9, "min_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    assert prefill_body(body, "t") == {"prompt": "x", "max_tokens": 1,
                                       "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "t"}}
    assert decode_body(body, "t")["kv_transfer_params"] == {"do_remote_prefill": True, "transfer_id": "t"}
    assert decode_body(body, None) is body  # the prefill half failed or was skipped: computed whole
    assert disaggregates(body) and not disaggregates({**body, "n": 2}) and not disaggregates({**body, "best_of": 3})
    # The prompt's logprobs: the decode instance has none for the positions it loads.
    assert not disaggregates({**body, "prompt_logprobs": 1}) and not disaggregates({**body, "echo": True, "logprobs": 1})
    assert disaggregates({**body, "echo": True}) and disaggregates({**body, "prompt": ["x", "y"]})


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_queue_limit_below_one_is_refused(value, capsys):
    assert main(["proxy", "--prefill", A, "--decode", B, "--max-prefill-queue", value]) == 2
    assert "max_prefill_queue" in capsys.readouterr().err


def test_a_local_prefill_bound_needs_the_queue_bound_and_one_at_least(capsys):
    assert main(["proxy", "--prefill", A, "--decode", B, "--max-local-prefills", "2"]) == 2
    assert "--max-prefill-queue" in capsys.readouterr().err
    assert main(["proxy", "--prefill", A, "--decode", B, "--max-prefill-queue", "2", "--max-local-prefills", "0"]) == 2
    assert "max_local_prefills" in capsys.readouterr().err
