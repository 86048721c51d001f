"""The C compiler the engine's kernels (``specbatch.kernels.native``) build with, found without importing
torch: the launcher asks what will build before it starts any service."""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess


def c_compiler() -> list[str] | None:
    """The C compiler's command: ``$CC`` (split as a shell would: "ccache gcc"), else cc, gcc, clang."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return [found] if found else None


def compiler_accepts(flag: str) -> bool:
    """Whether that compiler takes ``flag`` (asked once per flag and compiler)."""
    return _accepts(flag, tuple(c_compiler() or ()))


@functools.lru_cache(maxsize=None)
def _accepts(flag: str, compiler: tuple[str, ...]) -> bool:
    if not compiler:
        return False
    try:
        return subprocess.run([*compiler, flag, "-E", "-x", "c", os.devnull], capture_output=True).returncode == 0
    except OSError:
        return False
