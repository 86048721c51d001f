"""Which weight form each model service runs: the machine decides (``--weights auto``), an operator
may name one. Torch-free: ``specbatch up`` decides before it starts the services (it picks the
shipped profile measured on that form), and each service decides the same way for itself.

The forms, all on the engine's CPU kernels and all row-exact (a row's result never depends on the
other rows of a call, so a target running one speculates exactly against its own target-only
decoding):

- ``fp16-dot``: weights and inputs rounded to float16, summed on AVX512_FP16;
- ``bf16-dot``: weights and inputs rounded to bfloat16, pairs summed in float32 on AVX512_BF16;
- ``bf16``: weights rounded to bfloat16, float32 arithmetic (any CPU with AVX2);
- ``q4_1``: the embedded GGUF's own blocks (Q4_1 layers, a Q8_0 head), each input row quantized
  to 8 bits as llama.cpp does, exact integer sums (AVX512_VNNI, or AVX2: the same bits);
- ``q8_0``: every weight in GGUF's Q8_0 blocks, each input row quantized to 8 bits likewise (the
  embedded draft's form: half of bf16's bytes; its proposals move a little, the output does not);
- ``model``: the model as loaded, in ``--dtype`` (a GPU, another model, or no kernels here).

Why each default is what it is: docs/decisions/weights-auto.md and q8_0-draft.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from specbatch.kernels import cpu

# The forms whose layers round their inputs to 16 bits or fewer: keys and values are kept in bf16
# beside them (docs/decisions/kv-bf16.md).
SIXTEEN_BIT_FORMS = frozenset({"bf16-dot", "fp16-dot", "q4_1", "q8_0"})
CPU_FORMS = frozenset({"bf16"}) | SIXTEEN_BIT_FORMS
# The forms in GGUF's blocks, multiplied with AVX512_VNNI where the CPU has it, else with AVX2.
BLOCK_FORMS = frozenset({"q4_1", "q8_0"})


@dataclass(frozen=True)
class Forms:
    """The weight forms of a target and its draft."""

    target: str
    draft: str


def dtype_for(form: str, dtype: str | None) -> str | None:
    """The dtype a service with this weight form loads its model in: float32 beside a CPU form
    (their arithmetic is float32), else ``--dtype`` as given."""
    return "float32" if form in CPU_FORMS else dtype


def machine_target_form() -> str:
    """The embedded target's form on this CPU: the GGUF's own blocks where their kernels build
    (AVX512_VNNI, or AVX2 with F16C; AVX512_FP16's float16 products read three times their bytes),
    else bf16 weights where the kernels build, else the model as loaded."""
    if cpu.blocks_expected():
        return "q4_1"
    return "bf16" if cpu.kernels_expected() else "model"


def decide(weights: str, embedded: bool, device: str, dtype: str | None) -> Forms:
    """The forms for ``--weights`` (auto or a form) of a pair. The embedded pair on a CPU takes the
    machine's form where the kernels build (another form where one is named), with the draft in
    Q8_0 blocks wherever the target runs float32 arithmetic and their kernels build; any other
    pair (another model, a GPU) runs as loaded unless a form is named, and then both take it where
    they can (the draft not Q4_1, which the embedded GGUF's layers are)."""
    embedded_cpu = embedded and device == "cpu"
    if weights == "auto":
        weights = machine_target_form() if embedded_cpu and dtype in (None, "auto") else "model"
    if not embedded_cpu:
        return Forms(weights, weights if weights != "q4_1" else "model")
    float32 = weights != "model" or dtype in ("float32", "fp32") or (dtype in (None, "auto") and not cpu.multiplies_bf16())
    return Forms(weights, "q8_0" if float32 and cpu.blocks_expected() else "model")


# What each CPU form needs of the machine, torch-free: the check and how a refusal names it.
NEEDS = {"bf16": ("kernels_expected", "the engine's kernels (an x86 CPU with AVX2 and a C compiler)"),
         "bf16-dot": ("bf16_dot_expected", "a CPU with AVX512_BF16"),
         "q4_1": ("blocks_expected", "a CPU with AVX512_VNNI, or AVX2 with F16C"),
         "fp16-dot": ("fp16_dot_expected", "a CPU with AVX512_FP16"),
         "q8_0": ("blocks_expected", "a CPU with AVX512_VNNI, or AVX2 with F16C")}


def problem(form: str, device: str, dtype: str | None) -> str | None:
    """Why ``form`` cannot run on this machine, device and dtype (None: it can)."""
    if form not in CPU_FORMS:
        return None
    check, needs = NEEDS[form]
    if device != "cpu":
        return f"--weights {form} is for the CPU (not {device})"
    if dtype not in (None, "auto", "float32", "fp32"):
        return f"--weights {form} computes in float32: drop --dtype {dtype}"
    if not getattr(cpu, check)():
        return f"--weights {form} needs {needs}, which this machine lacks"
    return None


def kv_bf16(form: str) -> bool:
    """Whether a service keeps its keys and values in bf16: beside the forms that round their
    inputs to 16 bits or fewer."""
    return form in SIXTEEN_BIT_FORMS


def engine_options(form: str, device: str) -> dict:
    """What an engine running ``form`` on ``device`` is built with (``Engine``'s ``weights`` and
    ``kv_bf16``): the form (None: the model as loaded), and bf16 keys and values beside a form that
    rounds its inputs, on a CPU."""
    return {"weights": None if form == "model" else form, "kv_bf16": device == "cpu" and kv_bf16(form)}
