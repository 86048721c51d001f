"""The engine's own float32 kernels for x86 CPUs, built on first use: a matrix multiply
(``panel_sgemm.c``; with bf16 dot products ``panel_dpbf16.c`` on AVX512_BF16, and there over
GGUF's Q4_1 blocks ``panel_q4_1.c``; with float16 products ``panel_fp16.c`` on AVX512_FP16),
attention (``attention.c``) and a layer's small operations between them (``layer_ops.c``:
residual add with RMS norm, rotary embedding with the KV write, SiLU-gated multiply) for the few
rows of a decode or verify step.

Why they exist is in the C files: at the few rows of a step the multiply reads the weights once,
at the memory's speed, for up to six rows, and attention and the small operations do their few
microseconds of arithmetic without PyTorch's per-operator set-up; and a row's result never depends
on the other rows of the call (the condition for bitwise-exact float32 speculation).
``specbatch.kernels.linear`` uses the multiply for float32 weights and ``specbatch.models.llama`` the rest for
float32 on a CPU, where they are available, and falls back to oneDNN, PyTorch's SDPA and its
operators where they are not.

The library is compiled with the system C compiler (``cc``; gcc or clang) into the cache
(``$SPECBATCH_CACHE/native``), keyed by a hash of the source and flags, and written by an atomic
rename, so processes starting together (the services) never load a half-written file. It links
OpenMP by the soname PyTorch's own runtime carries (``libgomp.so.1``), which torch has loaded by
then: the kernel's threads are torch's OpenMP threads, not a second team spinning beside them.

Off where: the CPU lacks AVX2 or FMA, no C compiler works, or ``SPECBATCH_NATIVE=0``; then
``available()`` is False and says why in ``unavailable_reason()``. ``python -m specbatch.kernels.build``
builds it ahead (the container image does, at build time)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from specbatch.kernels import cpu
from specbatch.kernels.cpu import c_compiler

log = logging.getLogger(__name__)


SOURCES = tuple(Path(__file__).parent / "c" / name
                for name in ("panel_blocks.c", "panel_sgemm.c", "panel_dpbf16.c", "panel_q4_1.c", "panel_fp16.c",
                             "panel_q8_0.c", "attention.c", "layer_ops.c", "decoder.c"))


FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")


# Where the CPU has AVX-512, the same code compiled for it: 32 vector registers instead of 16, so
# wider register blocks fit (panel_sgemm.c's BF16_PANELS). Part of the build's cache key.
AVX512_FLAGS = ("-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq")


# Where the CPU has AVX512_BF16 besides: panel_dpbf16.c, bf16 dot products (compiled only then).
BF16_DOT_FLAGS = ("-mavx512bf16",)


# Where the CPU has AVX512_FP16 besides: panel_fp16.c, float16 products (compiled only then; a
# compiler without the flag (gcc < 12) builds the rest without it).
FP16_DOT_FLAGS = ("-mavx512fp16",)


# Where the CPU has AVX512_VNNI besides: panel_q4_1.c and panel_q8_0.c sum their blocks on vpdpbusd
# (elsewhere on AVX2's vpmaddubsw, the same bits).
VNNI_FLAGS = ("-mavx512vnni",)


PANEL = 16  # output features a panel holds: panel_sgemm.c's PANEL


FP16_PANEL = 32  # panel_fp16.c's FP16_PANEL


def _cache_dir() -> Path:
    from specbatch.cache import cache_root

    return cache_root() / "native"


def _why_not() -> str | None:
    if os.environ.get("SPECBATCH_NATIVE", "1") == "0":
        return "SPECBATCH_NATIVE=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2/FMA (PyTorch sees {torch.backends.cpu.get_cpu_capability()})"
    if c_compiler() is None:
        return "no C compiler (cc, gcc or clang) to build it with"
    return None


def flags(fp16: bool = True) -> tuple[str, ...]:
    """The compiler flags for this CPU: ``FLAGS``, ``AVX512_FLAGS`` where PyTorch sees AVX-512 and
    ``cpu`` lists AVX512F (not where ``$SPECBATCH_CPU_WITHOUT`` leaves it unused), and
    with them ``BF16_DOT_FLAGS`` where the CPU has AVX512_BF16 and ``FP16_DOT_FLAGS`` where it has
    AVX512_FP16 (unless ``fp16`` is False)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512" or not cpu.has("avx512f"):
        return FLAGS
    return (FLAGS + AVX512_FLAGS + (BF16_DOT_FLAGS if cpu.has("avx512_bf16") else ())
            + (VNNI_FLAGS if cpu.has("avx512_vnni") else ()) + (FP16_DOT_FLAGS if fp16 and cpu.has("avx512_fp16") else ()))


def build(directory: Path | None = None, build_flags: tuple[str, ...] | None = None,
          sources: tuple[Path, ...] = SOURCES) -> Path:
    """The compiled library's path, compiling it first if the cache lacks this source's build
    (with ``build_flags``, default ``flags()``; ``sources``: ``SOURCES``, or another tree's copy
    of them, as benchmarks/kernels_ab.py builds a past revision's)."""
    compiler = c_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or clang)")
    source, build_flags = b"".join(path.read_bytes() for path in sources), build_flags or flags()
    key = hashlib.sha256(source + " ".join(build_flags).encode()).hexdigest()[:16]
    directory = directory or _cache_dir()
    target = directory / f"specbatch-native-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        built = Path(scratch) / target.name
        try:
            result = subprocess.run([*compiler, *build_flags, *map(str, sources), "-o", str(built)],
                                    capture_output=True, text=True)
        except OSError as error:  # $CC names no program
            raise RuntimeError(f"{' '.join(compiler)}: {error}") from error
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(compiler)} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: a process loading it sees the whole file or none
    return target


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    reason = _why_not()
    if reason is not None:
        if reason != "SPECBATCH_NATIVE=0":
            log.warning("the float32 kernels are unavailable (%s): float32 linear layers run on oneDNN, "
                        "attention on PyTorch's SDPA", reason)
        return None
    try:
        try:
            return load(build())
        except RuntimeError as error:
            if flags(fp16=False) == flags():
                raise
            log.warning("the float16 multiply did not build (%s): building the kernels without it", error)
            return load(build(build_flags=flags(fp16=False)))
    except (OSError, RuntimeError) as error:
        log.warning("the float32 kernels are unavailable (%s): float32 linear layers run on oneDNN, "
                    "attention on PyTorch's SDPA", error)
        return None


def load(path: Path) -> ctypes.CDLL:
    """A built library, its entry points' argument types set (``_library``'s, or a second build's
    beside it)."""
    library = ctypes.CDLL(str(path))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    # Every form's multiply is reached through decoder.c's one entry, by a PanelLinear's _LinearArgs.
    library.panel_linear_multiply.argtypes = [pointer, pointer, size, pointer, ctypes.c_int]
    library.panel_linear_multiply.restype = ctypes.c_int
    library.attend.argtypes = [pointer, size, size, size, pointer, pointer, size, size, ctypes.c_int, pointer,
                               pointer, size, size, size, size, size, size, ctypes.c_float, ctypes.c_int]
    library.attend.restype = ctypes.c_int
    library.add_rms_norm.argtypes = [pointer, pointer, size, size, pointer, ctypes.c_float, pointer, ctypes.c_int]
    library.add_rms_norm.restype = None
    library.silu_mul.argtypes = [pointer, size, size, pointer, ctypes.c_int]
    library.silu_mul.restype = None
    library.rope_write.argtypes = [pointer, size, size, size, size, size, pointer, pointer, pointer, pointer,
                                   pointer, pointer, size, size, ctypes.c_int, ctypes.c_int]
    library.rope_write.restype = ctypes.c_int
    library.argmax_rows.argtypes = [pointer, size, size, pointer]
    library.argmax_rows.restype = None
    library.decoder_layers.argtypes = [pointer, size, size, pointer, size, size, size, size, size, pointer, pointer,
                                       pointer, pointer, pointer, size, size, size, size, ctypes.c_int, pointer, size,
                                       pointer, ctypes.c_float, pointer, ctypes.c_int]
    library.decoder_layers.restype = ctypes.c_int
    library.draft_chain.argtypes = [pointer, pointer, pointer, pointer, size, size, pointer, size, size, size, size,
                                    size, pointer, pointer, pointer, size, pointer, size, pointer, pointer, pointer,
                                    size, size, size, size, ctypes.c_int, pointer, ctypes.c_float, pointer, pointer,
                                    pointer, pointer, ctypes.c_int]
    library.draft_chain.restype = ctypes.c_int
    return library


def available() -> bool:
    """Whether the float32 kernels can run here (built on the first call)."""
    return _library() is not None


def bf16_dot_available() -> bool:
    """Whether the bf16 dot-product multiply (``panel_dpbf16.c``) runs here: the kernels built for a
    CPU with AVX512_BF16."""
    library = _library()
    return library is not None and hasattr(library, "panel_dpbf16")


def fp16_dot_available() -> bool:
    """Whether the float16 multiply (``panel_fp16.c``) runs here: the kernels built for a CPU with
    AVX512_FP16."""
    library = _library()
    return library is not None and hasattr(library, "panel_fp16")


def blocks_available() -> bool:
    """Whether the multiplies of GGUF's blocks (``panel_q4_1.c``, ``panel_q8_0.c``) run here: the
    kernels built (on AVX512_VNNI, else on AVX2 with F16C)."""
    library = _library()
    return library is not None and hasattr(library, "panel_q4_1")


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None where it is True)."""
    reason = _why_not()
    if reason is None and _library() is None:
        reason = "it failed to build or load (see the warning logged)"
    return reason


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    reason = _why_not()
    if reason:
        print(f"not built: {reason}")
    else:
        print(build())
