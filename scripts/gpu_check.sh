#!/usr/bin/env bash
# One command that checks zoff end to end on a machine with 1+ CUDA GPUs and prints one markdown table
# (paste it into docs/gpus.md with its header line: where and when it was measured).
#
#   scripts/gpu_check.sh [--dry-run] [--out DIR]      (default DIR: runs/gpu_check under the repo root)
#
# Steps: the cuda-marked tests, the pattern zoo and the engine equivalence tests over NCCL, `zoff train` on
# every ZeRO recipe, activation memory against the estimate, and the CPU Adam benchmark. Each step's output
# goes to DIR/<step>.log; the table goes to
# stdout, DIR/summary.md and DIR/summary.json. Exit 0 if every step passed, 1 if one failed, 2 for a usage
# error or a machine without CUDA. --dry-run prints the environment and the commands, runs nothing.
# PYTHON picks the interpreter (default: python); it must import torch and zoff. GPU_CHECK_STEP_S bounds each
# step (default 600 s; exit 124 in the table when a step runs past it): a hung collective costs one step,
# not the machine's lease. ZOFF_COMMIT names the commit of a copied tree (its .git, if any, may be another's).
set -uo pipefail

usage="usage: scripts/gpu_check.sh [--dry-run] [--out DIR]"
dry=0
out=""
while (($#)); do
    case $1 in
        --dry-run) dry=1 ;;
        --out)
            [[ $# -ge 2 && -n $2 ]] || { echo "gpu_check: --out needs a directory; $usage" >&2; exit 2; }
            out=$2; shift ;;
        --out=?*) out=${1#--out=} ;;
        -h | --help) echo "$usage"; exit 0 ;;
        *) echo "gpu_check: unknown argument '$1'; $usage" >&2; exit 2 ;;
    esac
    shift
done

# A relative --out means the caller's cwd; resolve it before moving to the repo root (which the test paths,
# configs/ and scripts/ are relative to).
[[ -n $out && $out != /* ]] && out=$PWD/$out
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || exit 2
cd "$root" || exit 2
out=${out:-$root/runs/gpu_check}
py=${PYTHON:-python}

# Ask the same interpreter the steps use (not nvidia-smi): what matters is what torch can see.
# -W ignore: torch warns on stderr when a CUDA build finds no driver; the count already says so.
detect='
import sys
try:
    import torch
except Exception as e:
    print(f"error\t{type(e).__name__}: {e}"); sys.exit(0)
n = torch.cuda.device_count()
names = [torch.cuda.get_device_name(i) for i in range(n)]
gpus = ", ".join(f"{m} x {names.count(m)}" for m in dict.fromkeys(names)) or "none"
print("\t".join([str(n), torch.__version__, torch.version.cuda or "none", gpus]))'
det=$("$py" -W ignore -c "$detect" 2>/dev/null) || det="error	cannot run '$py'"
IFS=$'\t' read -r count torch_v cuda_v gpus <<<"$det"
if [[ $count == error ]]; then
    echo "gpu_check: cannot import torch with PYTHON=$py ($torch_v); activate zoff's environment or set PYTHON" >&2
    exit 2
fi
world=$((count >= 2 ? 2 : 1))  # 2 ranks exercise every collective; more GPUs add nothing to a check

# The steps, in order: slug|name|command. Commands are shell text so that --dry-run prints exactly what runs.
q() { printf %q "$1"; }
pytest="$(q "$py") -m pytest -q -p no:cacheprovider"
steps=(
    "cuda-tests|cuda tests|$pytest -m cuda tests/gpu"
    "pattern-zoo|pattern zoo on NCCL (world $world)|ZOFF_TEST_DEVICE=cuda ZOFF_TEST_WORLD=$world $pytest tests/patterns/test_zoo.py -k test_slice"
    "engine-equivalence|engine equivalence on NCCL (world $world)|ZOFF_TEST_DEVICE=cuda ZOFF_TEST_WORLD=$world $pytest tests/integration/test_engine_equivalence.py"
)
for r in zero0 zero1 zero2 zero3 zero2-offload zero3-offload; do
    steps+=("train-$r|zoff train $r (world $world)|$(q "$py") -m zoff train configs/quickstart.yaml zero=$r launch.nproc_per_node=$world train.max_steps=30 log.progress=false --run-dir $(q "$out/train-$r")")
done
# The disk tier on a GPU machine: states swapped from local disk, gradients down and parameters up via staging.
steps+=("train-zero2-nvme|zoff train zero2-nvme (world $world)|mkdir -p $(q "$out/nvme") && $(q "$py") -m zoff train configs/quickstart.yaml zero=zero2-nvme zero.offload_optimizer.nvme_path=$(q "$out/nvme") launch.nproc_per_node=$world train.max_steps=30 log.progress=false --run-dir $(q "$out/train-zero2-nvme")")
# Offload keeps the gradient partition off the device: the GPU's allocated bytes against the estimate.
steps+=("offload-device-bytes|offload: device bytes vs the estimate|$pytest -s -m cuda tests/gpu/test_cuda_paths.py -k test_offload_keeps_no_gradient_shard_on_the_device")
# Activation memory measured by the CUDA allocator against the estimate's saved bytes and peak.
steps+=("activation-memory|activation memory vs the estimate|$(q "$py") scripts/gpu_activation_check.py --out $(q "$out/gpu_activation_check.json")")
steps+=("bench-adam|CPU Adam benchmark (host)|$(q "$py") scripts/bench_adam.py --sizes 16M,64M --rounds 5 --out $(q "$out/bench_adam.json")")

# ZOFF_COMMIT first: a copied tree can carry a .git that is not the copy's commit.
if [[ -n ${ZOFF_COMMIT:-} ]]; then
    commit=$ZOFF_COMMIT
elif commit=$(git rev-parse --short HEAD 2>/dev/null); then
    ! git diff --quiet HEAD 2>/dev/null && commit+="-dirty"  # local edits are not HEAD
else
    commit=unknown
fi
header="$(date -u '+%Y-%m-%d %H:%M UTC'), $(hostname), GPU: $gpus, torch $torch_v, CUDA $cuda_v, commit $commit"

if ((dry)); then
    echo "gpu_check --dry-run: $header"
    ((count == 0)) && echo "no CUDA device here: this is what a 1-GPU machine would run (world $world)"
    echo "world size: $world; logs and results would go to $out"
    for s in "${steps[@]}"; do
        IFS='|' read -r _ name cmd <<<"$s"
        printf '\n%s\n  %s\n' "$name" "$cmd"
    done
    exit 0
fi
if ((count == 0)); then  # one line, nothing written: the point of the script is the GPU paths
    echo "gpu_check: no CUDA device visible to torch $torch_v (CUDA build: $cuda_v); run it on a GPU machine, or pass --dry-run to see what it would run" >&2
    exit 2
fi

mkdir -p "$out" || exit 2
rows="$out/steps.tsv"
: >"$rows"
echo "gpu_check: $header; world $world; logs in $out"
for s in "${steps[@]}"; do
    IFS='|' read -r slug name cmd <<<"$s"
    log="$out/$slug.log"
    [[ $slug == train-* ]] && rm -rf "${out:?}/$slug"  # a fresh run dir: no stale metrics or checkpoints
    printf '%-45s ' "$name" >&2
    t0=$(date +%s.%N)
    timeout -k 10 "${GPU_CHECK_STEP_S:-600}" bash -c "$cmd" >"$log" 2>&1
    rc=$?
    ((rc == 124)) && echo "gpu_check: step stopped after GPU_CHECK_STEP_S=${GPU_CHECK_STEP_S:-600} s" >>"$log"
    secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.0f", b - a }')
    # The one-line result: pytest's summary line, the run's summary.json, or the benchmark's ratios.
    case $slug in
        train-*) res=$("$py" -c 'import json, sys
s = json.load(open(sys.argv[1]))
print("final loss %.4f, %s tok/s" % (s["final_loss"], format(s["mean_tokens_per_s"], ",.0f")))' "$out/$slug/summary.json" 2>/dev/null) ;;
        # bench_adam's keys change as its variants do: take every "vs torch fused" ratio, whatever its name.
        bench-adam) res=$("$py" -c 'import json, sys
b = json.load(open(sys.argv[1]))
vs = ["%dM %s %.2fx" % (r["n"] >> 20, k.replace("zoff ", ""), v) for r in b["results"]
      for k, v in r["speedups"].items() if "torch fused" in k and "copy" not in k]
t = b.get("targets", {})
print("; ".join(vs) + (" (targets: %d/%d pass)" % (sum(t.values()), len(t)) if t else ""))' "$out/bench_adam.json" 2>/dev/null) ;;
        activation-memory) res=$("$py" -c 'import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["results"] if "error" not in r]
q = [r["estimate_peak"] / r["measured_peak"] for r in rows]
print("%d cases, peak estimate / measured %.3f to %.3f" % (len(q), min(q), max(q)))' "$out/gpu_activation_check.json" 2>/dev/null) ;;
        *) res=$(grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected)|no tests ran' "$log" | tail -n1 | tr -d '=') ;;
    esac
    [[ -n ${res// /} ]] || res="$(tail -n1 "$log")"  # no result: the log's last line says why
    res=$(echo "$res" | tr '\t' ' ' | sed 's/^ *//; s/ *$//')
    echo "exit $rc, ${secs}s: $res" >&2
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "$res" "$cmd" >>"$rows"
done

# The table: summary.json and summary.md (scripts/gpu_check_report.py, which also renders docs/gpus.md).
"$py" scripts/gpu_check_report.py "$out" "$header"
exit $(($? == 0 ? 0 : 1))  # 1 also where the table itself could not be written
