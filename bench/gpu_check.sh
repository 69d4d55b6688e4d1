#!/usr/bin/env bash
# The prepared GPU check: pt-ray's torch runtime on one CUDA GPU, without Ray.
#
#   bench/gpu_check.sh [--dry-run] [--ray] [--out DIR]
#
# 1. The gpu-marked tests (tests/test_gpu.py): the engine as one rank of a pure NCCL group
#    (which rejects CPU tensors) through steps, freeze transitions, evaluation and epoch ends,
#    in bf16, fp16 and fp32, for a ViT and a BERT; fp32 on the GPU against the CPU reference;
#    the activation cache holding CUDA activations in bf16, and cache on = cache off in fp32.
# 2. bench/gpu_speed.py, the speed ladder: ViT-B/16 in bf16 at batch 128, eager and compiled,
#    with nothing frozen, with the paper's freeze timeline (alpha 1/3), and with the timeline
#    and the activation cache (its device tier, and the store alone), beside a plain PyTorch
#    loop eager and compiled; the input paths (on the GPU, uint8 files, a JPEG folder it
#    writes); batch 256; BERT-base and BERT-large at sequence 128. Each arm as samples/s,
#    ratios and MFU (against the datasheet and a matmul measured in the run). Rungs that would
#    start past its --budget-s (420 s) are skipped, and say so.
#
# 3. With --ray, bench/gpu_ray.py: the whole service on the GPU (the controller actor, one GPU
#    worker under Ray Train, freezing and the cache, bf16) beside plain Ray Train on the same
#    job, in one table (start-up, training, whole call, samples/s, MFU, transitions, accuracy).
#    Where Ray is not importable it installs the bundle bench/gpu_bundle.py builds
#    ($PT_RAY_GPU_BUNDLE, default bench/out/gpu_bundle) into a temporary site folder first.
#
# It needs python3 with torch (CUDA), timm, transformers, scikit-learn, pyyaml, pytest and
# pydantic 2; Ray only for --ray (carried by the bundle). It prints one table last and writes DIR/gpu_check.json (with the
# tests' log and the speed table's JSON beside it). Minutes on one modern GPU.
# --dry-run runs the same steps on the CPU with gloo and a tiny model (tests/test_gpu_check.py runs
# it, so the check cannot rot on machines without a GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
out=bench/out/gpu
dry=0
ray=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --ray) ray=1 ;;
    --out) out="$2"; shift ;;
    *) echo "usage: bench/gpu_check.sh [--dry-run] [--ray] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done
py=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
mkdir -p "$out"
speed_args=()
if [ "$dry" = 1 ]; then
  export PT_RAY_GPU_TESTS_ON_CPU=1
  speed_args=(--dry-run)
fi

"$py" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -o addopts= \
  --junitxml "$out/gpu_tests.xml" 2>&1 | tee "$out/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}
"$py" bench/gpu_speed.py "${speed_args[@]}" --out "$out" 2>&1 | tee "$out/gpu_speed.log"
speed_rc=${PIPESTATUS[0]}
ray_rc=0
if [ "$ray" = 1 ]; then
  if ! "$py" -c "import ray" 2>/dev/null; then
    bundle=${PT_RAY_GPU_BUNDLE:-bench/out/gpu_bundle}
    if [ ! -x "$bundle/install.sh" ]; then
      echo "no Ray here and no bundle at $bundle: build one with python bench/gpu_bundle.py" >&2
      exit 2
    fi
    site=$(mktemp -d)
    trap 'rm -rf "$site"' EXIT
    bash "$bundle/install.sh" "$site" >/dev/null
    export PYTHONPATH="$PYTHONPATH:$site"
  fi
  "$py" bench/gpu_ray.py "${speed_args[@]}" --out "$out/ray" 2>&1 | tee "$out/gpu_ray.log"
  ray_rc=${PIPESTATUS[0]}
fi

"$py" - "$out" "$tests_rc" "$speed_rc" "$ray" "$ray_rc" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, tests_rc, speed_rc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
ray_asked, ray_rc = sys.argv[4] == "1", int(sys.argv[5])
tests = {"rc": tests_rc, "passed": 0, "failed": 0, "skipped": 0, "failures": []}
try:
    for case in ET.parse(out / "gpu_tests.xml").getroot().iter("testcase"):
        name = case.get("name")
        if case.find("failure") is not None or case.find("error") is not None:
            tests["failed"] += 1
            tests["failures"].append(name)
        elif case.find("skipped") is not None:
            tests["skipped"] += 1
        else:
            tests["passed"] += 1
except (OSError, ET.ParseError) as err:
    tests["failures"].append(f"no test report: {err}")
speed = json.loads((out / "gpu_speed.json").read_text()) if speed_rc == 0 else None
ray_run = (json.loads((out / "ray" / "gpu_ray.json").read_text())
           if ray_asked and ray_rc == 0 else None)
(out / "gpu_check.json").write_text(json.dumps({"tests": tests, "speed": speed, "ray": ray_run},
                                               indent=1))
print()
print(f"gpu tests: {tests['passed']} passed, {tests['failed']} failed, "
      f"{tests['skipped']} skipped" + (f" ({', '.join(tests['failures'])})"
                                       if tests["failures"] else ""))
if speed is None:
    print(f"speed table: failed (exit {speed_rc}); see {out}/gpu_speed.log")
else:
    sys.path.insert(0, "bench")
    from gpu_speed import table
    print(table(speed))
if ray_asked:
    if ray_run is None:
        print(f"Ray step: failed (exit {ray_rc}); see {out}/gpu_ray.log")
    else:
        sys.path.insert(0, "bench")
        from gpu_ray import table as ray_table
        print(ray_table(ray_run))
print(f"written: {out}/gpu_check.json")
EOF
[ "$tests_rc" = 0 ] && [ "$speed_rc" = 0 ] && [ "$ray_rc" = 0 ]
