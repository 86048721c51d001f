"""Incremental detokenization gives exactly the text of decoding everything at once."""

import random

import pytest

from coordinator.requests import TextStream
from specbatch.models.loading import ModelSpec, load_tokenizer


def stream_all(tokenizer, ids, stops=()):
    stream, pieces = TextStream(tokenizer, list(stops)), []
    stopped = False
    for token in ids:
        if stream.add(token):
            stopped = True
            break
        pieces.append(stream.delta(False))
    if not stopped:
        stream.finish()
    pieces.append(stream.delta(True))
    return "".join(pieces), stopped


def test_word_level_tokenizer(tokenizer):
    ids = [random.Random(1).randrange(5, 90) for _ in range(200)]
    text, _ = stream_all(tokenizer, ids)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_string_held_back_and_cut(tokenizer):
    ids = list(range(10, 40))
    full = tokenizer.decode(ids)
    stop = tokenizer.decode(ids[20:22])  # a two-word stop string
    text, stopped = stream_all(tokenizer, ids, [stop])
    assert stopped and text == full[: full.index(stop)]


@pytest.mark.real_model
def test_byte_level_bpe_with_multibyte_characters():
    tokenizer = load_tokenizer(ModelSpec())
    sample = "Grüße aus Köln! 你好，世界 🌍🚀 naïve café — ½ ∑ x² … done.\nNew line\tand tab."
    ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
    text, _ = stream_all(tokenizer, ids)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    rng = random.Random(3)
    noise = [rng.randrange(tokenizer.vocab_size) for _ in range(300)]
    text, _ = stream_all(tokenizer, noise)
    assert text == tokenizer.decode(noise, skip_special_tokens=True)
