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

cmake -S "$LLAMA" -B "$LLAMA/build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF
cmake --build "$LLAMA/build" -j"$JOBS" --target llama llama-quantize

# The ctypes binding's own pure-Python dependencies (we use it from the source tree,
# not pip-installed, so pip never resolved them).
python -m pip install --quiet "diskcache>=5.6.1" "typing-extensions>=4.5" "jinja2>=2.11.3"

LIB="$(dirname "$(find "$LLAMA/build" -name 'libllama.so' -print -quit)")"
QUANTIZE="$(find "$LLAMA/build" -name 'llama-quantize' -type f -perm -u+x -print -quit)"

echo
echo "llama.cpp source : $LLAMA"
echo "convert script   : $LLAMA/convert_hf_to_gguf.py"
echo "gguf-py          : $LLAMA/gguf-py"
echo "python binding   : $SRC/llama_cpp   (put $SRC on sys.path)"
echo "libllama.so dir  : $LIB   (export LLAMA_CPP_LIB_PATH=$LIB)"
echo "llama-quantize   : $QUANTIZE"
echo
echo "next: python tools/make_fixtures.py --llama-cpp $OUT_DIR"
