"""`best_of` > `n` and chat's `use_beam_search` through the shared server, with the `openai` client."""
from __future__ import annotations

import openai
import pytest

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name a colour."}]


def test_best_of_returns_the_n_samples_of_highest_cumulative_logprob(openai_client, model_id):
    sampled = openai_client.completions.create(model=model_id, prompt=PROMPT, max_tokens=4, n=4, seed=11,
                                               temperature=1.0, logprobs=1, extra_body={"ignore_eos": True})
    totals = sorted(((sum(c.logprobs.token_logprobs), c.text) for c in sampled.choices), reverse=True)
    assert len({text for _, text in totals}) > 2  # distinct samples, so the choice of the best is visible
    best = openai_client.completions.create(model=model_id, prompt=PROMPT, max_tokens=4, n=2, best_of=4, seed=11,
                                            temperature=1.0, logprobs=1, extra_body={"ignore_eos": True})
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [text for _, text in totals[:2]]
    assert best.usage.completion_tokens == 8
    # Without logprobs the samples are still ranked, and no logprobs come back.
    plain = openai_client.completions.create(model=model_id, prompt=PROMPT, max_tokens=4, n=1, best_of=4, seed=11,
                                             temperature=1.0, extra_body={"ignore_eos": True})
    assert plain.choices[0].text == totals[0][1] and plain.choices[0].logprobs is None


def test_best_of_above_n_does_not_stream(openai_client, model_id):
    with pytest.raises(openai.BadRequestError) as exc:
        openai_client.completions.create(model=model_id, prompt=PROMPT, max_tokens=2, best_of=2, stream=True)
    assert exc.value.body["param"] == "best_of"


def test_chat_beam_search_returns_n_beams_and_width_one_is_greedy(openai_client, model_id):
    beams = openai_client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=3, n=2,
                                                  extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.index for c in beams.choices] == [0, 1]
    assert beams.choices[0].message.content != beams.choices[1].message.content
    assert beams.usage.completion_tokens == 6 and beams.choices[0].finish_reason == "length"
    width_one = openai_client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=3,
                                                      extra_body={"use_beam_search": True, "ignore_eos": True})
    greedy = openai_client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=3, temperature=0,
                                                   extra_body={"ignore_eos": True})
    assert width_one.choices[0].message.content == greedy.choices[0].message.content
    for extra, field in (({"stream": True}, "stream"), ({"logprobs": True}, "logprobs"),
                         ({"response_format": {"type": "json_object"}}, "response_format")):
        with pytest.raises(openai.BadRequestError) as exc:
            openai_client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=2,
                                                  extra_body={"use_beam_search": True}, **extra)
        assert exc.value.body["param"] == field
