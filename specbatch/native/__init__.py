"""The engine's own float32 matrix multiply for x86 CPUs (``panel_sgemm.c``), built on first use.

Why it exists is in the C file: at the few rows of a decode or verify step it reads the weights
once, at the memory's speed, for up to six rows, and a row's result never depends on the other
rows of the call (the condition for bitwise-exact float32 speculation). ``specbatch.linear`` uses
it for float32 weights where it is available and falls back to oneDNN where it is not.

The library is compiled with the system C compiler (``cc``; gcc or clang) into the cache
(``$SPECBATCH_CACHE/native``), keyed by a hash of the source and flags, and written by an atomic
rename, so processes starting together (the services) never load a half-written file. It links
OpenMP by the soname PyTorch's own runtime carries (``libgomp.so.1``), which torch has loaded by
then: the kernel's threads are torch's OpenMP threads, not a second team spinning beside them.

Off where: the CPU lacks AVX2 or FMA, no C compiler works, or ``SPECBATCH_NATIVE=0``; then
``available()`` is False and says why in ``unavailable_reason()``. ``python -m specbatch.native``
builds it ahead (the container image does, at build time).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("panel_sgemm.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
PANEL = 16  # output features a panel holds: panel_sgemm.c's PANEL


def _cache_dir() -> Path:
    from ..models import cache_root

    return cache_root() / "native"


def _compiler() -> list[str] | None:
    """The C compiler's command: ``$CC`` (split as a shell would: "ccache gcc"), else cc, gcc, clang."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return [found] if found else None


def _why_not() -> str | None:
    if os.environ.get("SPECBATCH_NATIVE", "1") == "0":
        return "SPECBATCH_NATIVE=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2/FMA (PyTorch sees {torch.backends.cpu.get_cpu_capability()})"
    if _compiler() is None:
        return "no C compiler (cc, gcc or clang) to build it with"
    return None


def build(directory: Path | None = None) -> Path:
    """The compiled library's path, compiling it first if the cache lacks this source's build."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or clang)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    directory = directory or _cache_dir()
    target = directory / f"panel_sgemm-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        built = Path(scratch) / target.name
        try:
            result = subprocess.run([*compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True)
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
            log.warning("the float32 panel kernel is unavailable (%s): float32 linear layers run on oneDNN", reason)
        return None
    try:
        library = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError) as error:
        log.warning("the float32 panel kernel is unavailable (%s): float32 linear layers run on oneDNN", error)
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.panel_sgemm.argtypes = [pointer, size, size, pointer, size, pointer, pointer, ctypes.c_int]
    library.panel_sgemm.restype = None
    return library


def available() -> bool:
    """Whether float32 linear layers can run on the panel kernel here (built on the first call)."""
    return _library() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None where it is True)."""
    reason = _why_not()
    if reason is None and _library() is None:
        reason = "it failed to build or load (see the warning logged)"
    return reason


class PanelLinear:
    """``x @ weight.T (+ bias)`` in float32 on the panel kernel; the weight packed once.

    ``weight`` may be the concatenation of several layers' weights (fused QKV, gate/up)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        library = _library()
        if library is None:
            raise RuntimeError(f"the panel kernel is unavailable: {unavailable_reason()}")
        self._multiply = library.panel_sgemm
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        padded = -self.out_features % PANEL
        # [panels, in_features, PANEL]: a panel's weights lie in the order the kernel reads them.
        self.panels = (F.pad(weight, (0, 0, 0, padded)).view(-1, PANEL, self.in_features)
                       .transpose(1, 2).contiguous())
        # The kernel loads a panel's bias 16 at a time: padded so the last panel reads no further.
        self.bias = None if bias is None else F.pad(bias.detach().float(), (0, padded)).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or rows.device.type != "cpu":
            raise TypeError(f"the panel kernel multiplies float32 CPU tensors, not {rows.dtype} on {rows.device}")
        rows = rows.contiguous()
        out = torch.empty(rows.shape[0], self.out_features)
        if rows.shape[0]:
            self._multiply(rows.data_ptr(), rows.shape[0], self.in_features, self.panels.data_ptr(),
                           self.out_features, None if self.bias is None else self.bias.data_ptr(),
                           out.data_ptr(), torch.get_num_threads())
        return out.view(*shape[:-1], self.out_features)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    reason = _why_not()
    if reason:
        print(f"not built: {reason}")
    else:
        print(build())
