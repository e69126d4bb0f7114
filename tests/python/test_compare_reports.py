"""tools/compare_reports.py matches two reports' cells (the last row of a key, as make_report's
peer table), prints new / old per cell and per M, and names the cells that moved."""
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def _row(M, time_us, peer_us=None, lora=None, quant=None, model="qwen3-30b-a3b"):
    row = {"op": "fused_experts", "model": model, "M": M, "dtype": "bf16", "lora": lora, "device": "cuda",
           "time_us": time_us, "floor_us": 50.0, "pct_floor": 50.0}
    if peer_us is not None:
        row["peer_us"] = peer_us
    if quant is not None:
        row["quant"] = quant
    return row


def _report(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text(json.dumps({"commit": name, "rows": rows}))
    return str(path)


def _compare(*args):
    cmd = [sys.executable, os.path.join(ROOT, "tools", "compare_reports.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True)


def test_cells_per_m_and_moves(tmp_path):
    lora = {"rank": 16, "adapters": 4, "share": 1.0}
    old = _report(tmp_path, "old.json", [
        _row(16, 500.0, peer_us=100.0),  # an earlier row of the key: not the one compared
        _row(16, 100.0, peer_us=100.0), _row(16, 120.0, peer_us=118.0, lora=lora), _row(256, 300.0, peer_us=290.0),
        _row(16, 80.0, quant={"scheme": "w4a16"}),
        dict(_row(16, 1.0), device="cpu"), _row(64, 200.0)])  # CPU rows and cells of one report are left out
    new = _report(tmp_path, "new.json", [
        _row(16, 110.0, peer_us=101.0), _row(16, 121.2, peer_us=118.0, lora=lora), _row(256, 296.0, peer_us=291.0),
        _row(16, 60.0, quant={"scheme": "w4a16"})])
    result = _compare(old, new)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "  110.0" in out and "1.100" in out and "500.0" not in out and "w4a16" not in out
    by_m = {line.split(":")[0].strip(): line for line in out.splitlines() if line.startswith("  M =")}
    assert set(by_m) == {"M =    16", "M =   256"}
    assert "ours 1.054 (2 cells)" in by_m["M =    16"]  # sqrt(1.10 x 1.01)
    assert "peer 1.005 (2 cells)" in by_m["M =    16"]
    assert "slower by more than 2%: 1 of 3 cells: qwen3-30b-a3b M=16 base 1.100" in out
    assert "faster by more than 2%: 0 of 3 cells" in out
    assert "old: within 2% of the peer or faster in 2 of 3 cells" in out
    assert "new: within 2% of the peer or faster in 1 of 3 cells" in out

    schemes = _compare(old, new, "--scheme", "w4a16")
    assert schemes.returncode == 0, schemes.stderr
    assert "0.750" in schemes.stdout and "within 2% of the peer or faster in 0 of 0 cells" in schemes.stdout


def test_refuses_reports_without_common_cells(tmp_path):
    old = _report(tmp_path, "old.json", [_row(16, 100.0)])
    new = _report(tmp_path, "new.json", [_row(64, 100.0)])
    result = _compare(old, new)
    assert result.returncode != 0 and "no bf16 cell in both reports" in result.stderr
    missing = _compare(old, str(tmp_path / "absent.json"))
    assert missing.returncode != 0 and "absent.json" in missing.stderr
