"""Device helpers the engine's calls share: host tensors to the device without a synchronising copy,
and the attention kernels an eager forward may use there."""

from __future__ import annotations

import contextlib

import torch


def eager_attention(device: torch.device):
    """Where a forward runs eagerly on a GPU, its attention off cuDNN: cuDNN builds a plan for
    every new shape (costly, as SGLang and FlashInfer report too), which captured steps meet only
    at capture, while eager calls (a prompt of a new length, a context one column longer each
    step) meet new shapes nearly every time, so a draft's eager steps cost several times their
    captured ones. The memory-efficient kernel plans nothing and is barely slower a call
    (docs/gpu.md); math where it refuses."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A call's host-built tensor on the engine's device. To a GPU through pinned memory without
    waiting: a plain copy from pageable memory synchronises the stream, so every forward of a
    step would wait for the one before it; this way a step synchronises with the host once, when
    its tokens are read back. (The caching host allocator keeps the pinned block until the copy
    is done.)"""
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def describe(device: torch.device | str) -> dict:
    """What a service's step times depend on, as its CacheStats reports it and a profile records
    it: the device kind and model, and on a CPU the widest vector unit torch uses and whether it
    multiplies bf16 natively (two CPUs of one name differ in both)."""
    device = torch.device(device)
    if device.type == "cuda":
        return {"device": "cuda", "name": torch.cuda.get_device_name(device)}
    from specbatch.kernels import cpu

    return {"device": device.type, "name": cpu.model_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "native_bf16": cpu.multiplies_bf16()}
