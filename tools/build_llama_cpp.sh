#!/usr/bin/env bash
# Build the llama.cpp pieces that tools/make_fixtures.py needs to make test fixtures:
#   - libllama.so (+ libggml*.so), loaded through the pure-ctypes `llama_cpp` package
#     that ships in the llama-cpp-python sdist (tokenizer and logits oracle);
#   - llama-quantize (quantized fixtures);
#   - convert_hf_to_gguf.py + gguf-py from the same vendored tree (HF -> GGUF).
# We take llama.cpp from the llama-cpp-python sdist so that the ctypes binding and the
# C library come from one pinned release and always agree on struct layouts.
#
# Usage: tools/build_llama_cpp.sh [OUT_DIR]     (default: <repo>/.llama-cpp, gitignored)
#   TARGETS="llama-bench llama-completion llama-server" adds the peer programs the benches run
#   (bench/bench_scale.py, bench/bench_serve.py, bench/bench_compare.py).
#   AMX=1 keeps ggml's AMX kernels in a native build. Off by default: a CPU may list AMX while the
#   kernel (or a VM) does not grant the process its tile state, and llama.cpp then dies with
#   SIGSEGV in ggml_backend_amx_mul_mat on its first matrix (this project's VMs do).
#   AVX2_ONLY=1 builds for a CPU with AVX2 and FMA and no AVX-512 (GGML_NATIVE off), into
#   OUT_DIR/.../build-avx2, so that this machine can measure what an AVX2 laptop gets.
# Needs: pip, cmake, a C/C++ compiler. CPU backend only; nothing here is needed at test time.
set -euo pipefail

VERSION=0.3.36
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="$(mkdir -p "${1:-$REPO_ROOT/.llama-cpp}" && cd "${1:-$REPO_ROOT/.llama-cpp}" && pwd)"
SRC="$OUT_DIR/llama_cpp_python-$VERSION"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"

if [ ! -d "$SRC" ]; then
    # --no-binary: we want the source tree (with vendor/llama.cpp), not a prebuilt wheel.
    pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$OUT_DIR/sdist"
    tar -xzf "$OUT_DIR/sdist/llama_cpp_python-$VERSION.tar.gz" -C "$OUT_DIR"
fi

LLAMA="$SRC/vendor/llama.cpp"
# The sdist keeps the submodule's `.git` file, which points at a directory that is not
# shipped; cmake's git-version probe then fails. Remove it.
rm -f "$LLAMA/.git"

BUILD="$LLAMA/build"
CPU_FLAGS=()
if [ "${AVX2_ONLY:-0}" = 1 ]; then
    BUILD="$LLAMA/build-avx2"
    CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
               -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_BF16=OFF
               -DGGML_AVX_VNNI=OFF)
fi
if [ "${AMX:-0}" != 1 ]; then
    CPU_FLAGS+=(-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
                -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
EXTRA="${TARGETS:-}"
SERVER=OFF
case " $EXTRA " in *" llama-server "*) SERVER=ON ;; esac
cmake -S "$LLAMA" -B "$BUILD" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER="$SERVER" \
    "${CPU_FLAGS[@]}"
# shellcheck disable=SC2086
cmake --build "$BUILD" -j"$JOBS" --target llama llama-quantize $EXTRA

# The ctypes binding's own pure-Python dependencies (we use it from the source tree,
# not pip-installed, so pip never resolved them).
python -m pip install --quiet "diskcache>=5.6.1" "typing-extensions>=4.5" "jinja2>=2.11.3"

LIB="$(dirname "$(find "$BUILD" -name 'libllama.so' -print -quit)")"
QUANTIZE="$(find "$BUILD" -name 'llama-quantize' -type f -perm -u+x -print -quit)"

echo
echo "llama.cpp source : $LLAMA"
echo "convert script   : $LLAMA/convert_hf_to_gguf.py"
echo "gguf-py          : $LLAMA/gguf-py"
echo "python binding   : $SRC/llama_cpp   (put $SRC on sys.path)"
echo "libllama.so dir  : $LIB   (export LLAMA_CPP_LIB_PATH=$LIB)"
echo "llama-quantize   : $QUANTIZE"
for t in $EXTRA; do
    echo "$(printf '%-17s' "$t"): $(find "$BUILD" -name "$t" -type f -perm -u+x -print -quit)"
done
echo
echo "next: python tools/make_fixtures.py --llama-cpp $OUT_DIR"
