#!/usr/bin/env bash
# Check the supported torch range (README "Supported torch builds"): heteroflow on the floor torch, and one job
# whose "nodes" run different torch builds.
#
#   tools/check_torch_range.sh [FLOOR_VERSION]        (default 2.4.1, the oldest build heteroflow supports)
#
# 1. A venv with torch==FLOOR (the package index's CUDA build, ~3 GB; it runs on the CPU) and heteroflow from
#    this checkout (`pip install --no-deps -e`, plus its small dependencies), in $TORCH_VENVS/torch-FLOOR
#    (default ~/.cache/heteroflow/venvs), reused when it is there.
# 2. The README's demo for STEPS steps (default 10) on the floor torch and on the newer torch of `python`
#    (NEW_PYTHON), every rank a CPU process (--emulate).
# 3. The same job as three nodes on 127.0.0.1 (`--node NAME --rdzv`): gpu-0 and dcu-0 on the newer torch,
#    npu-0 on the floor.
# 4. Checks: the three runs' losses are equal step for step (within 1e-5 relative: see TOLERANCE), and a ZeRO-3 stage on the floor torch is refused
#    by name (exit 2) rather than failing inside torch.
# Exit 0 when every check passes; the losses and versions are printed.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
FLOOR=${1:-2.4.1}
STEPS=${STEPS:-10}
NEW_PY=${NEW_PYTHON:-python}
VENV=${TORCH_VENVS:-${HOME:-/tmp}/.cache/heteroflow/venvs}/torch-$FLOOR
OUT=$(mktemp -d "${TMPDIR:-/tmp}/heteroflow-torch-range.XXXXXX")
export PIP_DISABLE_PIP_VERSION_CHECK=1 OMP_NUM_THREADS=1 HETEROFLOW_CACHE=$OUT/cache
pids=()
cleanup() { for pid in "${pids[@]}"; do kill -- "-$pid" 2>/dev/null || true; done; }
trap cleanup EXIT

step() { echo "== $(date -u +%H:%M:%S) $*"; }

step "venv $VENV (torch $FLOOR)"
if [ ! -x "$VENV/bin/python" ]; then
  python -m venv "$VENV"
fi
OLD_PY=$VENV/bin/python
# pip from elsewhere: in the checkout (or under a PYTHONPATH naming it) it would take the checkout's
# heteroflow.egg-info for an installed heteroflow and complain about its dependencies.
venv_pip() { (cd "$OUT" && env -u PYTHONPATH "$OLD_PY" -m pip install -q "$@"); }
have=$(cd "$OUT" && "$OLD_PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have" != "$FLOOR" ]; then
  venv_pip "torch==$FLOOR"
fi
venv_pip 'numpy>=1.24' 'psutil>=5.9' 'pyyaml>=6.0' 'safetensors>=0.4'
venv_pip --no-deps -e "$REPO"
old_version=$(cd "$OUT" && "$OLD_PY" -c 'import torch, heteroflow; print(torch.__version__)')
new_version=$(cd "$OUT" && "$NEW_PY" -c 'import torch; print(torch.__version__)')
echo "floor: $OLD_PY torch $old_version; newer: $NEW_PY torch $new_version"

# The demo's job, its nodes given an address so they can also run as separate agents.
JOB=$OUT/job.yaml
"$NEW_PY" - "$REPO" "$OUT" <<'EOF'
import sys, yaml
from pathlib import Path
repo, out = Path(sys.argv[1]), Path(sys.argv[2])
job = yaml.safe_load((repo / "configs/jobs/emulated-three-vendor.yaml").read_text())
cluster = yaml.safe_load((repo / "configs/clusters/cpu-emulation.yaml").read_text())["cluster"]
for node in cluster["nodes"]:
    node["host"] = "127.0.0.1"
job["cluster"] = cluster
(out / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
zero3 = dict(job, plan=dict(job["plan"], stages=[dict(s) for s in job["plan"]["stages"]]))
zero3["plan"]["stages"][1]["zero"] = 3
(out / "zero3.yaml").write_text(yaml.safe_dump(zero3, sort_keys=False))
EOF

train() {  # PYTHON NAME ARGS...: one run, its output in $OUT/NAME.out
  local py=$1 name=$2
  shift 2
  "$py" -m heteroflow train "$JOB" --emulate --steps "$STEPS" --log-dir "$OUT/logs-$name" "$@" >"$OUT/$name.out" 2>&1
}

step "demo, $STEPS steps, torch $old_version"
train "$OLD_PY" floor --metrics "$OUT/floor.jsonl" || { tail -40 "$OUT/floor.out"; exit 1; }
step "demo, $STEPS steps, torch $new_version"
train "$NEW_PY" newer --metrics "$OUT/newer.jsonl" || { tail -40 "$OUT/newer.out"; exit 1; }

step "mixed: gpu-0 and dcu-0 on torch $new_version, npu-0 on torch $old_version"
port=$("$NEW_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
start_node() {  # PYTHON NODE [ARGS...]: an agent in its own session, so cleanup can stop all of it
  local py=$1 node=$2
  shift 2
  setsid "$py" -m heteroflow train "$JOB" --emulate --steps "$STEPS" --node "$node" --rdzv "127.0.0.1:$port" \
    --join-timeout 300 --log-dir "$OUT/logs-mixed-$node" "$@" >"$OUT/mixed-$node.out" 2>&1 &
  pids+=($!)
}
start_node "$NEW_PY" gpu-0 --metrics "$OUT/mixed.jsonl"  # the first node hosts the rendezvous, holds rank 0
for _ in $(seq 600); do
  "$NEW_PY" -c "import socket, sys; socket.create_connection(('127.0.0.1', $port), 0.5)" 2>/dev/null && break
  sleep 0.2
done
start_node "$OLD_PY" npu-0
start_node "$NEW_PY" dcu-0
status=0
for i in "${!pids[@]}"; do wait "${pids[$i]}" || status=1; done
pids=()
if [ $status -ne 0 ]; then
  for node in gpu-0 npu-0 dcu-0; do echo "--- $node"; tail -30 "$OUT/mixed-$node.out"; done
  exit 1
fi

step "ZeRO-3 on torch $old_version is refused by name"
set +e
"$OLD_PY" -m heteroflow train "$OUT/zero3.yaml" --emulate --steps 1 --log-dir "$OUT/logs-zero3" >"$OUT/zero3.out" 2>&1
zero3_rc=$?
set -e
grep -h "ZeRO-3" "$OUT/zero3.out" | head -3 || true

"$NEW_PY" - "$OUT" "$zero3_rc" <<'EOF'
import json, sys
from pathlib import Path
out, zero3_rc = Path(sys.argv[1]), int(sys.argv[2])

def losses(name):
    rows = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    return [row["loss"] for row in rows if "loss" in row]

runs = {name: losses(name) for name in ("floor", "newer", "mixed")}
steps = len(runs["newer"])
print("step " + "".join(f"{name:>20}" for name in runs))
for i in range(steps):
    print(f"{i:4d} " + "".join(f"{runs[name][i]:20.15f}" if i < len(runs[name]) else f"{'-':>20}" for name in runs))
# Equal within float tolerance, not bit for bit: builds before 2.5 have no grouped-query SDPA (`enable_gqa`), so
# their attention copies K/V to every head and rounds differently in the last bits.
TOLERANCE = 1e-5
failed = []
for name in ("floor", "mixed"):
    if len(runs[name]) != steps:
        failed.append(f"{name} run recorded {len(runs[name])} losses, the single-version run {steps}")
        continue
    worst = max((abs(a - b) / abs(b) for a, b in zip(runs[name], runs["newer"])), default=0.0)
    print(f"{name}: largest relative difference from the single-version run {worst:.2e}")
    if worst > TOLERANCE:
        failed.append(f"{name} run's losses differ from the newer torch's single-version run by {worst:.2e} "
                      f"(relative; tolerance {TOLERANCE:g})")
if steps == 0:
    failed.append("no losses recorded")
refused = "ZeRO-3 (zero: 3) needs torch >=" in (out / "zero3.out").read_text()
if zero3_rc != 2 or not refused:
    failed.append(f"ZeRO-3 on the floor torch: exit {zero3_rc}, expected 2 with the 'needs torch >=' message")
print("\n".join(failed) if failed else
      f"torch range check passed: {steps} steps, losses equal within {TOLERANCE:g} relative")
sys.exit(1 if failed else 0)
EOF
rm -rf "$OUT"  # kept (with every run's output and logs) only when a check failed
