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


def _messages(request):
    out = []
    while not request.events.empty():
        out.append(request.events.get_nowait())
    return out


def test_a_stream_sends_its_first_tokens_at_once_then_every_interval_and_all_at_its_end(tokenizer):
    """--stream-interval 3: the first step's tokens go out at once, then a message whenever 3 or
    more wait, and at the finish every token left with the text's rest; the token ids and the text
    put together are the whole output, as with one message a step."""
    from coordinator.by_hand import greedy_request

    request = greedy_request("r", [1, 2], max_new_tokens=9, tokenizer=tokenizer)
    request.stream_interval = 3
    sizes = []
    for step in ([11], [12], [13, 14], [15], [16], [17, 18, 19, 20]):  # the last step passes max_new_tokens
        request.take(step)
        sizes.append([len(m.token_ids) for m in _messages(request)])
    assert sizes == [[1], [], [3], [], [], [5, 0]]  # at the finish 15-19 (20 is past it), then the stats
    assert request.generated == 9 and request.sent == 9
    ids = list(range(11, 20))
    request = greedy_request("r", [1, 2], max_new_tokens=9, tokenizer=tokenizer)
    request.stream_interval = 3
    messages = []
    for step in ([11], [12], [13, 14], [15], [16], [17, 18, 19, 20]):
        request.take(step)
        messages += _messages(request)
    assert [t for m in messages for t in m.token_ids] == ids
    assert "".join(m.text for m in messages) == tokenizer.decode(ids, skip_special_tokens=True)
    assert messages[-1].finish_reason and messages[-1].stats.generated_tokens == 9


def test_a_stream_interval_of_0_sends_the_whole_output_in_its_last_response(tokenizer):
    """A request's stream_interval 0 (a client that reads whole answers): nothing until the finish,
    then one response with every token, the whole text, the finish reason and the stats."""
    from coordinator.by_hand import greedy_request

    request = greedy_request("r", [1, 2], max_new_tokens=9, tokenizer=tokenizer)
    request.stream_interval = 0
    sizes = []
    for step in ([11], [12], [13, 14], [15], [16], [17, 18, 19, 20]):
        request.take(step)
        sizes.append([len(m.token_ids) for m in _messages(request)])
    assert sizes == [[], [], [], [], [], [9]]
    request = greedy_request("r", [1, 2], max_new_tokens=9, tokenizer=tokenizer)
    request.stream_interval = 0
    for step in ([11], [12], [13, 14], [15], [16], [17, 18, 19, 20]):
        request.take(step)
    (last,) = _messages(request)
    assert list(last.token_ids) == list(range(11, 20)) and last.finish_reason and last.stats.generated_tokens == 9
    assert last.text == tokenizer.decode(list(range(11, 20)), skip_special_tokens=True)


def test_a_refused_stream_still_sends_the_tokens_it_held(tokenizer):
    from coordinator.by_hand import greedy_request

    request = greedy_request("r", [1], max_new_tokens=20, tokenizer=tokenizer)
    request.stream_interval = 8
    request.take([11])
    request.take([12, 13])
    request.fail("UNAVAILABLE", "the target went away")
    messages = _messages(request)
    assert [list(m.token_ids) for m in messages[:-1]] == [[11], [12, 13]] and messages[-1] is request.failure


def test_a_coordinator_with_a_stream_interval_streams_the_same_output_in_fewer_messages(target_model, draft_model,
                                                                                       tokenizer):
    """Served: the same greedy tokens and text with --stream-interval 4 as with 1, in fewer
    messages (a message a step with 1; at most one per 4 tokens, plus the first and the last,
    with 4), the first token still in the first."""
    from specbatch.rpc.client import generate, make_request
    from specbatch.stack.in_process import start_local_stack

    outputs = {}
    for interval in (1, 4):
        stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=4, stream_interval=interval)
        try:
            sizes = []
            result = generate(stack.client(), make_request([5, 6, 7, 8], 40, k=2, ignore_eos=True),
                              on_response=lambda response: sizes.append(len(response.token_ids)))
            outputs[interval] = (result.token_ids, result.text, sizes)
        finally:
            stack.stop()
    (ids, text, per_step), (ids4, text4, sizes) = outputs[1], outputs[4]
    assert ids4 == ids and text4 == text and len(ids) == 40
    assert sizes[0] >= 1 and all(s >= 4 for s in sizes[1:-2]) and len(sizes) <= 40 // 4 + 2 < len(per_step)


def test_a_request_sets_its_own_stream_interval(target_model, draft_model, tokenizer):
    """A request's stream_interval overrides the coordinator's: 0 gives the same greedy output in
    one response; 3 streams as --stream-interval 3 would; a negative one is refused."""
    import grpc
    import pytest

    from specbatch.rpc.client import generate, make_request
    from specbatch.stack.in_process import start_local_stack

    stack = start_local_stack(target_model, draft_model, tokenizer, max_batch_size=4)
    try:
        runs = {}
        for interval in (None, 0, 3):
            sizes = []
            result = generate(stack.client(), make_request([5, 6, 7, 8], 30, k=2, ignore_eos=True,
                                                           stream_interval=interval),
                              on_response=lambda response: sizes.append(len(response.token_ids)))
            runs[interval] = (result.token_ids, result.text, result.stats.generated_tokens, sizes)
        ids, text, _, per_step = runs[None]
        assert len(ids) == 30 and len(per_step) > 10
        assert runs[0] == (ids, text, 30, [30])
        ids3, text3, _, sizes3 = runs[3]
        assert (ids3, text3) == (ids, text) and sizes3[0] >= 1 and all(s >= 3 for s in sizes3[1:-2])
        with pytest.raises(grpc.RpcError) as refused:
            generate(stack.client(), make_request([5, 6], 4, stream_interval=-1))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stream_interval" in refused.value.details()
    finally:
        stack.stop()
