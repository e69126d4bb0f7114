#!/usr/bin/env bash
# Issue 31, the next lease (carry .deps; one nvidia-h200 or H100):
#   [PATCHES="NAME ..."] [KNOB="VAR=VALUE"] bash docs/wip/issue31-next.sh ab   (~330 s cold) applies
#       docs/wip/issue31-NAME.patch for each NAME, builds into /tmp/bl, runs the LoRA, delta, align and sum tests, the
#       unchecked LoRA grid at M = 1-1024 in two alternating rounds against REF_REPORT (the last proof's, a lease apart) and, with
#       KNOB, the same grid under it in the same run; then the kernels of Qwen3-30B M = 16, 64, 1024, OLMoE M = 16 and
#       DeepSeek-V3 M = 1024 (under KNOB); KNOB_SOURCE=REGEX adds ncu's source page of that kernel at Qwen3-30B M = 16.
#       `knob` is the same, with KNOB required. $OUT: tests.log, ab.txt. (Earlier 'ab's: docs/perf_notes/issues-31-33.md;
#       for a same-run A/B of landed knobs: PROOF_AB in lease-proof.sh.)
#   PATCHES="NAME ..." bash docs/wip/issue31-next.sh attrib   (~460 s cold for three) one full build with every patch,
#       then each taken back in reverse order with an incremental rebuild, each step's benchmark kept; then all of
#       them over the grid at M = 16-1024 (ATTRIB_TOKENS, ATTRIB_RANKS) in alternating rounds, one run (a cell moved 15%
#       between two leases with its kernels unchanged: gpt-oss-120b M = 256, forty-eighth session). $OUT: attrib.txt.
#   bash docs/wip/issue31-next.sh diag MODEL M [M...]   (~30 s warm) Nsight Compute's sections (speed of light,
#       launch, occupancy, warp states, memory, source counters) for the first launch of each LoRA kernel
#       (moe_lora_*) of MODEL's LoRA r16 layer at each M; $OUT/ncu_<M>.txt and a digest.
#   bash docs/wip/issue31-next.sh source MODEL M REGEX [SKIP]   (~60 s warm, ~240 s cold) ncu's source page (SASS) of the first
#       kernel matching REGEX: the top instructions by stall samples, excess global sectors and shared wavefronts.
#   bash docs/wip/issue31-next.sh basediag MODEL M   (~120 s warm) ncu's sections for our base layer's sm80 GEMMs and the
#       peer's (benchmarks/triton_moe_peer_kernels.py moe_gemm_kernel) at MODEL and M: why ours trail at M = 16-64.
#   bash docs/wip/issue31-next.sh peer MODEL M   (~90 s) ncu's sections for the peer's LoRA kernels
#       (its Triton shrink and expand, this GPU's searched configs): what its expand does that ours does not.
set -uo pipefail
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
B=/tmp/bl
build() {
  MOELORA_JOBS=16 MOELORA_BUILD_DIR=$B MOELORA_PTH=0 bash tools/build.sh -DMOELORA_CUDA=ON -DMOELORA_BUILD_PYTHON=OFF \
    > /tmp/build.log 2>&1 || { grep -B2 -A12 "error" /tmp/build.log | head -60; exit 1; }
  echo "build $(el) s"
}
# docs/wip/issue31-NAME.patch for each NAME in $@ (none: main as it is).
apply_patches() {
  for f in "$@"; do git apply docs/wip/issue31-$f.patch || { echo "issue31-$f.patch failed"; exit 1; }; done
}
# The LoRA layer, delta, align and top-k sum tests into $OUT/tests.log.
lora_tests() {
  local tests='All/FusedExpertsLoraTest.*:Configs/FusedExpertsLoraCudaGraph.*:FusedExpertsLora*:All/LoraDeltaTest.*'
  # TESTS_EXTRA=":PATTERN...": more gtest patterns (e.g. ":Shapes/FusedMoeTest.*/CUDA_*" for the sm80 GEMMs).
  timeout 200 $B/moelora_tests --gtest_filter="$tests:*Align*:*SumReduce*${TESTS_EXTRA:-}" > $OUT/tests.log 2>&1
  echo "tests rc $? at $(el) s"; grep -E "^\[  (PASSED|FAILED) |FAILED  \]" $OUT/tests.log | head -20
}
# Each "MODEL M" cell's LoRA r16 layer kernel by kernel (tools/profile_layer.sh), under the environment given.
profile_cells() {
  local cell
  for cell in "$@"; do
    set -- $cell
    timeout 30 bash tools/profile_layer.sh $B moelora_bench --model $1 --tokens $2 --lora-rank 16 --adapters 4 \
      > /tmp/kernels_$1_$2.txt 2>&1; echo "kernels $1 M=$2 rc $? at $(el) s"
    echo "## $1 M=$2 (tools/profile_layer.sh)"; cut -c1-140 /tmp/kernels_$1_$2.txt
  done
}
# GRID_RANKS="0,16" adds the base rows (rank 0) to the grid (~2x its time); GRID_TOKENS="M,..." replaces its M.
LORA_GRID="--device cuda --model all --tokens ${GRID_TOKENS:-1,4,16,64,256,1024} --lora-rank ${GRID_RANKS:-16} --adapters 4 --lora-share 1.0 --no-check"
case "${1:-}" in
ab|knob)
  # The patches built together, their tests, then the LoRA grid (ROUNDS alternating rounds, 2 by default, so drift
  # within the call shows) against the last proof's report (a lease apart), and under each knob of KNOBS
  # ("NAME:VAR=VALUE[,VAR=VALUE] ...", or KNOB="VAR=VALUE" for one: a rule's candidate before it becomes the rule, or the old
  # behaviour against a patch's new default) in the same run; then the kernels of a few cells (with KNOB).
  [ "$1" = knob ] && [ -z "${KNOB:-}${KNOBS:-}" ] && { echo 'knob: KNOB="VAR=VALUE" or KNOBS="NAME:VAR=VALUE ..."'; exit 2; }
  knob=${KNOB:-}
  knobs=${KNOBS:-}; [ -n "$knob" ] && knobs="knob:$knob $knobs"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  apply_patches ${PATCHES:-}
  build
  lora_tests
  rm -f /tmp/kn_*.json  # a warm machine's from an earlier call
  for round in $(seq 1 ${ROUNDS:-2}); do
    timeout 90 $B/moelora_bench $LORA_GRID --json /tmp/kn_default_$round.json > /dev/null 2>&1
    echo "default $round rc $? at $(el) s"
    for k in $knobs; do
      env $(echo "${k#*:}" | tr , " ") timeout 90 $B/moelora_bench $LORA_GRID --json /tmp/kn_${k%%:*}_$round.json > /dev/null 2>&1
      echo "${k%%:*} $round rc $? at $(el) s"
    done
  done
  KNOBS_RUN="$knobs" REF_REPORT=${REF_REPORT:-reports/gpu/2026-11-30-h200-5e60aaa-issue31-mean-run-64.json} \
    python3 - <<'PY' | tee $OUT/ab.txt
import glob, json, os
rank = lambda r: (r.get("lora") or {}).get("rank", 0)
def rows(f):  # (model, M, rank): rank 0 the base rows (GRID_RANKS)
    return {(r["model"], r["M"], rank(r)): r["time_us"] for r in json.load(open(f))["rows"]}
def runs(name):  # each round's rows
    return [rows(f) for f in sorted(glob.glob(f"/tmp/kn_{name}_*.json"))]
knobs = [k.split(":", 1) for k in os.environ["KNOBS_RUN"].split()]
default = runs("default")
best = lambda rs, key: min((r[key] for r in rs if key in r), default=0.0)
ref = os.environ["REF_REPORT"]
report = {(r["model"], r["M"], rank(r)): r["time_us"] for r in json.load(open(ref))["rows"]
          if (not r.get("lora") or (r["lora"].get("rank") == 16 and r["lora"].get("share") == 1.0))
          and r.get("dtype", "bf16") == "bf16" and r.get("quant") is None}
print(f"## bf16, LoRA r16 (r0: the base), 4 adapters (us). report: {os.path.basename(ref)} (a lease apart); default: this "
      "run's rounds; then default's minimum / the report's, and each knob's minimum / default's (same run)")
for name, setting in knobs: print(f"##   {name}: {setting}")
print(f"{'model':18s} {'M':>5s} {'r':>3s} {'report':>8s} | {'default rounds':>17s} | {'d/rep':>6s} " +
      " ".join(f"{n:>9s}" for n, _ in knobs))
for key in sorted(default[0] if default else {}):
    d, r = best(default, key), report.get(key, 0)
    rounds = " ".join(f"{x.get(key, 0):8.1f}" for x in default[:2])
    cols = " ".join(f"{best(runs(n), key) / d if d else 0:9.3f}" for n, _ in knobs)
    print(f"{key[0]:18s} {key[1]:5d} {key[2]:3d} {r:8.1f} | {rounds:>17s} | {d / r if r else 0:6.3f} {cols}")
PY
  # A few cells kernel by kernel (under KNOB, unless PROFILE_DEFAULT=1: where the knob is the old behaviour and the
  # patch's kernels are the default's): small M (the shrinks), and M = 1024 (the expands by groups at Qwen3-30B;
  # GEMM2's by column tiles at DeepSeek-V3); PROFILE_CELLS="MODEL:M ..." replaces the list.
  cells=("qwen3-30b-a3b 16" "qwen3-30b-a3b 64" "olmoe-1b-7b 16" "qwen3-30b-a3b 1024" "deepseek-v3-tp8 1024")
  [ -n "${PROFILE_CELLS:-}" ] && { cells=(); for c in $PROFILE_CELLS; do cells+=("${c%%:*} ${c#*:}"); done; }
  ( [ -n "$knob" ] && [ "${PROFILE_DEFAULT:-0}" != 1 ] && export "$knob"
    profile_cells "${cells[@]}" ) | tee -a $OUT/ab.txt
  [ -n "${KNOB_SOURCE:-}" ] && bash "$0" source qwen3-30b-a3b 16 "$KNOB_SOURCE" 2>&1 | tail -75 | tee $OUT/source.txt
  ;;
attrib)
  # Same-run attribution: first with every patch ('all'), then each taken back in reverse order (a column named for
  # the patch it takes back; the last column is main), each step's benchmark kept, then all of them over the grid in
  # ROUNDS (2) alternating rounds (drift within the call shows as rounds apart). The forty-eighth session's: 'ab'
  # showed gpt-oss-120b M = 256 1717 -> 1983 us; here it was ~2000 in every column, main's too (the lease, not a
  # patch). The fifty-third's: 36bb65e measured a lease apart from e08f781 was 2-8% slower in the sm80 cells its own
  # knob columns said it sped up; only a same-run main answers that. ATTRIB_TOKENS (16,64,256,1024), ATTRIB_RANKS
  # (16; "0,16" adds the base rows); ATTRIB_REUSE=1 on a warm machine reruns the last call's builds. A patch that touches only sm80 files rebuilds in ~60-90 s, one touching
  # src/common/params.h everything (~170 s): put such a patch first in PATCHES (taken back last).
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  patches=${PATCHES:?PATCHES="NAME ..." (docs/wip/issue31-NAME.patch)}
  rev=""; for f in $patches; do rev="$f $rev"; done
  steps="all:-"; for f in $rev; do steps="$steps $f:$f"; done
  names=""
  if [ "${ATTRIB_REUSE:-0}" = 1 ] && [ -x /tmp/at_bin_all ]; then
    # A warm machine's builds from the last 'attrib' call (same PATCHES): more rounds, ranks or knobs, no build.
    for step in $steps; do [ -x /tmp/at_bin_${step%%:*} ] && names="$names ${step%%:*}"; done
  else
    apply_patches $patches
    for step in $steps; do
      name=${step%%:*}; drop=${step#*:}
      if [ "$drop" != "-" ]; then git apply -R docs/wip/issue31-$drop.patch || exit 1; fi
      build
      cp $B/moelora_bench /tmp/at_bin_$name
      names="$names $name"
      [ $(el) -gt 420 ] && { echo "stopping the builds at $(el) s"; break; }
    done
  fi
  # ATTRIB_KNOBS="NAME:VAR=VALUE[,VAR=VALUE] ...": more columns, the 'all' build under each setting.
  for k in ${ATTRIB_KNOBS:-}; do ln -sf /tmp/at_bin_all /tmp/at_bin_${k%%:*}; names="$names ${k%%:*}"; done
  knob_env() { local k; for k in ${ATTRIB_KNOBS:-}; do [ "${k%%:*}" = "$1" ] && echo "${k#*:}" | tr , " "; done; }
  rm -f /tmp/at_*_r*.json
  for round in $(seq 1 ${ROUNDS:-2}); do
    for name in $names; do
      env $(knob_env $name) timeout 90 /tmp/at_bin_$name --device cuda --model all --tokens ${ATTRIB_TOKENS:-16,64,256,1024} \
        --lora-rank ${ATTRIB_RANKS:-16} --adapters 4 --lora-share 1.0 --no-check --json /tmp/at_${name}_r$round.json \
        > /tmp/at_$name.log 2>&1; echo "grid $name round $round rc $? at $(el) s"
    done
  done
  export NAMES="$names"
  python3 - <<'PY' | tee $OUT/attrib.txt
import glob, json, math, os
names = os.environ["NAMES"].split()
rank = lambda r: (r.get("lora") or {}).get("rank", 0)
def best(name):  # each cell's minimum over the rounds
    t = {}
    for f in glob.glob(f"/tmp/at_{name}_r*.json"):
        for r in json.load(open(f))["rows"]:
            k = (r["model"], r["M"], rank(r)); t[k] = min(t.get(k, 1e30), r["time_us"])
    return t
t = {n: best(n) for n in names}
print("## us, one run, each cell's minimum over the rounds: every patch ('all'), then each named patch taken back in "
      "turn (the last such column is main), then ATTRIB_KNOBS' columns; then each column / all (> 1: what was taken back "
      "or switched off had gained)")
print(f"{'model':18s} {'M':>6s} {'r':>3s} " + " ".join(f"{n:>9s}" for n in names) + " " +
      " ".join(f"{'/' + n:>9s}" for n in names[1:]))
for k in sorted(t["all"]):
    a = t["all"][k]
    print(f"{k[0]:18s} {k[1]:6d} {k[2]:3d} " + " ".join(f"{t[n].get(k, 0):9.1f}" for n in names) + " " +
          " ".join(f"{t[n].get(k, 0) / a:9.3f}" for n in names[1:]))
print("## per M and rank: the geomean of each column / all")
for M, r in sorted({(k[1], k[2]) for k in t["all"]}):
    cells = [k for k in t["all"] if k[1] == M and k[2] == r]
    gm = lambda n: math.exp(sum(math.log(t[n][k] / t["all"][k]) for k in cells if t[n].get(k)) /
                            max(1, sum(1 for k in cells if t[n].get(k))))
    print(f"{'geomean':18s} {M:6d} {r:3d} " + " ".join(f"{gm(n):9.3f}" for n in names[1:]))
PY
  ;;
peer)
  # Nsight Compute's sections for the peer's LoRA kernels (benchmarks/triton_moe_lora_peer_kernels.py) at MODEL and M,
  # with this GPU's searched configs: occupancy, registers, DRAM rate and warp states of the expand that runs 2.2-2.9x
  # faster than ours at M <= 1024 (dfb4c78; ours by groups at e89f6fd: 259 against 130.5 us at DeepSeek-V3 M = 1024). Its first lora_* launches are the correctness check's (the quick configs;
  # the same as the searched ones at DeepSeek-V3 M = 1024), then the timed graphs' (grid (blocks, N / BLOCK_N, slices)).
  model=${2:?model}; M=${3:?M}
  sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats
    --section SchedulerStats --section MemoryWorkloadAnalysis"
  timeout 300 ncu --clock-control none --graph-profiling node -k regex:lora_ --launch-count 8 $sections \
    python3 benchmarks/triton_fused_moe_compare.py --model $model --tokens $M --lora-rank 16 --adapters 4 \
    --configs benchmarks/peer_configs/nvidia-h200.json --iters 3 > $OUT/peer_ncu_$M.txt 2>&1
  echo "peer ncu rc $? at $(el) s"
  grep -E "^  \S+_kernel|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Grid Size|Block Limit|Issued Warp Per|Dynamic Shared" \
    $OUT/peer_ncu_$M.txt | cut -c1-150 | tee $OUT/peer_digest_$M.txt
  ;;
basediag)
  # The base layer's small-M GEMMs, ours against the peer's, under ncu's sections (speed of light, occupancy, launch,
  # memory, warp states) at MODEL and M: at 5e60aaa our two GEMMs at DeepSeek-V3 M = 16 took ~294 us against the
  # peer's 263.5 (the same 16 x 64 / 16 x 128 tiles; the peer's K steps 128 deep, 5 / 3 stages; ours 64, 8 / 4) and
  # ~194 against 183.6 at Qwen3-30B. $OUT/basediag_<M>.txt and a digest (~120 s warm, ~330 s cold).
  model=${2:?model}; M=${3:?M}
  [ -x $B/moelora_bench ] || build
  # The stall reasons (cycles a warp waits per issued instruction, by reason), the instructions and the DRAM bytes:
  # the fifty-first session's basediag had ours issue ~2.3x the peer's instructions at the same bytes.
  sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats
    --section SchedulerStats --section MemoryWorkloadAnalysis
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,dram__bytes_read.sum"
  timeout 120 ncu --clock-control none --graph-profiling node -k regex:fused_moe_sm80 --launch-count 4 $sections \
    $B/moelora_bench --device cuda --iters 3 --no-check --model $model --tokens $M > $OUT/basediag_$M.txt 2>&1
  echo "ours ncu rc $? at $(el) s"
  timeout 200 ncu --clock-control none --graph-profiling node -k regex:moe_gemm_kernel --launch-count 4 $sections \
    python3 benchmarks/triton_fused_moe_compare.py --model $model --tokens $M --configs \
    benchmarks/peer_configs/nvidia-h200.json --iters 3 >> $OUT/basediag_$M.txt 2>&1
  echo "peer ncu rc $? at $(el) s"
  # The stall reasons only where a warp waits >= 0.1 cycle an issued instruction for them.
  awk '/^  (void )?[a-z0-9_]+_kernel|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Grid Size|Block Limit|Issued Warp Per|Dynamic Shared|inst_executed|dram__bytes/ ||
    (/issue_stalled_/ && $NF + 0 >= 0.1)' $OUT/basediag_$M.txt | cut -c1-150 | tee $OUT/basediag_digest_$M.txt
  ;;
source)
  # Nsight Compute's source page for one LoRA kernel (the first launch matching REGEX after SKIP) of MODEL's LoRA r16 layer at M:
  # where its warps stall and which of its instructions make the excess sectors and wavefronts (the text sections
  # give totals only: the join at Qwen3-30B M = 4096 had 53% excess global sectors, 36% excess shared wavefronts).
  # $OUT/source_<M>.ncu-rep (open in the UI) and source_<M>.csv, and the top instructions on stdout.
  # SOURCE_RANK=0: the base layer's kernels (e.g. `source deepseek-v3-tp8 16 fused_moe_sm80 1`, GEMM2's sm80 tile).
  model=${2:?model}; M=${3:?M}; regex=${4:?kernel regex}; skip=${5:-0}
  [ -x $B/moelora_bench ] || build
  timeout 200 ncu --clock-control none --graph-profiling node -k regex:$regex --launch-skip $skip --launch-count 1 --set full \
    --import-source yes -f -o $OUT/source_$M $B/moelora_bench --device cuda --iters 3 --no-check --model $model \
    --tokens $M --lora-rank ${SOURCE_RANK:-16} --adapters 4 > /tmp/ncu_source.log 2>&1; echo "ncu rc $? at $(el) s"; tail -3 /tmp/ncu_source.log
  ncu --import $OUT/source_$M.ncu-rep --page source --print-source sass --csv > $OUT/source_$M.csv 2>&1
  echo "source page rc $? ($(wc -l < $OUT/source_$M.csv) lines)"
  python3 - $OUT/source_$M.csv <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head = next((i for i, r in enumerate(rows) if any("Source" in c for c in r) and len(r) > 5), None)
if head is None: sys.exit("no header: " + " | ".join(map(str, rows[:3])))
cols, body = rows[head], [r for r in rows[head + 1:] if len(r) == len(rows[head])]
print("columns:", " | ".join(cols))
def num(v):
    try: return float(v.replace(",", ""))
    except ValueError: return 0.0
src = next(i for i, c in enumerate(cols) if "Source" in c)
for key in ("Warp Stall Sampling (All", "L2 Theoretical Sectors Global Excessive", "L1 Wavefronts Shared Excessive"):
    idx = next((i for i, c in enumerate(cols) if c.startswith(key)), None)
    if idx is None: print("no column", key); continue
    print(f"## top 20 by {cols[idx]}")
    for r in sorted(body, key=lambda r: -num(r[idx]))[:20]:
        print(f"{num(r[idx]):12.0f}  {r[src][:110]}")
PY
  ;;
diag)
  model=${2:?model}; shift 2
  [ -x $B/moelora_bench ] || build
  sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats
    --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters"
  for M in "$@"; do
    # The first layer call's LoRA kernels in launch order.
    timeout 150 ncu --clock-control none --graph-profiling node -k regex:moe_lora_ --launch-count 4 $sections \
      $B/moelora_bench --device cuda --iters 3 --no-check --model $model --tokens $M --lora-rank 16 \
      --adapters 4 > $OUT/ncu_$M.txt 2>&1
    echo "ncu M=$M rc $? at $(el) s"
    echo "## $model M=$M"
    grep -E "^  void|Duration|DRAM Throughput|Elapsed Cycles|SM Active Cycles|Achieved Occupancy|Registers Per|Grid Size|Issued Warp Per|excessive" \
      $OUT/ncu_$M.txt | sed 's/(LoraDeltaParams.*//' | cut -c1-150
  done | tee $OUT/diag.txt
  ;;
*) echo "usage: bash docs/wip/issue31-next.sh ab | diag MODEL M [M...] | source MODEL M REGEX | peer MODEL M"; exit 2 ;;
esac
echo "done $(el) s"
