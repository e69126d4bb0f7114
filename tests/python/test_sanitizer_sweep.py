"""tools/sanitizer_sweep.py (issue 33 item 3) without a GPU: its parsing of
compute-sanitizer's output, the known false positives, and a resumed sweep over a fake
test binary and a fake sanitizer."""

import json
import os
import stat
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import sanitizer_sweep  # noqa: E402

MEMCHECK = """========= COMPUTE-SANITIZER
[ RUN      ] Suite.First/CUDA
========= Invalid __global__ read of size 4 bytes
=========     at kernel_a+0x10
=========     Address 0x7f is out of bounds
=========
[       OK ] Suite.First/CUDA (1 ms)
[ RUN      ] Suite.Second/CUDA
========= Error: Race reported between Write access at wgmma_kernel+0x1 and Read access at wgmma_kernel+0x2
=========
[       OK ] Suite.Second/CUDA (1 ms)
[  PASSED  ] 2 tests.
========= ERROR SUMMARY: 2 errors
"""


def test_findings_name_their_case_and_known_ones_keep_their_reason():
    found = sanitizer_sweep.findings_of(MEMCHECK)
    assert [case for case, _ in found] == ["Suite.First/CUDA", "Suite.Second/CUDA"]
    assert "out of bounds" in found[0][1] and "wgmma" in found[1][1]
    assert sanitizer_sweep.summary_line(MEMCHECK) == "ERROR SUMMARY: 2 errors"
    state = {"cases": 2, "tools": {"racecheck": {"done": ["a", "b"], "failed_batches": 0, "summaries": [],
                                                 "findings": [{"case": "a", "known": "mbarrier order", "text": ""},
                                                              {"case": "b", "known": None, "text": ""}]}}}
    assert sanitizer_sweep.summarize(state)["racecheck"] == {"cases": 2, "done": 2, "errors": 1,
                                                             "known": {"mbarrier order": 1}, "failed_batches": 0}


def _script(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _fake_suite(tmp_path, cuda_cases):
    """The sweep's command line up to --tools over a gtest-like binary of `cuda_cases` CUDA
    cases and a CPU one (each run takes ~1 s) under a sanitizer that only runs it."""
    binary = _script(tmp_path / "tests", """#!/usr/bin/env python3
import sys, time
cases = ["Layers/T.Case/CUDA_%%d" %% i for i in range(%d)] + ["Layers/T.Case/CPU_0"]
if "--gtest_list_tests" in sys.argv:
    print("Layers/T.\\n" + "\\n".join("  " + c.split(".", 1)[1] for c in cases))
    sys.exit(0)
chosen = sys.argv[-1].split("=", 1)[1].split(":")
for c in chosen:
    print("[ RUN      ] " + c); print("[       OK ] " + c)
time.sleep(1)
print("[  PASSED  ] %%d tests." %% len(chosen))
""" % cuda_cases)
    sanitizer = _script(tmp_path / "fake-sanitizer", """#!/usr/bin/env bash
while [ "${1#--}" != "$1" ]; do shift 2; done
"$@"
echo "========= ERROR SUMMARY: 0 errors"
""")
    known = tmp_path / "known.json"
    known.write_text("[]")
    return [sys.executable, os.path.join(ROOT, "tools", "sanitizer_sweep.py"), "--binary", binary, "--sanitizer",
            sanitizer, "--known", str(known), "--log-dir", str(tmp_path)]


def test_sweep_resumes_where_the_budget_stopped(tmp_path):
    state = tmp_path / "state.json"
    common = _fake_suite(tmp_path, 5) + ["--tools", "memcheck", "--batch", "2"]
    # A budget of 30.6 s leaves room for one batch (~1 s) before the 30 s reserve stops the sweep.
    first = subprocess.run(common + ["--budget", "30.6", "--out", str(state)], capture_output=True, text=True)
    assert first.returncode == 0, first.stdout + first.stderr
    done = json.loads(state.read_text())["tools"]["memcheck"]["done"]
    assert done == ["Layers/T.Case/CUDA_0", "Layers/T.Case/CUDA_1"], done
    second = subprocess.run(common + ["--budget", "100", "--state", str(state), "--out", str(state)],
                            capture_output=True, text=True)
    assert second.returncode == 0, second.stdout + second.stderr
    summary = sanitizer_sweep.summarize(json.loads(state.read_text()))["memcheck"]
    assert summary == {"cases": 5, "done": 5, "errors": 0, "known": {}, "failed_batches": 0}


def test_jobs_run_batches_at_once_and_record_every_case(tmp_path):
    # 6 cases, one a batch, two tools: 12 runs of ~1 s; six jobs take ~2 s, one would take 12.
    state = tmp_path / "state.json"
    began = time.monotonic()
    run = subprocess.run(_fake_suite(tmp_path, 6) + ["--tools", "memcheck,initcheck", "--batch", "1", "--jobs", "6",
                                                     "--budget", "100", "--out", str(state)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    assert time.monotonic() - began < 9, "the batches ran one at a time"
    tools = json.loads(state.read_text())["tools"]
    for tool in ("memcheck", "initcheck"):
        assert sorted(tools[tool]["done"]) == ["Layers/T.Case/CUDA_%d" % i for i in range(6)]


def test_a_batch_out_of_time_lists_its_cases_as_slow(tmp_path):
    # CUDA_0 takes 60 s: its batch (with CUDA_1) is cut at the budget and both are listed as
    # slow, to run first and in --slow-batch processes next call; the other batches finish.
    common = _fake_suite(tmp_path, 5)
    binary = common[common.index("--binary") + 1]
    text = open(binary).read().replace("time.sleep(1)", "time.sleep(60 if 'Layers/T.Case/CUDA_0' in chosen else 1)")
    open(binary, "w").write(text)
    state = tmp_path / "state.json"
    run = subprocess.run(common + ["--tools", "memcheck", "--batch", "2", "--jobs", "3", "--budget", "33",
                                   "--out", str(state)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    memcheck = json.loads(state.read_text())["tools"]["memcheck"]
    assert memcheck["slow"] == ["Layers/T.Case/CUDA_0", "Layers/T.Case/CUDA_1"]
    assert sorted(memcheck["done"]) == ["Layers/T.Case/CUDA_%d" % i for i in (2, 3, 4)]


def test_a_batch_on_one_gpu_sees_only_that_device(tmp_path):
    binary = _script(tmp_path / "tests", """#!/usr/bin/env bash
echo "visible=${CUDA_VISIBLE_DEVICES-all}"
""")
    sanitizer = _script(tmp_path / "fake-sanitizer", """#!/usr/bin/env bash
while [ "${1#--}" != "$1" ]; do shift 2; done
"$@"
""")
    env = os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    try:
        assert "visible=1" in sanitizer_sweep.run_batch(sanitizer, "memcheck", binary, ["A.B/CUDA"], 30, gpu=1)
        assert "visible=all" in sanitizer_sweep.run_batch(sanitizer, "memcheck", binary, ["A.B/CUDA"], 30)
    finally:
        if env is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = env


def test_a_batch_past_its_time_is_killed_with_the_binary_under_it(tmp_path):
    pid_file = tmp_path / "pid"
    binary = _script(tmp_path / "tests", f"""#!/usr/bin/env python3
import os, time
open({str(pid_file)!r}, "w").write(str(os.getpid()))
time.sleep(60)
""")
    sanitizer = _script(tmp_path / "fake-sanitizer", """#!/usr/bin/env bash
while [ "${1#--}" != "$1" ]; do shift 2; done
"$@"
""")
    assert sanitizer_sweep.run_batch(sanitizer, "memcheck", binary, ["A.B/CUDA"], timeout=5) is None
    pid = int(pid_file.read_text())

    def alive():
        try:
            with open(f"/proc/{pid}/status") as f:
                return "\nState:\tZ" not in f.read()  # a zombie waits for its reaper: it is dead
        except FileNotFoundError:
            return False

    for _ in range(50):  # SIGKILL lands asynchronously: allow it a moment under load
        if not alive():
            break
        time.sleep(0.1)
    assert not alive()


# A finding racecheck gave on an H200 (2026-11-28), shortened: the cluster tile queue's remote write.
TILE_QUEUE_WRITE = """========= Potential invalid __shared__ write of size 4 bytes
=========     at moelora::cuda::Sm90TileTaker<(int)4, (int)2>::push(int)+0x3e070 in fused_moe_sm90_schedule.cuh:119
=========     by thread (0,0,0) in block (0,0,0)
=========     Address 0x1032490 is located in a block that might have already exited"""


def test_known_false_positives_apply_to_findings_recorded_before_they_were_listed():
    known = sanitizer_sweep.load_known(os.path.join(ROOT, "tools", "sanitizer_known.json"))
    state = {"cases": 3, "tools": {
        "racecheck": {"done": ["a", "b", "c"], "failed_batches": 0, "summaries": [],
                      "findings": [{"case": "a", "known": None, "text": TILE_QUEUE_WRITE},
                                   {"case": "b", "known": None, "text": TILE_QUEUE_WRITE.replace("write", "read")}]},
        "memcheck": {"done": ["a"], "failed_batches": 0, "summaries": [],
                     "findings": [{"case": "a", "known": None, "text": TILE_QUEUE_WRITE}]}}}
    summary = sanitizer_sweep.summarize(state, known)
    (reason, count), = summary["racecheck"]["known"].items()
    assert "Sm90TileTaker" in reason and count == 1
    assert summary["racecheck"]["errors"] == 1  # a read is not the listed write
    assert summary["memcheck"] == {"cases": 3, "done": 1, "errors": 1, "known": {}, "failed_batches": 0}
    assert sanitizer_sweep.summarize(state)["racecheck"]["errors"] == 2  # nothing listed: both count
