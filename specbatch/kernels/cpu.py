"""What this CPU and this machine offer the kernels, read once and without importing torch: the
CPU's feature flags and model name, and the C compiler the kernels build with. The launcher asks
what will build before it starts any service; ``specbatch.kernels.build`` compiles for the same
features."""

from __future__ import annotations

import functools
import os
import platform
import shlex
import shutil
import subprocess
from pathlib import Path


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


# Flags to leave unused, by prefix, comma-separated ("avx512,amx": run as an AVX2-only CPU does), so
# that one machine builds, tests and times the kernels another CPU form would run.
WITHOUT_ENV = "SPECBATCH_CPU_WITHOUT"


def withheld() -> tuple[str, ...]:
    """The flag prefixes ``$SPECBATCH_CPU_WITHOUT`` leaves unused (empty: the CPU as it is)."""
    return tuple(prefix for prefix in os.environ.get(WITHOUT_ENV, "").split(",") if prefix)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where there is none), less those
    ``$SPECBATCH_CPU_WITHOUT`` names."""
    without = withheld()
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):
            return frozenset(flag for flag in line.partition(":")[2].split() if not flag.startswith(without))
    return frozenset()


def has(flag: str) -> bool:
    """Whether the CPU lists ``flag`` (avx2, avx512_bf16, avx512_fp16, avx512_vnni, amx_bf16 …)."""
    return flag in cpu_flags()


def model_name() -> str:
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def multiplies_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512_BF16 or AMX): where ``--dtype auto`` is bf16."""
    return has("avx512_bf16") or has("amx_bf16")


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


def kernels_expected() -> bool:
    """Whether the kernels should build here, as ``build.available()`` decides it: an x86-64 CPU
    with AVX2 and FMA, a C compiler, and not switched off (``SPECBATCH_NATIVE=0``)."""
    return (os.environ.get("SPECBATCH_NATIVE", "1") != "0" and platform.machine().lower() in ("x86_64", "amd64")
            and has("avx2") and has("fma") and c_compiler() is not None)


def bf16_dot_expected() -> bool:
    """Whether the bf16 dot-product kernel should build here: the kernels and AVX512_BF16."""
    return kernels_expected() and has("avx512_bf16")


def blocks_expected() -> bool:
    """Whether the multiplies of GGUF's blocks should build here: the kernels, and AVX512_VNNI or
    F16C (every AVX2 CPU has it)."""
    return kernels_expected() and (has("avx512_vnni") or has("f16c"))


def blocks_on_avx2() -> bool:
    """Whether the GGUF block multiplies build for AVX2 here (no AVX512_VNNI to use): their steps
    cost differently from the AVX-512 build's, so the embedded pair's profiles differ too."""
    return blocks_expected() and not (has("avx512f") and has("avx512_vnni"))


def fp16_dot_expected() -> bool:
    """Whether the float16 kernel should build here: the kernels, AVX512_FP16 and a compiler that
    knows it (gcc 12 or later)."""
    return kernels_expected() and has("avx512_fp16") and compiler_accepts("-mavx512fp16")
