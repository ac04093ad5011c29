#!/usr/bin/env bash
# One short session on a lent GPU node, in the order that matters most when time is short:
# the node's validation (GPU tests, the Triton kernels natively, torch-vs-Triton greedy parity on the
# tiny checkpoints, one served image chat), then the 7B-shaped checks and benchmarks (offline
# against transformers and the floors, 7B torch-vs-Triton parity, a served run with images),
# then the vision towers' segment attention at several tile sizes.
#
#     OUT=results bash scripts/gpu_session.sh            # from the repository root
#
# Every step has a time limit cut to what is left of GPU_SESSION_BUDGET seconds (default 480), so
# a hang in one step costs that step alone. GPU_SESSION_STEPS (comma list; default all) picks
# steps among: pytest, gpu_check, offline_7b, vision_unpadded (the 7B's vision tower profiled
# with its MLP hidden size as the checkpoint has it, to compare with offline_7b's padded one),
# offline_7b_sync (batch-1 decode with overlap off, to compare), parity_7b, serving_7b, varlen,
# offline_7b_sampled (decode at temperature 0.8, overlapped, batch 1 and 32);
# GPU_SESSION_CHECKS the gpu_check checks (default parity_tiny,serve). The 7B checkpoint
# (about 16 GB, bfloat16) is written in the background while the tests run. Logs and JSON
# reports go to $OUT; the 7B offline step also writes its decode and vision profiles there,
# and takes more arguments from GPU_SESSION_OFFLINE_ARGS (e.g. --skip-hf when a run already
# measured HF).
set -u
OUT=${OUT:-gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
BUDGET=${GPU_SESSION_BUDGET:-480}
STEPS=${GPU_SESSION_STEPS:-pytest,gpu_check,offline_7b,vision_unpadded,offline_7b_sync,parity_7b,serving_7b,varlen,offline_7b_sampled}
CKPT=${GPU_SESSION_CKPT:-/tmp/tessera-7b}
START=$SECONDS

step() {  # step NAME LIMIT COMMAND...: run it under the smaller of LIMIT and the time left
    local name=$1 limit=$2 left=$((BUDGET - (SECONDS - START) - 5))
    shift 2
    if [[ ",$STEPS," != *",$name,"* ]]; then
        echo "== $name: not asked for"
        return
    fi
    ((limit > left)) && limit=$left
    if ((limit < 10)); then
        echo "== $name: skipped, no time left"
        return
    fi
    echo "== $name: start at $((SECONDS - START)) s, limit $limit s"
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@"
    echo "== $name: rc $? after $((SECONDS - t0)) s"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 - <<'EOF'
import importlib
for name in ("torch", "triton", "transformers", "tokenizers", "flashinfer"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:  # noqa: BLE001
        print(name, "missing:", exc)
import torch
print("cuda", torch.version.cuda, "devices", torch.cuda.device_count())
EOF

if [ ! -f "$CKPT/config.json" ]; then
    timeout 400 python3 scripts/make_tiny_checkpoint.py --arch qwen2_5_vl --preset 7b \
        --out "$CKPT" >/tmp/tessera-ckpt.log 2>&1 &
    CKPT_PID=$!
fi

step pytest 120 python3 -m pytest -q -rfEs --tb=short -p no:cacheprovider --durations=10 \
    tests/test_triton_kernels.py tests/test_triton_model.py tests/test_varlen_segments.py \
    tests/test_decode_graphs.py tests/test_flashinfer_metadata.py tests/test_device_placement.py \
    tests/test_overlap.py::test_overlapped_decode_on_cuda_graphs tests/test_vit_mlp_padding.py \
    >"$OUT/pytest.log" 2>&1
[ -f "$OUT/pytest.log" ] && tail -n 40 "$OUT/pytest.log"

step gpu_check 120 python3 scripts/gpu_check.py --checks "${GPU_SESSION_CHECKS:-parity_tiny,serve}" \
    --json "$OUT/gpu_check.json" --timeout 120

if [ -n "${CKPT_PID:-}" ]; then
    echo "== waiting for the 7B checkpoint"
    wait "$CKPT_PID"
    echo "== checkpoint: rc $? at $((SECONDS - START)) s"
    tail -n 5 /tmp/tessera-ckpt.log
fi

step offline_7b 160 python3 scripts/bench_offline.py --model-path "$CKPT" --device cuda \
    --dtype bfloat16 --batch-sizes 1,32 --output-len 128 --json "$OUT/offline7b.json" \
    --profile-decode 30 --profile-vision --profile-dir "$OUT" ${GPU_SESSION_OFFLINE_ARGS:-}

step vision_unpadded 60 python3 scripts/bench_offline.py --model-path "$CKPT" --device cuda \
    --dtype bfloat16 --batch-sizes 32 --output-len 4 --skip-hf --disable-vit-mlp-padding \
    --profile-vision --json "$OUT/vision_unpadded.json"

step offline_7b_sync 70 python3 scripts/bench_offline.py --model-path "$CKPT" --device cuda \
    --dtype bfloat16 --batch-sizes 1 --output-len 128 --skip-hf --disable-overlap-schedule \
    --json "$OUT/offline7b_sync.json"

step parity_7b 80 python3 scripts/gpu_check.py --checks parity_7b --model-7b "$CKPT" \
    --json "$OUT/parity7b.json" --timeout 90
step serving_7b 100 python3 - "$CKPT" "$OUT" <<'EOF'
import subprocess, sys
from pathlib import Path
sys.path[:0] = ["scripts"]
from stress import LaunchedServer, stop_and_time

ckpt, out = sys.argv[1], Path(sys.argv[2])
server = LaunchedServer(["--model-path", ckpt, "--tp", "1"], out / "serve7b.log")
try:
    server.wait_healthy(90)
    subprocess.run([sys.executable, "scripts/bench_serving.py", "--base-url", server.url,
                    "--num-prompts", "64", "--request-rate", "inf", "--max-concurrency", "32",
                    "--image-width", "448", "--image-height", "448", "--output-len", "64",
                    "--warmup", "2", "--label", "tessera-7b", "--output-json",
                    str(out / "serving7b.json")], check=True, timeout=60)
finally:
    print(f"server stopped in {stop_and_time(server):.1f} s")
EOF

step varlen 40 python3 scripts/bench_offline.py --varlen-attention --varlen-images 32 \
    --json "$OUT/varlen.json"

step offline_7b_sampled 70 python3 scripts/bench_offline.py --model-path "$CKPT" --device cuda \
    --dtype bfloat16 --batch-sizes 1,32 --output-len 128 --temperature 0.8 \
    --json "$OUT/offline7b_sampled.json"
echo "== done at $((SECONDS - START)) s"
