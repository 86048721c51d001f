"""Incremental detokenization gives exactly the text of decoding everything at once, through a
fast tokenizer's own incremental decoder and through the Python wrapper alike."""

import random

import pytest

from coordinator.requests import TextStream
from specbatch.models.loading import ModelSpec, load_tokenizer


def stream_all(tokenizer, ids, stops=(), fast=True):
    stream, pieces = TextStream(tokenizer, list(stops)), []
    assert stream.decoder is not None  # these tokenizers are fast ones
    if not fast:
        stream.decoder = None  # two decodes a token through the wrapper, as for a slow tokenizer
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


@pytest.mark.parametrize("fast", [True, False])
def test_word_level_tokenizer(tokenizer, fast):
    ids = [random.Random(1).randrange(5, 90) for _ in range(200)]
    text, _ = stream_all(tokenizer, ids, fast=fast)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("fast", [True, False])
def test_stop_string_held_back_and_cut(tokenizer, fast):
    ids = list(range(10, 40))
    full = tokenizer.decode(ids)
    stop = tokenizer.decode(ids[20:22])  # a two-word stop string
    text, stopped = stream_all(tokenizer, ids, [stop], fast=fast)
    assert stopped and text == full[: full.index(stop)]


@pytest.mark.real_model
@pytest.mark.parametrize("fast", [True, False])
def test_byte_level_bpe_with_multibyte_characters(fast):
    tokenizer = load_tokenizer(ModelSpec())
    sample = "Grüße aus Köln! 你好，世界 🌍🚀 naïve café — ½ ∑ x² … done.\nNew line\tand tab."
    ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
    text, _ = stream_all(tokenizer, ids, fast=fast)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    rng = random.Random(3)
    noise = [rng.randrange(tokenizer.vocab_size) for _ in range(300)]
    text, _ = stream_all(tokenizer, noise, fast=fast)
    assert text == tokenizer.decode(noise, skip_special_tokens=True)
