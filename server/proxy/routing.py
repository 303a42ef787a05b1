"""How the proxy splits one OpenAI request into its prefill and decode halves (vLLM's toy proxy
and its `kv_transfer_params`).

The prefill instance gets the request with max_tokens=1, no streaming, and
`kv_transfer_params: {"do_remote_decode": true, "transfer_id": ID}`: it computes the prompt and its
connector saves the prompt's blocks under ID. The decode instance gets the client's request with
`{"do_remote_prefill": true, "transfer_id": ID}`: its connector loads the blocks and it decodes
from them, answering the client (streamed or not) exactly as one instance would. Requests that
make several sequences from one prompt (n, best_of, beam search) skip the prefill instance: the
decode instance serves them whole.

Conditional disaggregation (`--max-prefill-queue N`): a prompt goes to the prefill instance with
the fewest prefill halves in flight, unless every one has N: then the decode instance computes it
itself (in its own chunked-prefill steps), so a prompt-heavy load keeps both GPUs busy instead of
queueing behind the prefill instances. With `--max-local-prefills M` no more than M prompts are
computed that way at once (from sending until their first token comes back); a prompt past both
bounds queues at the least busy prefill instance. Without it the decode instances take every
overflow, and prompts pile up there (a few a second at small chunks) while the prefill instances,
faster at prompts, run below their rate: W12 on two H200s saw the prefill instance at 4.1-6.2 of
its 8.5 prompts a second.
"""
from __future__ import annotations

import itertools
import uuid
from typing import Any

_MAX_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")


class RoundRobin:
    """The instances of one kind, taken in turn."""

    def __init__(self, urls: list[str]):
        self.urls = [url.rstrip("/") for url in urls]
        self._next = itertools.cycle(self.urls)

    def pick(self) -> str:
        return next(self._next)


class PrefillInstances:
    """The prefill instances, how many prefill halves each has in flight, and how many prompts the
    decode instances compute because those were full (one event loop: no lock)."""

    def __init__(self, urls: list[str], max_queue: int | None, max_local: int | None = None):
        self.in_flight = {url.rstrip("/"): 0 for url in urls}
        self.max_queue = max_queue
        self.max_local = max_local
        self.local = 0
        self._turn = itertools.count()

    def acquire(self) -> str | None:
        """The least busy instance (ties taken in turn), counted in flight until `release`; None
        when each already has `max_queue` prefill halves in flight and fewer than `max_local`
        prompts are computed by decode instances: this one is counted there until `release_local`."""
        urls = list(self.in_flight)
        start = next(self._turn) % len(urls)
        url = min(urls[start:] + urls[:start], key=self.in_flight.__getitem__)
        full = self.max_queue is not None and self.in_flight[url] >= self.max_queue
        if full and (self.max_local is None or self.local < self.max_local):
            self.local += 1
            return None
        self.in_flight[url] += 1
        return url

    def release(self, url: str) -> None:
        self.in_flight[url] -= 1

    def release_local(self) -> None:
        self.local -= 1


def disaggregates(body: dict[str, Any]) -> bool:
    """Whether the request runs as prefill then decode: one sequence a prompt (each prompt of a batch
    travels on its own: `corectl.kv_transfer.disaggregated.transfer_key`), and no logprobs of the
    prompt, which the decode instance cannot give for positions it loads."""
    prompt_logprobs = body.get("prompt_logprobs") is not None or (body.get("echo") and body.get("logprobs"))
    return (body.get("n") in (None, 1) and body.get("best_of") in (None, 1) and not body.get("use_beam_search")
            and not prompt_logprobs and not isinstance(body.get("kv_transfer_params"), dict))


def new_transfer_id() -> str:
    return uuid.uuid4().hex


def prefill_body(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """The prefill half: the prompt only (one token, not streamed), its blocks saved under `transfer_id`."""
    prefill = {key: value for key, value in body.items() if key not in ("stream", "stream_options")}
    for field in _MAX_TOKEN_FIELDS:
        prefill.pop(field, None)
    # min_tokens above 1 would not fit max_tokens=1; the decode half honours it.
    prefill.pop("min_tokens", None)
    prefill["max_tokens"] = 1
    prefill["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
    return prefill


def decode_body(body: dict[str, Any], transfer_id: str | None) -> dict[str, Any]:
    """The decode half: the client's request, loading the prompt's blocks from `transfer_id`
    (None: the prefill half failed, so the decode instance computes the prompt itself)."""
    if transfer_id is None:
        return body
    return {**body, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": transfer_id}}
