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


def test_lora_rows_against_the_peer(tmp_path):
    # issue 31's table: a base row and a LoRA row of one cell, each with the peer's time.
    lora = {"rank": 16, "adapters": 4, "share": 1.0}
    base = {"op": "fused_experts", "model": "qwen3-30b-a3b", "M": 256, "dtype": "bf16", "lora": None,
            "device": "cuda", "time_us": 100.0, "floor_us": 90.0, "pct_floor": 90.0, "tbps": 3.0, "tflops": 10.0,
            "rel_err": 1e-3}
    with_lora = dict(base, lora=lora, time_us=120.0, floor_us=96.0, pct_floor=80.0, lora_tax=1.2, tax_floor=1.07)
    bench = tmp_path / "lorabf16.json"
    bench.write_text(json.dumps({"ceilings": {"copy_tbps": 4.2, "bf16_tflops": 790.0, "measured": True},
                                 "rows": [base, with_lora]}))
    peer = tmp_path / "peer.json"
    peer.write_text(json.dumps([{"model": "qwen3-30b-a3b", "M": 256, "two_gemm_us": 101.0},
                                {"model": "qwen3-30b-a3b", "M": 256, "lora": lora, "two_gemm_us": 110.0}]))
    ctest = tmp_path / "ctest.xml"
    ctest.write_text('<testsuites tests="1" failures="0" errors="0"><testsuite tests="1" failures="0"/></testsuites>')
    out = tmp_path / "report.json"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "make_report.py"), "--commit", "0" * 40, "--ctest", str(ctest),
           "--bench", str(bench), "--peer", str(peer), "--gpu", "NVIDIA H200", "--driver", "580", "--cuda", "13.0",
           "--out", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "base: within 2% of the peer or faster in 1/1 cells" in result.stdout
    # LoRA 120 against 110 us: 9% behind; 10 points below its base's 90% of the floor.
    assert ("LoRA r16 n4 s1.0: within 2% of the peer or faster in 0/1 cells; at M <= 256 within 5 points of the "
            "base in 0/1; at M >= 4096 >= 65% of the floor in 0/0") in result.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["peer_us"] for r in rows] == [101.0, 110.0]
