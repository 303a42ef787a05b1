"""Speculative decoding in `corectl bench throughput`: the "edit this text" dataset and the
acceptance figures printed beside the throughput.

edit-text (C3): each prompt holds a ~300-token passage with a few misspellings and asks for it
back corrected, so the answer mostly repeats the prompt, the case n-gram (prompt lookup) drafts
are made for. Prompts differ by sentence order (seeded), so they share no prefix-cache blocks
beyond the instruction. Sampling is greedy and EOS ends the answer: with and without speculation
the outputs are the same tokens, so output tokens/s compare like for like.
"""
from __future__ import annotations

import random

_INSTRUCTION = ("Correct the spelling mistakes in the passage below. Reply with the corrected passage only, "
                "keeping every other word as it is.\n\n")
_SENTENCES = [
    "The old lighthouse stood at the edge of the cliff, its white paint peeling after decades of salt and wind.",
    "Every evening the keeper climbed the hundred and twelve steps to light the lamp before the sun went down.",
    "Ships passing through the narrow strait relied on its beam to avoid the rocks hidden beneath the waves.",
    "In the winter of the great storm, the keeper kept the light burning for three days without any sleep.",
    "A fishing boat with seven men aboard found its way home by following the steady flash through the fog.",
    "The village later gave the keeper a silver watch, which he wore every day until the end of his life.",
    "Today the lighthouse is automatic, and a small museum in the keeper's cottage tells its long story.",
    "Visitors can climb the same steps, look out over the water, and imagine the nights of the old keepers.",
    "The museum also keeps his logbook, where he wrote the weather, the ships he saw, and the hours he worked.",
    "Children who visit are often surprised to learn that the lamp once burned oil instead of electricity.",
    "On clear days you can see the far coast, and on stormy days the spray reaches the gallery at the top.",
    "The town still holds a festival each summer to remember the keepers and the sailors they brought home.",
]
# Misspellings put into the passage: the answer repeats it with these fixed.
_TYPOS = {"lighthouse": "lighthuose", "evening": "evenign", "beneath": "beneith", "without": "withuot",
          "following": "folowing", "museum": "musuem", "surprised": "suprised", "festival": "festivle"}


def edit_text_passage(rng: random.Random) -> str:
    sentences = list(_SENTENCES)
    rng.shuffle(sentences)
    text = " ".join(sentences)
    for right, wrong in _TYPOS.items():
        text = text.replace(right, wrong, 1)
    return text


def edit_text_prompts(tokenizer, num_prompts: int, seed: int = 0) -> list[list[int]]:
    """Chat-formatted "edit this text" prompts (token ids); needs the model's tokenizer."""
    rng = random.Random(seed)
    return [tokenizer.encode_chat([{"role": "user", "content": _INSTRUCTION + edit_text_passage(rng)}])
            for _ in range(num_prompts)]


def acceptance(before, after) -> dict | None:
    """vLLM's spec-decode figures between two `SchedulerStats`: None when nothing was drafted.
    The mean accepted length counts the token each verification adds (1 + accepted per draft)."""
    drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
    if drafts == 0:
        return None
    tokens = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    old = before.spec_decode_num_accepted_tokens_per_pos or [0] * len(after.spec_decode_num_accepted_tokens_per_pos)
    per_position = [(a - b) / drafts for a, b in zip(after.spec_decode_num_accepted_tokens_per_pos, old)]
    return {"num_drafts": drafts, "num_draft_tokens": tokens, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / tokens if tokens else 0.0, "mean_accepted_length": 1 + accepted / drafts,
            "acceptance_by_position": per_position}


def format_acceptance(figures: dict) -> str:
    by_position = ", ".join(f"{rate:.2f}" for rate in figures["acceptance_by_position"])
    return (f"Speculative decoding: acceptance rate {figures['acceptance_rate']:.3f} "
            f"({figures['num_accepted_tokens']}/{figures['num_draft_tokens']} draft tokens), mean accepted "
            f"length {figures['mean_accepted_length']:.2f} over {figures['num_drafts']} drafts; by position [{by_position}]")
