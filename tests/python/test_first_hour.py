"""What a new user meets first: FusedMoE's initial weights, a quantized layer run before
its weights are loaded, and the import error without the compiled extension."""
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import moelora  # noqa: E402


def test_fused_moe_initialises_its_weights_like_linear():
    torch.manual_seed(0)
    layer = moelora.FusedMoE(8, 2, 64, 32, dtype=torch.float32)
    for weight, fan_in in ((layer.w13, 64), (layer.w2, 32)):
        bound = fan_in ** -0.5
        assert torch.isfinite(weight).all()
        assert weight.abs().max() <= bound
        assert weight.std() > 0.5 * bound / 3 ** 0.5  # U(-b, b) has std b / sqrt(3)
    out = layer(torch.randn(5, 64), torch.randn(5, 8))
    assert torch.isfinite(out).all() and out.abs().max() > 0


def test_quantized_layer_refuses_to_run_before_its_weights_are_loaded():
    layer = moelora.FusedMoE(8, 2, 128, 128, dtype=torch.bfloat16, quant="fp8_block")
    x, logits = torch.randn(3, 128, dtype=torch.bfloat16), torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"quantized experts \(fp8_block\) are not loaded: call load_weights"):
        layer(x, logits)
    layer.load_weights(torch.randn(8, 256, 128) * 0.05, torch.randn(8, 128, 128) * 0.05)
    assert torch.isfinite(layer(x, logits).float()).all()


def test_import_without_the_extension_says_what_to_run(tmp_path):
    package = os.path.dirname(moelora.__file__)
    shutil.copytree(package, tmp_path / "moelora", ignore=shutil.ignore_patterns("_moelora*", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "MOELORA_EXT_DIR"}
    env["PYTHONPATH"] = str(tmp_path)
    result = subprocess.run([sys.executable, "-c", "import moelora"], env=env, capture_output=True, text=True,
                            cwd=tmp_path)
    assert result.returncode != 0
    assert "the compiled extension _moelora was not found" in result.stderr
    assert "bash tools/build.sh" in result.stderr
    assert "circular import" not in result.stderr


def test_fused_moe_takes_expert_tensors_without_a_copy():
    w13, w2 = torch.randn(4, 64, 32), torch.randn(4, 32, 32)
    layer = moelora.FusedMoE(4, 2, 32, 32, dtype=torch.float32, device="cpu", experts=(w13, w2))
    assert layer.w13.data_ptr() == w13.data_ptr() and layer.w2.data_ptr() == w2.data_ptr()
    with pytest.raises(ValueError, match=r"experts' w2 expected shape \[4, 32, 32\]"):
        moelora.FusedMoE(4, 2, 32, 32, experts=(w13, torch.randn(4, 32, 16)))
    with pytest.raises(ValueError, match="float16"):
        moelora.FusedMoE(4, 2, 32, 32, dtype=torch.float16, experts=(w13, w2))
    with pytest.raises(ValueError, match="experts expected None for a quantized layer"):
        moelora.FusedMoE(4, 2, 32, 32, quant="fp8_channel", experts=(w13, w2))
