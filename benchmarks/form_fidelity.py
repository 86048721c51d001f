"""How far each CPU weight form of the embedded target is from float32 arithmetic on the same weights.

Every form is its own model (docs/exactness.md): it rounds the weights or the layers' inputs its own
way. This measures by how much. The reference is the embedded target as loaded, in float32 on the
float32 kernel (the GGUF's blocks dequantized exactly). Its greedy answers to the chat prompts
(``--answer-tokens`` each, the prompt before) are the texts; each form then reads every text in one
prefill and gives its next-token logits at every position. Per form:

- the share of positions whose top token is the reference's;
- the KL divergence of its next-token distribution from the reference's (mean and 99th percentile).

Beside them, where ``make llamacpp-env`` made ``.venv-llamacpp``, llama.cpp on the same GGUF reads
the same texts a token a call (its batched all-position logits are wrong in that wheel).

    .venv/bin/python benchmarks/form_fidelity.py [--forms q4_1,bf16-dot] [--prompts 24] [--answer-tokens 64]

Writes benchmarks/results/<machine>/form-fidelity.json (or ``--out``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile


def worker() -> None:
    """llama.cpp's logits at every position of each text (in .venv-llamacpp: numpy and ik_llama_cpp
    only): reads {"gguf", "threads", "texts", "out"} from stdin, saves the logits to "out" (.npy)."""
    import numpy as np
    from ik_llama_cpp import _ctypes_api as C
    from ik_llama_cpp._internals import IkContext, IkModel
    from vs_llamacpp import batch_of

    os.dup2(2, 1)  # llama.cpp logs to stdout from C
    request = json.loads(sys.stdin.readline())
    model = IkModel(request["gguf"])
    context = IkContext(model, n_ctx=2048, n_threads=request["threads"], n_seq_max=1, flash_attn=False)
    rows = []
    for text in request["texts"]:
        context.kv_cache_clear()
        for position, token in enumerate(text):
            batch = batch_of([(token, position, 0, True)])
            if context.decode(batch):
                raise RuntimeError("llama_decode failed")
            rows.append(np.ctypeslib.as_array(C.llama_get_logits_ith(context.ctx, 0), shape=(model.n_vocab,)).copy())
            C.llama_batch_free(batch)
    np.save(request["out"], np.stack(rows))


def main(argv: list[str] | None = None) -> int:
    import argparse
    import subprocess

    import torch

    from specbatch.commands import results
    from specbatch.commands.prompts import CHAT_PROMPTS, chat_prompts
    from specbatch.engine.batch import SequenceInput
    from specbatch.engine.engine import WEIGHT_FORMS, Engine
    from specbatch.kernels import forms
    from specbatch.models.embedded import EMBEDDED, EMBEDDED_GGUF
    from specbatch.models.loading import ModelSpec, embedded_gguf_folder, load_model, load_tokenizer
    from specbatch.stack.defaults import available_cores

    runnable = [form for form in ("q4_1", "bf16-dot", "fp16-dot", "bf16") if WEIGHT_FORMS[form][1]()]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forms", default=",".join(runnable), help="weight forms to compare (default: all that run "
                        "here)")
    parser.add_argument("--prompts", type=int, default=24, help="chat prompts")
    parser.add_argument("--answer-tokens", type=int, default=64, help="reference tokens after each prompt")
    parser.add_argument("--llamacpp-python", default=".venv-llamacpp/bin/python",
                        help="the Python of an environment with ik-llama-cpp-python (skipped where missing)")
    results.add_output_flags(parser, "form-fidelity")
    args = parser.parse_args(argv)
    threads = available_cores()
    torch.set_num_threads(threads)

    def engine(form: str | None) -> Engine:
        model = load_model(ModelSpec(EMBEDDED), torch.device("cpu"), torch.float32)
        return Engine(model, max_sequences=2, max_context=2048, max_cache_bytes=2**30, captured_steps="off",
                      weights=form, kv_bf16=form is not None and forms.kv_bf16(form))

    def logits(target: Engine, tokens: list[int]) -> torch.Tensor:
        batch = target.start([SequenceInput("text", 0, tokens)], create=True)
        out = batch.prefill(logits_to_keep=len(tokens))[0].double()
        target.release(["text"])
        return out

    reference = engine(None)
    texts = []
    for prompt in chat_prompts(load_tokenizer(ModelSpec(EMBEDDED)), CHAT_PROMPTS, 512)[: args.prompts]:
        text = list(prompt)
        for _ in range(args.answer_tokens):
            text.append(int(logits(reference, text)[-1].argmax()))
        texts.append(text)
    expected = torch.cat([logits(reference, text) for text in texts]).log_softmax(-1)
    del reference

    def compared(name: str, got: torch.Tensor) -> dict:
        log_p = got.log_softmax(-1)
        kl = (expected.exp() * (expected - log_p)).sum(-1)
        return {"form": name, "positions": len(kl),
                "top token as float32": float((got.argmax(-1) == expected.argmax(-1)).double().mean()),
                "mean KL": float(kl.mean()), "p99 KL": float(kl.quantile(0.99))}

    rows = []
    for form in [f for f in args.forms.split(",") if f]:
        target = engine(form)
        rows.append(compared(form, torch.cat([logits(target, text) for text in texts])))
        print(rows[-1], flush=True)
        del target
    if os.path.exists(args.llamacpp_python):
        import numpy as np

        with tempfile.TemporaryDirectory() as scratch:
            out = os.path.join(scratch, "logits.npy")
            request = {"gguf": str(embedded_gguf_folder() / EMBEDDED_GGUF), "threads": threads, "texts": texts,
                       "out": out}
            subprocess.run([args.llamacpp_python, __file__, "--worker"], input=json.dumps(request) + "\n", text=True,
                           check=True)
            rows.append(compared("llama.cpp", torch.from_numpy(np.load(out)).double()))
            print(rows[-1], flush=True)
    print(results.table(rows))
    results.write("form-fidelity", {"prompts": len(texts), "answer_tokens": args.answer_tokens, "rows": rows},
                  args.out, args.variant)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker()
    else:
        sys.exit(main())
