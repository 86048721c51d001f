"""The engine's own float32 kernel (specbatch.native): the product, and a row's bits independent of
the other rows of the call and of the thread count, which bitwise-exact fp32 speculation needs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specbatch import native
from specbatch.linear import fused, linear

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no panel kernel here: {native.unavailable_reason()}")

# Shapes with a partial last panel (N % 16), odd K, SmolLM2's MLP and a head-sized slice.
SHAPES = [(17, 5), (96, 64), (40, 33), (3072, 576), (576, 1536), (4099, 576)]


@pytest.mark.parametrize("out_features,in_features", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_linear_is_the_product(out_features, in_features, with_bias):
    generator = torch.Generator().manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.05
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    layer = native.PanelLinear(weight, bias)
    x = torch.randn(2, 7, in_features, generator=generator)
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    out = layer(x)
    assert out.shape == (2, 7, out_features) and out.dtype == torch.float32
    # float32 sums of in_features terms: within a few ulps of the float64 product's magnitude
    bound = 1e-6 * in_features * (x.double().abs() @ weight.double().abs().T + 1)
    assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out_features,in_features", [(40, 33), (960, 576), (576, 1536)])
def test_a_row_gets_the_same_bits_at_any_row_count_and_thread_count(out_features, in_features, threads):
    """Each row is summed in one fixed order (k = 0 .. K-1, one FMA a term) whatever the register
    block it lands in (1-6 rows; 7 rows split 4 + 3, 13 rows 5 + 4 + 4, ...) or which thread
    computes its panel."""
    generator = torch.Generator().manual_seed(3)
    layer = native.PanelLinear(torch.randn(out_features, in_features, generator=generator) * 0.05)
    x = torch.randn(40, in_features, generator=generator)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
        torch.set_num_threads(threads)
        for rows in list(range(1, 15)) + [17, 25, 40]:
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows
    finally:
        torch.set_num_threads(before)


def test_engine_layers_pick_the_panel_kernel_for_float32_only():
    weight = torch.randn(32, 16)
    assert type(linear(weight)).__name__ == "PanelLinear"
    assert type(linear(weight.to(torch.bfloat16))).__name__ == "PackedLinear"
    layers = [torch.nn.Linear(16, 8, bias=False), torch.nn.Linear(16, 24, bias=True)]
    both = fused(*layers)
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = torch.cat([layer(x) for layer in layers], dim=-1)
    torch.testing.assert_close(both(x), expected, rtol=1e-5, atol=1e-5)
    assert both(torch.empty(0, 16)).shape == (0, 32)


def test_refuses_other_dtypes():
    layer = native.PanelLinear(torch.randn(16, 8))
    with pytest.raises(TypeError):
        layer(torch.randn(2, 8, dtype=torch.float64))


def test_switched_off_by_the_environment():
    code = "from specbatch import native; print(native.available(), native.unavailable_reason())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "SPECBATCH_NATIVE": "0"}, check=True)
    assert result.stdout.split() == ["False", "SPECBATCH_NATIVE=0"]


def test_builds_into_a_fresh_directory(tmp_path):
    """A cold cache compiles the library (as a fresh container or CI machine does) and reuses it."""
    built = native.build(tmp_path)
    assert built.parent == tmp_path and built.stat().st_size > 0
    assert native.build(tmp_path) == built and len(list(tmp_path.iterdir())) == 1  # no scratch left behind


def test_a_compiler_that_fails_is_reported(tmp_path, monkeypatch):
    """A broken $CC raises with the compiler's name (the engine then logs it and runs oneDNN)."""
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="false failed"):
        native.build(tmp_path)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="no-such-compiler"):
        native.build(tmp_path)
    assert not list(tmp_path.glob("*.so"))
