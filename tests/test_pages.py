"""Packed weights placed in the huge-page regions (specbatch.kernels.pages): the same values, in
the order placed, aligned for the kernels, alive as long as their tensors; a layer there multiplies
bitwise as one whose weight stays where torch put it."""

from __future__ import annotations

import gc

import pytest
import torch

from specbatch.kernels import build, pages
from specbatch.kernels.panel import PanelLinear


def test_a_small_tensor_stays_where_it_is():
    tensor = torch.arange(100, dtype=torch.float32)
    assert pages.place(tensor) is tensor


def test_placed_tensors_keep_their_values_in_order_and_aligned():
    tensors = [torch.randn(300, 101), torch.randint(0, 255, (70_001,), dtype=torch.uint8),
               torch.randn(64, 1024).to(torch.bfloat16)]
    placed = [pages.place(t) for t in tensors]
    for tensor, copy in zip(tensors, placed):
        assert copy.dtype == tensor.dtype and copy.shape == tensor.shape and copy.is_contiguous()
        assert torch.equal(copy, tensor) and copy.data_ptr() != tensor.data_ptr()
        assert copy.data_ptr() % pages.ALIGNMENT == 0
    # One after the other, as a model packs its layers (its forward's order), while they fit a region.
    regions = pages._Regions()
    first, second = regions.place(tensors[0]), regions.place(tensors[1])
    assert 0 < second.data_ptr() - first.data_ptr() < first.numel() * first.element_size() + pages.ALIGNMENT


def test_a_tensor_larger_than_a_region_gets_one_and_outlives_it():
    regions = pages._Regions()
    big = torch.randint(0, 255, (pages.REGION + 12_345,), dtype=torch.uint8)
    placed = regions.place(big)
    after = regions.place(torch.ones(pages.SMALLEST, dtype=torch.uint8))  # the big one's region is full
    assert not 0 <= after.data_ptr() - placed.data_ptr() < placed.numel()
    expected = big.clone()
    del regions, big
    gc.collect()
    assert torch.equal(placed, expected) and int(after.sum()) == pages.SMALLEST


@pytest.mark.skipif(not build.available(), reason=f"no panel kernel here: {build.unavailable_reason()}")
@pytest.mark.parametrize("form", ["float32", "q8_0"])
def test_a_placed_layer_multiplies_as_an_unplaced_one(form, monkeypatch):
    if form == "q8_0" and not build.blocks_available():
        pytest.skip("no block kernels here")
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(1040, 576, generator=generator) * 0.05
    x = torch.randn(3, 576, generator=generator)
    placed = PanelLinear(weight, q8_0=form == "q8_0")
    monkeypatch.setattr(pages, "place", lambda tensor: tensor)
    unplaced = PanelLinear(weight, q8_0=form == "q8_0")
    assert placed.panels.data_ptr() != unplaced.panels.data_ptr()
    assert torch.equal(placed(x), unplaced(x))
