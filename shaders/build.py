#!/usr/bin/env python3
"""Compile every variant in shaders/variants.py with glslc into onebit/backends/vulkan/spv/.

    python shaders/build.py            # rebuild what changed
    python shaders/build.py --all      # rebuild everything

Writes `manifest.json` next to the .spv files: per variant, the hash of its sources, defines
and flags, and the sha256 of the .spv. tests/test_vulkan_shaders.py fails when a source
changed without a rebuild. Needs glslc (Debian/Ubuntu: apt-get install glslc).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from variants import GLSLC_FLAGS, SHADER_DIR, SPV_DIR, Variant, variants  # noqa: E402

MANIFEST = SPV_DIR / "manifest.json"


def compile_variant(glslc: str, v: Variant) -> tuple[Variant, bytes]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / f"{v.name}.spv"
        cmd = [glslc, *v.glslc_args(), str(SHADER_DIR / v.source), "-o", str(out)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"glslc failed on {v.name} ({v.source}):\n{res.stderr}")
        return v, out.read_bytes()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--all", action="store_true", help="rebuild every variant")
    ap.add_argument("--glslc", default=os.environ.get("GLSLC", "glslc"))
    args = ap.parse_args()
    glslc = shutil.which(args.glslc)
    if glslc is None:
        print(f"glslc not found ({args.glslc}); install it (apt-get install glslc)", file=sys.stderr)
        return 2
    version = subprocess.run([glslc, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    old = json.loads(MANIFEST.read_text())["variants"] if MANIFEST.exists() else {}
    SPV_DIR.mkdir(parents=True, exist_ok=True)
    table = variants()
    todo = [
        v for v in table
        if args.all or old.get(v.name, {}).get("source_hash") != v.source_hash()
        or not (SPV_DIR / f"{v.name}.spv").exists()
    ]
    entries = {v.name: old[v.name] for v in table if v.name in old}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for v, spv in pool.map(lambda v: compile_variant(glslc, v), todo):
            (SPV_DIR / f"{v.name}.spv").write_bytes(spv)
            entries[v.name] = {
                "source": v.source,
                "defines": [f"{k}={d}" if d else k for k, d in v.defines],
                "source_hash": v.source_hash(),
                "spv_sha256": hashlib.sha256(spv).hexdigest(),
            }
    names = {v.name for v in table}
    for stale in SPV_DIR.glob("*.spv"):
        if stale.stem not in names:
            stale.unlink()
    manifest = {"glslc": version, "flags": list(GLSLC_FLAGS),
                "variants": {n: entries[n] for n in sorted(entries) if n in names}}
    MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"{len(todo)} of {len(table)} variants compiled into {SPV_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
