"""Incremental detokenization and stop strings on real tokenizers: SmolLM2's byte-level BPE, and a
Llama-style sentencepiece BPE (metaspace words, byte fallback) trained here with `tokenizers`."""
from __future__ import annotations

import json
import random

import pytest
from corectl.detokenizer import IncrementalDetokenizer, StopStringMatcher
from corectl.tokenizer import Tokenizer
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

REPLACEMENT = "\ufffd"
TEXTS = [
    "The capital of France is Paris.",
    "Emoji: 😀👍🏽 flags 🇫🇷🇯🇵, family 👩‍👩‍👧 and a lone 🦙.",
    "中文：你好，世界！日本語：こんにちは。한국어: 안녕하세요",
    "Accents: Émile, naïve café, crème brûlée, Ångström, Øresund, façade.",
    "def area(r):\n    \"\"\"Circle.\"\"\"\n\treturn 3.14159 * r ** 2  # π r²\n\n\nif x  !=  y:\n        pass\n",
    "   leading spaces, trailing spaces   ",
    "mixed: a😀b中c\u00e9d\n\n😀😀😀",
]
FALLBACK_CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "Hello world, hello there, capital of France.",
    "def main():\n    return 0\n", "Le café est très bon, naïve façade.", "你好世界，中文文本。",
]


@pytest.fixture(scope="module")
def smol(default_model_dir) -> Tokenizer:
    """SmolLM2's tokenizer as the engine reads it: the loader's converted folder, whose tokenizer
    transformers wrote from the GGUF."""
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def fallback(tmp_path_factory) -> Tokenizer:
    """Llama-2's decoder pipeline: metaspace words, <0xXX> byte tokens for what the vocabulary lacks,
    and the leading space of every decode stripped."""
    rust = RustTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    rust.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    rust.train_from_iterator(FALLBACK_CORPUS * 20, trainer)
    spec = json.loads(rust.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    hf = PreTrainedTokenizerFast(tokenizer_object=RustTokenizer.from_str(json.dumps(spec)),
                                 bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    saved = tmp_path_factory.mktemp("fallback-tokenizer")
    hf.save_pretrained(saved)
    return Tokenizer.from_dir(saved)


def stream(tok: Tokenizer, prompt: list[int], ids: list[int], chunks: list[int], skip: bool = True) -> list[str]:
    """Push `ids` in chunks of the given sizes (cycled); the last piece is the flush."""
    detok = IncrementalDetokenizer(tok, prompt, skip)
    pieces, i, k = [], 0, 0
    while i < len(ids):
        size = chunks[k % len(chunks)]
        pieces.append(detok.push(ids[i:i + size]))
        i, k = i + size, k + 1
    return pieces + [detok.flush()]


def random_chunks(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 5) for _ in range(64)]


def in_context(tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool = True) -> str:
    """What the output adds to the prompt's text: the truth for the streamed text."""
    before = tok.decode(prompt, skip)
    full = tok.decode(prompt + ids, skip)
    assert full.startswith(before)
    return full[len(before):]


# ---- IncrementalDetokenizer ----

@pytest.mark.parametrize("chunks", [[1], [2], [3, 1, 4], random_chunks(0), random_chunks(1)])
@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode(smol, text, chunks):
    prompt = smol.encode_chat([{"role": "user", "content": "Say something."}])
    ids = smol.encode(text, add_special_tokens=False)
    pieces = stream(smol, prompt, ids, chunks)
    assert "".join(pieces) == smol.decode(ids) == text
    assert pieces[-1] == ""  # valid text leaves nothing held back
    assert not any(REPLACEMENT in p for p in pieces)


def test_text_is_released_as_soon_as_it_is_final(smol):
    ids = smol.encode(" one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(smol, smol.encode("Count:"), True)
    assert [detok.push([i]) for i in ids] == [" one", " two", " three", " four"]
    emoji = smol.encode(" 😀", add_special_tokens=False)
    assert len(emoji) > 1
    assert [detok.push([i]) for i in emoji] == [""] * (len(emoji) - 1) + [" 😀"]


@pytest.mark.parametrize("seed", range(4))
def test_non_canonical_tokenizations(smol, seed):
    # A model may spell a word with other tokens than the encoder would: split at random characters.
    rng = random.Random(seed)
    text = "".join(TEXTS)
    cuts = sorted(rng.sample(range(1, len(text)), 120))
    ids = [t for a, b in zip([0] + cuts, cuts + [len(text)]) for t in smol.encode(text[a:b], add_special_tokens=False)]
    pieces = stream(smol, smol.encode("Hi"), ids, random_chunks(seed))
    assert "".join(pieces) == smol.decode(ids) == text
    assert not any(REPLACEMENT in p for p in pieces)


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_match_full_decode(smol, skip):
    rng = random.Random(int(skip))
    vocab = smol.vocab_size
    # Single-byte tokens make incomplete and invalid UTF-8 likely; ids 0-2 are the special tokens.
    byte_tokens = [i for i in range(vocab) if len(smol.convert_ids_to_tokens([i])[0]) == 1]
    for trial in range(1500):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        ids = [rng.choice(byte_tokens) if rng.random() < 0.5 else rng.choice([0, 1, 2, rng.randrange(vocab)])
               for _ in range(rng.randint(1, 30))]
        assert "".join(stream(smol, prompt, ids, random_chunks(trial), skip)) == smol.decode(ids, skip), (prompt, ids)


def test_special_tokens_follow_skip_flag(smol):
    ids = smol.encode("Hi there", add_special_tokens=False) + [smol.eos_token_id]
    assert "".join(stream(smol, [1], ids, [1], skip=True)) == "Hi there"
    assert "".join(stream(smol, [1], ids, [1], skip=False)) == "Hi there<|im_end|>"


def test_cut_off_character_is_flushed_as_in_full_decode(smol):
    ids = smol.encode("ok 😀", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(smol, [], True)
    assert detok.push(ids) == "ok"
    assert detok.flush() == smol.decode(ids)[len("ok"):] == " " + REPLACEMENT
    assert detok.flush() == ""


def test_prompt_ending_inside_a_character(smol):
    whole = smol.encode("hi 😀", add_special_tokens=False)
    prompt, ids = whole[:-1], whole[-1:] + smol.encode(" ok", add_special_tokens=False)
    # The prompt's text is never repeated: the output decodes on its own.
    assert "".join(stream(smol, prompt, ids, [1])) == smol.decode(ids)


@pytest.mark.parametrize("chunks", [[1], random_chunks(2)])
@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_words_keep_their_space(fallback, text, chunks):
    prompt = fallback.encode("The capital of France is")
    ids = fallback.encode(text, add_special_tokens=False)
    pieces = stream(fallback, prompt, ids, chunks)
    assert "".join(pieces) == in_context(fallback, prompt, ids)
    assert not any(REPLACEMENT in p for p in pieces)


def test_sentencepiece_leading_space_comes_from_the_prompt(fallback):
    prompt = fallback.encode("The capital of France is")
    ids = fallback.encode("Paris.", add_special_tokens=False)
    assert fallback.decode(ids) == "Paris."  # a decode on its own strips the word's space
    assert "".join(stream(fallback, prompt, ids, [1])) == " Paris."


def test_byte_fallback_characters_split_across_tokens(fallback):
    ids = fallback.encode("ok 🦙😀", add_special_tokens=False)
    tokens = fallback.convert_ids_to_tokens(ids)
    assert sum(t.startswith("<0x") for t in tokens) == 8
    detok = IncrementalDetokenizer(fallback, fallback.encode("Say"), True)
    pieces = [detok.push([i]) for i in ids]
    assert "".join(pieces) == " ok 🦙😀"
    assert not any(REPLACEMENT in p for p in pieces)


def test_byte_fallback_random_bytes_never_break_the_stream(fallback):
    # Stray bytes render as one U+FFFD each, so later bytes can rewrite text already sent; the
    # Rust stream then refuses the step, and the detokenizer must carry on.
    rng = random.Random(3)
    vocab = fallback.vocab_size
    for trial in range(1000):
        ids = [rng.randrange(vocab - 256, vocab) if rng.random() < 0.8 else rng.randrange(vocab)
               for _ in range(rng.randint(1, 30))]
        pieces = stream(fallback, [], ids, random_chunks(trial))
        assert all(isinstance(p, str) for p in pieces)
        assert len("".join(pieces)) <= len(fallback.decode(ids)) + len(ids)


# ---- StopStringMatcher ----

def reference_stop(text: str, stops: list[str], include: bool, armed_from: int = 0) -> tuple[str, str | None]:
    """Character by character: the first stop string to complete after `armed_from` characters ends the text."""
    for end in range(armed_from + 1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            stop = max(done, key=len)
            return (text[:end] if include else text[:end - len(stop)]), stop
    return text, None


def run_matcher(stops: list[str], include: bool, deltas: list[str], disarmed: int = 0) -> tuple[list[str], str | None]:
    """Feed deltas until a hit (the first `disarmed` deltas not armed); returns the emitted pieces (the
    flush last) and the hit."""
    matcher = StopStringMatcher(stops, include)
    pieces = []
    for i, delta in enumerate(deltas):
        text, hit = matcher.feed(delta, armed=i >= disarmed)
        pieces.append(text)
        if hit is not None:
            return pieces, hit
    return pieces + [matcher.flush()], None


def split_randomly(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("include", [False, True])
def test_stop_split_across_many_deltas_never_leaks(include):
    text = "Answer: 42.\n###\nignored tail"
    pieces, hit = run_matcher(["\n###\n"], include, list(text))
    assert hit == "\n###\n"
    assert "".join(pieces) == ("Answer: 42.\n###\n" if include else "Answer: 42.")
    emitted = ""
    for piece in pieces:
        emitted += piece
        assert (text if include else "Answer: 42.").startswith(emitted)


def test_partial_match_is_released_when_it_diverges():
    matcher = StopStringMatcher(["STOP"], False)
    assert matcher.feed("go ST") == ("go ", None)
    assert matcher.feed("O") == ("", None)
    assert matcher.feed("MP now") == ("STOMP now", None)
    assert matcher.feed(" ST") == (" ", None)
    assert matcher.flush() == "ST"
    assert matcher.flush() == ""


def test_hit_inside_one_delta_drops_the_rest():
    assert run_matcher(["</s>", "User:"], False, ["Sure.</s>User: more"]) == (["Sure."], "</s>")
    assert run_matcher(["</s>", "User:"], True, ["Sure.</s>User: more"]) == (["Sure.</s>"], "</s>")


def test_nothing_is_emitted_after_a_hit():
    matcher = StopStringMatcher(["x"], False)
    assert matcher.feed("abxcd") == ("ab", "x")
    assert matcher.feed("more") == ("", None)
    assert matcher.flush() == ""


def test_first_stop_to_complete_wins():
    # "bc" completes before "abcd" although "abcd" starts earlier; at one end the longer one wins.
    assert run_matcher(["abcd", "bc"], False, ["abcd"]) == (["a"], "bc")
    assert run_matcher(["bc", "abc"], True, ["xabcd"]) == (["xabc"], "abc")


def test_self_overlapping_stop():
    pieces, hit = run_matcher(["aab"], False, list("xaaab!"))
    assert ("".join(pieces), hit) == ("xa", "aab")


def test_no_stop_strings_pass_through():
    matcher = StopStringMatcher([], False)
    assert matcher.feed("anything") == ("anything", None)
    assert matcher.flush() == ""


@pytest.mark.parametrize("include", [False, True])
def test_matches_reference_for_any_split(include):
    rng = random.Random(int(include))
    for _ in range(1000):
        text = "".join(rng.choice("ab c\n") for _ in range(rng.randint(0, 24)))
        stops = ["".join(rng.choice("ab c\n") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        expected_text, expected_hit = reference_stop(text, stops, include)
        pieces, hit = run_matcher(stops, include, split_randomly(text, rng))
        assert ("".join(pieces), hit) == (expected_text, expected_hit), (text, stops)
        emitted = ""
        for piece in pieces:
            emitted += piece
            assert expected_text.startswith(emitted), (text, stops)


@pytest.mark.parametrize("include", [False, True])
def test_self_overlapping_stops_match_reference(include):
    """Two-letter texts and stops of up to 9 characters make the automata fall back often."""
    rng = random.Random(10 + int(include))
    for _ in range(1000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 40)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 9))) for _ in range(rng.randint(1, 4))]
        expected_text, expected_hit = reference_stop(text, stops, include)
        pieces, hit = run_matcher(stops, include, split_randomly(text, rng))
        assert ("".join(pieces), hit) == (expected_text, expected_hit), (text, stops)


def test_held_back_text_is_shorter_than_the_longest_stop():
    stop = "y" + "x" * 99
    matcher = StopStringMatcher([stop, "zz"], False)
    emitted = "".join(matcher.feed("x" * 7 + "y" + "x" * 50)[0] for _ in range(3))
    assert len(emitted) + len(matcher.flush()) == 3 * 58
    assert matcher.feed("yxx") == ("", None)  # "yxx" may begin the stop: held
    assert matcher.feed("x" * 97) == ("", stop)


def test_long_stop_strings_take_linear_memory():
    """The matcher once kept every prefix of every stop string: 20,000 characters needed 200 MB."""
    import tracemalloc

    stop = "x" * 20_000
    tracemalloc.start()
    try:
        matcher = StopStringMatcher([stop, "ab" * 10_000], False)
        pieces = [matcher.feed("x" * 7) for _ in range(3_000)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 10 * 2 ** 20
    assert [(text, hit) for text, hit in pieces if text or hit] == [("", stop)]


@pytest.mark.parametrize("include", [False, True])
def test_stops_completing_before_min_tokens_are_passed_over(include):
    """Deltas fed before min_tokens are reached are not armed: a stop string completing in them does
    not end the text, one completing later does (also when it began in them), as vLLM's rule."""
    assert run_matcher(["ab"], include, ["xab", "yab", "z"], disarmed=1) == (["xab", "yab" if include else "y"], "ab")
    assert run_matcher(["abc"], include, ["xab", "cd"], disarmed=1)[1] == "abc"
    rng = random.Random(20 + int(include))
    for _ in range(1000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        deltas = split_randomly(text, rng)
        disarmed = rng.randint(0, len(deltas))
        expected = reference_stop(text, stops, include, armed_from=len("".join(deltas[:disarmed])))
        pieces, hit = run_matcher(stops, include, deltas, disarmed)
        assert ("".join(pieces), hit) == expected, (text, stops, deltas, disarmed)
