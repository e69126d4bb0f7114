"""tools/plot_report.py turns committed GPU reports into the README's roofline picture."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_plot_report_writes_a_png(tmp_path):
    reports = [os.path.join(ROOT, "reports", "gpu", name) for name in
               ("2026-11-23-h100-005bac5-lora-fused.json", "2026-11-26-h100-5986b53-quant.json")]
    out = tmp_path / "roofline.png"
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_report.py"), *reports, "-o", str(out)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "516 rows" in result.stdout  # 6 models x 11-14 M x bf16, LoRA r=16/64 and four 8-bit schemes
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_report_refuses_a_report_without_rows(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text('{"rows": []}')
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_report.py"), str(empty)],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "no fused_experts rows" in result.stderr
