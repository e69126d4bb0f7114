#!/usr/bin/env python3
"""The whole CUDA test binary under compute-sanitizer (issue 33 item 3): memcheck,
racecheck, initcheck and synccheck over every CUDA test case, in batches, within a time
budget, resumable across device calls and sessions.

    python3 tools/sanitizer_sweep.py --binary build-gpu/moelora_tests --budget 540 \\
        --state reports/gpu/sanitizer_state.json --out $OUT/sanitizer_state.json

Tests: every case --gtest_list_tests gives, except the CPU backend's (names with "CPU":
no device code to check). Each tool runs them in batches (--batch cases a process); a
batch that does not finish inside the remaining budget is killed and retried next call,
so the state only ever holds whole batches; its cases are listed as slow (per tool) and
go first next call, --slow-batch a process, so one heavy case no longer holds back --batch
others for the whole call. --jobs N runs N sanitizer processes at once
(the tools are CPU-bound in their instrumentation and the test cases are small: ctest runs
16 at a time on the same GPU); --gpus G spreads the batches over G devices in turn
(CUDA_VISIBLE_DEVICES per process). State (JSON): per tool the cases done, the
findings (each error or hazard block of the tool, with the case it came in), and the
summary lines. A finding that matches an entry of tools/sanitizer_known.json (tool, a
regular expression on the block, the reason) is listed as known, with that reason, not
hidden; the rest count as errors. --summary prints the table the report takes
(make_report.py --sanitizer-state).
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
HERE = os.path.dirname(os.path.abspath(__file__))
KNOWN = os.path.join(HERE, "sanitizer_known.json")  # the listed false positives


def list_cuda_tests(binary):
    """Full names of the binary's test cases, the CPU backend's left out."""
    text = subprocess.run([binary, "--gtest_list_tests"], capture_output=True, text=True, check=True).stdout
    names, suite = [], None
    for line in text.splitlines():
        if not line.strip() or line.startswith("Running main"):
            continue
        if not line.startswith(" "):
            suite = line.split("#")[0].strip()
        else:
            case = line.split("#")[0].strip()
            names.append(suite + case)
    return [n for n in names if "CPU" not in n]


def load_known(path):
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        known = json.load(f)
    for entry in known:
        entry["regex"] = re.compile(entry["pattern"], re.S)
    return known


def findings_of(output):
    """(case, block) for each finding of a sanitizer run: a block starts at a "=========
    <kind>" line naming an error or hazard and runs to the next blank "=========" line;
    case is the gtest case running then."""
    found, case, block = [], None, None
    for line in output.splitlines():
        run = re.match(r"\[ RUN\s+\] (\S+)", line)
        if run:
            case = run.group(1)
        if block is not None:
            if line.strip() in ("=========", "") or "SUMMARY" in line:
                found.append((case, "\n".join(block)))
                block = None
            else:
                block.append(line)
                continue
        if re.match(r"=+ (Invalid|Uninitialized|Program hit|Race reported|Error|Barrier error|Warning|"
                    r"(Global|Shared) .*(hazard|access)|Potential)", line) or \
                re.match(r"=+ .*(error|hazard) detected", line, re.I):
            block = [line]
    if block is not None:
        found.append((case, "\n".join(block)))
    return found


def device_lines(block):
    """A finding's block up to its host backtrace."""
    return block.split("Saved host backtrace")[0].rstrip("= \n")


def summary_line(output):
    lines = [l for l in output.splitlines() if "ERROR SUMMARY" in l or "RACECHECK SUMMARY" in l]
    return lines[-1].strip("= ").strip() if lines else None


def run_batch(sanitizer, tool, binary, cases, timeout, gpu=None):
    """The tool's output over the cases, or None where it did not finish in timeout seconds
    (the sanitizer and the test binary under it are killed: they share a session). gpu: the
    one device the process sees, else all."""
    cmd = [sanitizer, "--tool", tool, "--print-limit", "200", binary, "--gtest_filter=" + ":".join(cases)]
    if tool == "racecheck":
        cmd[3:3] = ["--racecheck-report", "hazard"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu)) if gpu is not None else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended between the timeout and the kill
            pass
        proc.communicate()
        return None
    return output


def sweep(args):
    state = {"tools": {}}
    if args.state and os.path.exists(args.state):
        with open(args.state) as f:
            state = json.load(f)
    known = load_known(args.known)
    cases = list_cuda_tests(args.binary)
    state["cases"] = len(cases)
    deadline = time.monotonic() + args.budget
    # (tool, batch), tool by tool; the slow batches of every tool first: they need the
    # whole budget most.
    slow_work, work = [], []
    for tool in args.tools.split(","):
        entry = state["tools"].setdefault(tool, {"done": [], "findings": [], "summaries": [], "failed_batches": 0})
        done = set(entry["done"])
        slow = set(entry.get("slow", []))
        for size, group, into in ((args.slow_batch, [c for c in cases if c not in done and c in slow], slow_work),
                                  (args.batch, [c for c in cases if c not in done and c not in slow], work)):
            into += [(tool, group[i:i + size]) for i in range(0, len(group), size)]
    work = slow_work + work

    def run(numbered):
        number, (tool, batch) = numbered
        left = deadline - time.monotonic()
        if left < 30:  # a batch started now would be cut: the next call takes it
            return tool, batch, "budget"
        gpu = number % args.gpus if args.gpus > 1 else None
        return tool, batch, run_batch(args.sanitizer, tool, args.binary, batch, left, gpu)

    # Results are recorded here, in one thread, as the batches finish (pool.map keeps the
    # work's order, so one job gives the order of a serial sweep).
    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        for tool, batch, output in pool.map(run, enumerate(work)):
            if output == "budget":
                continue
            if output is None:
                print(f"{tool}: a batch of {len(batch)} did not finish in the budget; next call", flush=True)
                slow = state["tools"][tool].setdefault("slow", [])
                slow.extend(c for c in batch if c not in slow)
                continue
            entry = state["tools"][tool]
            passed = re.search(r"\[  PASSED  \] (\d+) test", output)
            if not passed or "[  FAILED  ]" in output:
                entry["failed_batches"] += 1  # a test failed under the tool: its log is kept
                with open(os.path.join(args.log_dir, f"sanitizer_{tool}_failed_{entry['failed_batches']}.log"),
                          "w") as f:
                    f.write(output[-200000:])
            for case, block in findings_of(output):
                # The device-side lines only: the host backtrace (a dozen frames) would make the
                # committed state megabytes for a few hundred findings.
                finding = {"case": case, "known": None, "text": device_lines(block)[:2000]}
                finding["known"] = known_reason(known, tool, finding)
                entry["findings"].append(finding)
            line = summary_line(output)
            if line:
                entry["summaries"].append(line)
            entry["done"].extend(batch)
            print(f"{tool}: {len(entry['done'])}/{len(cases)} cases, {line}", flush=True)
    # Which build each slice swept: a state continued across commits says so.
    state.setdefault("runs", []).append({"commit": args.commit, "date": time.strftime("%Y-%m-%d"),
                                         "budget_s": args.budget, "jobs": args.jobs, "gpus": args.gpus})
    for tool in args.tools.split(","):
        left = len(cases) - len(state["tools"][tool]["done"])
        if left:
            print(f"{tool}: budget spent, {left} cases left for the next call", flush=True)
    with open(args.out, "w") as f:
        json.dump(state, f, indent=1)
    return state


def known_reason(known, tool, finding):
    """The reason of the known false positive a finding matches (its recorded one, or an
    entry of the known list added since), else None."""
    if finding.get("known"):
        return finding["known"]
    return next((k["reason"] for k in known if k["tool"] == tool and k["regex"].search(finding["text"])), None)


def summarize(state, known=()):
    """{tool: {cases, done, errors, known: {reason: count}, failed_batches}}; findings are
    matched against `known` (load_known) again, so a reason listed after a sweep counts."""
    out = {}
    for tool, entry in state.get("tools", {}).items():
        reasons = [known_reason(known, tool, f) for f in entry["findings"]]
        counted = {}
        for reason in filter(None, reasons):
            counted[reason] = counted.get(reason, 0) + 1
        out[tool] = {"cases": state.get("cases"), "done": len(entry["done"]),
                     "errors": sum(1 for r in reasons if not r), "known": counted,
                     "failed_batches": entry["failed_batches"]}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--binary", default="build-gpu/moelora_tests")
    p.add_argument("--sanitizer", default="compute-sanitizer")
    p.add_argument("--tools", default=",".join(TOOLS))
    p.add_argument("--budget", type=float, default=540, help="seconds for this call, all tools together")
    p.add_argument("--batch", type=int, default=40, help="test cases a sanitizer process")
    p.add_argument("--slow-batch", type=int, default=4, help="cases a process among those that ran out of time before")
    p.add_argument("--jobs", type=int, default=1, help="sanitizer processes at once")
    p.add_argument("--gpus", type=int, default=1, help="devices the batches take in turn")
    p.add_argument("--commit", default="unknown", help="the commit of the binary, recorded in the state's runs")
    p.add_argument("--state", help="the state of earlier calls (JSON), continued")
    p.add_argument("--out", default="sanitizer_state.json")
    p.add_argument("--log-dir", default=os.environ.get("OUT", "."))
    p.add_argument("--known", default=KNOWN)
    p.add_argument("--summary", action="store_true", help="print the summary of --state and exit")
    args = p.parse_args()
    if args.summary:
        with open(args.state) as f:
            print(json.dumps(summarize(json.load(f), load_known(args.known)), indent=1))
        return
    state = sweep(args)
    summary = summarize(state, load_known(args.known))
    print(json.dumps(summary, indent=1))
    sys.exit(1 if any(s["errors"] or s["failed_batches"] for s in summary.values()) else 0)


if __name__ == "__main__":
    main()
