#!/bin/bash
# The Vulkan checks for a lent GPU machine, in one call (tools/device_prepare.sh says how to
# prepare it; carry .whl and .gl). Writes $OUT/devices.txt, kernels.txt, experts.txt, decode.txt.
#
# kernels.txt: bench/bench_kernels.py per weight type at 256 MiB per matrix (large enough that
#   a kernel's time is its reads, not its launch), GB/s per kernel and each one's ratio to the
#   copy shader; read GB/s against the card's memory bandwidth (H200: 4.8 TB/s HBM3e).
# decode.txt: `onebit bench` (prompt and decode tok/s) on the shipped model and a fixture: these
#   are small (5 MB / 1.4 MB), so their decode is launch- and host-bound, not a bandwidth figure.
set -uo pipefail
OUT=${OUT:-/tmp/onebit-device}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."
if ! ldconfig -p | grep -q libvulkan.so.1; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
fi
nv=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$nv" ] && export VK_DRIVER_FILES=${VK_DRIVER_FILES:-$nv}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
# onebit itself: pyproject.toml maps onebit.cli and onebit.memory to ./cli and ./memory, so the
# package is laid out as an install would (links), not put on the path as the source tree is
R="$PWD"
rm -rf /tmp/onebit && mkdir -p /tmp/onebit && cp -r onebit /tmp/onebit/ && ln -s "$R/cli" /tmp/onebit/onebit/cli \
    && ln -s "$R/memory" /tmp/onebit/onebit/memory || exit 1
export PYTHONPATH=/tmp/onebit:/tmp/site PYTHONUNBUFFERED=1
cd /tmp
{ nvidia-smi -L; python3 -c "from onebit.backends.vulkan.device import list_devices; print(*list_devices(), sep='\n')"; } \
    > "$OUT/devices.txt" 2>&1
cat "$OUT/devices.txt"
timeout 300 python3 "$R/bench/bench_kernels.py" --mib 256 --kernels mul_mv,mul_mv_id,get_rows --runs 7 \
    2>&1 | tee "$OUT/kernels.txt"
# experts.txt: prefill's routed experts (a Qwen3-30B-A3B layer's shapes: 128 experts, top 8,
#   [768 x 2048]), the per-slot mat-vec against the tiled expert mat-mat, alternating
timeout 150 python3 "$R/bench/bench_kernels.py" --kernels mul_mm_id --types Q4_K,Q6_K,Q8_0 --n-in 2048 \
    --moe-ff 768 --experts 128 --top-k 8 --prefill-rows 8,64,512 --runs 5 2>&1 | tee "$OUT/experts.txt"
for f in "$R/onebit/data/default.gguf" "$R/tests/fixtures/q3moe256-Q4_K_M.gguf"; do
    timeout 120 python3 -m onebit.cli.main bench --backend vulkan --prompt-tokens 64 --gen-tokens 64 --runs 5 "$f"
done 2>&1 | tee "$OUT/decode.txt"
