#!/bin/bash
# Prepare a run of bench/device_check.sh on a lent GPU machine (the `device` tool of this
# workplace: an H200 with Vulkan, no network there, Python 3.12 with numpy / numba / jinja2 /
# typer / tokenizers / tqdm / psutil / pyyaml / setuptools already installed).
#
#   tools/device_prepare.sh          # here, with network: wheels into .whl/, the Vulkan loader into .gl/
#   tools/device_prepare.sh --slim   # take the big test fixtures out of the working tree (see below)
#   tools/device_prepare.sh --restore
#
# Then one device call, carrying .whl and .gl:  bash bench/device_check.sh
# (results under $OUT: devices.txt, kernels.txt, decode.txt).
#
# The device tool sends the working tree (tracked files too) and refuses one over 64 MiB; this
# repository's tracked files are ~76 MB, most of it tests/fixtures. --slim deletes from the
# working tree only (nothing is committed) the fixtures the device check does not read, and
# --restore puts them back from git (`git checkout -- tests/fixtures`). Run --restore right after
# the device call.
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
--slim)
    git ls-files tests/fixtures | grep -E '\.gguf$' | grep -v -E '/(q3moe256-Q4_K_M|qwen3moe-f32)\.gguf$' | xargs rm -f
    echo "working tree now $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) bytes of tracked files" \
         "(plus .whl/.gl); tools/device_prepare.sh --restore after the device call"
    exit 0 ;;
--restore)
    git checkout -- tests/fixtures
    git status --short tests/fixtures | head
    exit 0 ;;
"") ;;
*) echo "usage: $0 [--slim | --restore]" >&2; exit 2 ;;
esac

for d in /.whl/ /.gl/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
mkdir -p .whl .gl /tmp/amd64/partial
# onebit's dependencies the device image lacks (versions as tested here), for CPython 3.12
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl cffi==2.1.1 pycparser==3.12 vulkan==1.3.275.1 gguf==0.19.0
# the Vulkan loader (the NVIDIA driver's ICD is mounted there)
o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
apt-get $o update -qq
(cd .gl && apt-get $o download -qq libvulkan1)
ls -la .whl .gl
