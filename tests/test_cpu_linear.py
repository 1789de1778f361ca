"""pagedkv.engine.execution.cpu_linear: which projections get oneDNN-packed weights, that they compute the same
function, and that the model is left alone when the packing ops are missing."""
import pytest
import torch
from torch import nn

from pagedkv.engine.execution import cpu_linear


def toy():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.Linear(256, 64, bias=False), nn.Linear(64, 512, bias=False))


@pytest.mark.skipif(cpu_linear._onednn_ops() is None or not torch.backends.mkldnn.is_available(),
                    reason="this torch build has no oneDNN linear")
def test_packs_only_wide_projections_and_keeps_results():
    model = toy()
    x = torch.randn(16, 32)
    with torch.inference_mode():
        expected = model(x)
    replaced = cpu_linear.pack_wide_linears(model, min_ratio=4.0)
    assert replaced == ["0", "2"]                      # 32 -> 256 and 64 -> 512; 256 -> 64 stays
    assert isinstance(model[0], cpu_linear.PackedLinear) and isinstance(model[1], nn.Linear)
    with torch.inference_mode():
        for rows in (1, 16, 300):                      # any batch size, not only the packing hint
            xr = torch.randn(rows, 32)
            torch.testing.assert_close(model(xr), toy()(xr), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=1e-4)


def test_leaves_model_alone_without_onednn(monkeypatch):
    monkeypatch.setattr(cpu_linear, "_onednn_ops", lambda: None)
    model = toy()
    assert cpu_linear.pack_wide_linears(model) == []
    assert all(isinstance(m, nn.Linear) for m in model)


def test_skips_non_fp32_weights():
    model = toy().to(torch.bfloat16)
    assert cpu_linear.pack_wide_linears(model) == []
