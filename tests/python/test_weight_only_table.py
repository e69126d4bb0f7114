"""tools/weight_only_table.py counts issue 30's targets over a report's weight-only rows and
says what the M <= 16 targets need of the copy rate; on a synthetic report whose answers are
known."""
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def _row(model, M, time_us, floor_us, quant=None, fixed_us=None, rel_err=2e-3):
    row = {"op": "fused_experts", "model": model, "M": M, "dtype": "bf16", "lora": None, "quant": quant,
           "time_us": time_us, "floor_us": floor_us, "pct_floor": 100 * floor_us / time_us, "rel_err": rel_err}
    if fixed_us is not None:
        row["fixed_us"] = fixed_us
    return row


def _run(tmp_path, rows):
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"rows": rows}))
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "weight_only_table.py"), str(path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_targets_and_needs(tmp_path):
    w4 = {"scheme": "w4a16", "group": 128, "zero_point": False}
    w8 = {"scheme": "w8a16", "group": None, "zero_point": False}
    rows = [
        _row("m", 1, 30.0, 25.0),  # the bf16 layer, M = 1
        _row("m", 8, 90.0, 80.0),
        _row("m", 1024, 1000.0, 900.0),
        _row("m", 1, 10.0, 6.0, w4, fixed_us=4.0),  # 60% of floor; 3x bf16 (10 <= 30 / 3)
        _row("m", 8, 40.0, 30.0, w4, fixed_us=5.0),  # 75%: short of 80%; 2.25x bf16
        _row("m", 1024, 1100.0, 300.0, w4),        # 1.1x bf16: met
        _row("m", 8, 35.0, 30.0, w8, fixed_us=5.0, rel_err=2e-2),  # 86%: met; its rel_err fails 1e-2
    ]
    out = _run(tmp_path, rows)
    assert "w4a16 >= 60% of floor, M 1-2: 1 / 1" in out
    assert "w4a16 >= 80% of floor, M 4-64: 0 / 1" in out
    assert "w4a16 <= 1.1x bf16, M >= 1024: 1 / 1" in out
    assert "w4a16 >= 3x faster than bf16, M <= 16: 1 / 2" in out
    assert "w8a16 >= 80% of floor, M 4-64: 1 / 1" in out
    assert "worst 2.00e-02" in out
    # M = 1: now 6 / (10 - 4) = 100%; 60% needs 6 / (10 - 4) = 100%; 3x (T = 10) the same.
    # M = 8: now 30 / 35 = 86%; 3x bf16 (T = 30) needs 30 / 25 = 120%, beyond the copy rate.
    lines = [line.split() for line in out.splitlines() if line.startswith("w4a16 group 128") and " m " in line]
    assert [line[-4:] for line in lines] == [["1", "100%", "100%", "100%"], ["8", "86%", "-", "120%"]]
