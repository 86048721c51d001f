"""Out of KV memory: a request waits for room while others run, and only a request that can never
fit is refused, with RESOURCE_EXHAUSTED; nothing else in flight is lost."""

import threading
import time

import grpc
import pytest
from tiny import greedy_reference

from specbatch.rpc.client import generate, make_request
from specbatch.stack.in_process import start_local_stack


def test_kv_budget_waits_or_refuses_without_harming_others(target_model, draft_model, tokenizer):
    # 100 kB of KV pool on the target, 768 bytes per token and slot: the small request (45 tokens)
    # fits beside anything that fits at all; the medium one (111 tokens, 85 kB) fits only alone;
    # the big one (201 tokens, 154 kB) never does.
    stack = start_local_stack(target_model, draft_model, tokenizer,
                              target_engine_options={"max_cache_bytes": 100_000})
    try:
        small_prompt, medium_prompt = [1, 9, 17, 33], [1] + [8] * 99
        results = {}

        def run(name, prompt, n):
            results[name] = generate(stack.client(), make_request(prompt, n, k=2, ignore_eos=True))

        small = threading.Thread(target=run, args=("small", small_prompt, 40))
        small.start()
        deadline = time.monotonic() + 30
        while not stack.target_engine.sequences and time.monotonic() < deadline:
            time.sleep(0.002)  # the others must arrive while the small one runs
        medium = threading.Thread(target=run, args=("medium", medium_prompt, 10))
        medium.start()
        with pytest.raises(grpc.RpcError) as refused:
            generate(stack.client(), make_request([1] + [7] * 199, 20, k=2, ignore_eos=True))
        small.join(timeout=60)
        medium.join(timeout=60)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "KV cache" in refused.value.details()
        assert results["small"].token_ids == greedy_reference(target_model, small_prompt, 40)
        assert results["medium"].token_ids == greedy_reference(target_model, medium_prompt, 10)
        again = generate(stack.client(), make_request(small_prompt, 10, k=3, ignore_eos=True))
        assert again.token_ids == greedy_reference(target_model, small_prompt, 10)
    finally:
        stack.stop()
