#!/usr/bin/env python3
"""The whole C++ test binary in gtest shards, spread over the GPUs: what ctest runs (one
process a test case, all on device 0), in a few long processes instead. On a 2-GPU H200
machine ctest -j28 ran 1594 of 1661 cases in 330 s; the shards keep each process's CUDA
set-up to one and put half of them on each device.

    python3 tools/gtest_shards.py --binary build-gpu/moelora_tests --shards 24 --gpus 2 \\
        --junit $OUT/ctest.xml

The shards' JUnit files are merged into one (<testsuites>, the counts make_report.py
reads); a shard's failing output is printed. Exit 1 when a case failed or a shard crashed.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor


def run_shard(args, index, folder):
    xml = os.path.join(folder, f"shard_{index}.xml")
    env = dict(os.environ, GTEST_TOTAL_SHARDS=str(args.shards), GTEST_SHARD_INDEX=str(index))
    if args.gpus > 1:
        env["CUDA_VISIBLE_DEVICES"] = str(index % args.gpus)
    proc = subprocess.run([args.binary, "--gtest_brief=1", f"--gtest_output=xml:{xml}"], env=env,
                          capture_output=True, text=True, timeout=args.timeout)
    return index, proc.returncode, proc.stdout + proc.stderr, xml


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--binary", default="build-gpu/moelora_tests")
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--gpus", type=int, default=1, help="devices the shards take in turn")
    p.add_argument("--timeout", type=float, default=3600, help="seconds a shard")
    p.add_argument("--junit", required=True, help="the merged JUnit XML")
    args = p.parse_args()
    merged = ET.Element("testsuites")
    status = 0
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(max_workers=args.shards) as pool:
        for index, rc, output, xml in pool.map(lambda i: run_shard(args, i, folder), range(args.shards)):
            if rc != 0 or not os.path.exists(xml):
                status = 1
                print(f"shard {index}: exit {rc}\n{output[-4000:]}", flush=True)
            if os.path.exists(xml):
                merged.extend(ET.parse(xml).getroot().iter("testsuite"))
    ET.ElementTree(merged).write(args.junit)
    count = lambda key: sum(int(s.get(key, 0)) for s in merged)
    print(f"{count('tests')} cases: {count('failures') + count('errors')} failed, {count('skipped')} skipped, "
          f"{args.shards} shards on {args.gpus} GPU(s)")
    sys.exit(status)


if __name__ == "__main__":
    main()
