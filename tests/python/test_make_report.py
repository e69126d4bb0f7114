"""tools/make_report.py merges bench files into one report: rows whose floors rest on other
ceilings (a bench run without --ceilings takes the nominal H100's) are refused, naming the
file, instead of mixing percentages of two floors."""
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def _bench(tmp_path, name, copy_tbps, measured, M):
    path = tmp_path / name
    row = {"op": "fused_experts", "model": "mixtral-8x7b", "M": M, "dtype": "bf16", "lora": None,
           "device": "cuda", "time_us": 100.0, "floor_us": 50.0, "pct_floor": 50.0, "tbps": 2.0, "tflops": 10.0,
           "rel_err": 1e-3}
    path.write_text(json.dumps({"ceilings": {"copy_tbps": copy_tbps, "bf16_tflops": 790.0, "measured": measured},
                                "rows": [row]}))
    return str(path)


def _make_report(tmp_path, benches):
    ctest = tmp_path / "ctest.xml"
    ctest.write_text('<testsuites tests="1" failures="0" errors="0"><testsuite tests="1" failures="0"/></testsuites>')
    out = tmp_path / "report.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "make_report.py"), "--commit", "0" * 40, "--ctest", str(ctest),
           "--bench", *benches, "--gpu", "NVIDIA H200", "--driver", "580", "--cuda", "13.0", "--out", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True), out


def test_merges_benches_of_the_same_ceilings(tmp_path):
    result, out = _make_report(tmp_path, [_bench(tmp_path, "a.json", 4.22, True, 16),
                                          _bench(tmp_path, "b.json", 4.20, True, 256)])
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert [r["M"] for r in report["rows"]] == [16, 256]
    assert report["ceilings_measured"] is True


def test_refuses_a_bench_on_nominal_ceilings(tmp_path):
    nominal = _bench(tmp_path, "lora.json", 3.0, False, 16)
    result, out = _make_report(tmp_path, [_bench(tmp_path, "quant.json", 4.22, True, 16), nominal])
    assert result.returncode != 0
    assert "lora.json" in result.stderr and "--ceilings" in result.stderr
    assert not out.exists()
