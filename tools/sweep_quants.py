#!/usr/bin/env python3
"""Sweep every llama-quantize preset (and a few dynamic mixes) of every f32 fixture against llama.cpp.

    nice -n 10 python tools/sweep_quants.py --llama-cpp /work/deps [--fixtures q3moe256,llama]
        [--presets Q4_K_M,IQ2_M] [--backends numpy,cpu,vulkan] [--out /tmp/sweep]
        [--table bench/results/quant-sweep-2026-12-02.md]

For each f32 fixture in tests/fixtures/manifest.json and each preset: llama-quantize the file into
the scratch dir (with an importance matrix made by tools/make_imatrix.py where llama-quantize asks
for one), take llama.cpp's logits for the fixture's 48 reference tokens on the quantized file
(a child process running tools/make_fixtures.py's llama.cpp helpers), then on each backend
onebit's logits for the same tokens, and compare: cosine >= 0.999 on >= 95% of positions (the bar
of tests/test_oracle.py), or, where a backend misses it, the numpy backend with llama.cpp's
activation rounding modelled (tests/llamacpp_numerics.py, held to libggml-cpu's own rounding and
dot products by tests/test_llamacpp_numerics.py) must make it; that figure is computed for every
file; where that misses too, the rounded run against itself with its input nudged by 2 ulp shows
whether the model is chaotic. Also: greedy tokens numpy vs Vulkan (6 after 6 prompt tokens),
streamed experts (the fewest slots the plan allows) == resident bit for bit on cpu and Vulkan,
and `onebit info` and `onebit plan` exit 0. Verdicts: ok, explained (the rounding model meets
the bar), chaotic, same (--dedupe), FAIL.

The 64-wide fixtures' rows do not divide 256, so llama-quantize falls back to 32-blocks there;
--make-wide DIR makes 256-row variants of the other architectures (scratch, MiBs) for
--fixtures-dir DIR. --from-json makes the table from earlier runs' --json files.

Files whose tensor types (name -> type) equal an earlier preset's of the same fixture are
quantized and checked against llama.cpp once more but not rerun on every backend when
--dedupe is given (the kernels they reach are the same); by default everything runs.

Needs the llama.cpp build of tools/build_llama_cpp.sh and a Python that can import its
`llama_cpp` binding (--llama-python, default /work/deps/venv/bin/python); never part of the
default test run. Prints one line per (file, backend) as it goes and writes a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"

# The hub's llama-quantize presets (as the task lists them), in llama-quantize's names.
PRESETS = ["Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_0", "Q4_1", "Q4_K_S", "Q4_K_M", "Q5_0", "Q5_1", "Q5_K_S",
           "Q5_K_M", "Q6_K", "Q8_0", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS",
           "IQ3_S", "IQ3_M", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4_MOE", "BF16", "F16"]
# "Dynamic" mixes: name -> (base preset, extra llama-quantize flags).
MIXES = {
    "Q4_K_M-pure": ("Q4_K_M", ["--pure"]),
    "Q4_K_M-leave-output": ("Q4_K_M", ["--leave-output-tensor"]),
    "Q3_K_M-out-bf16-embd-iq4nl": ("Q3_K_M", ["--output-tensor-type", "bf16", "--token-embedding-type", "iq4_nl"]),
    "Q4_K_M-out-q8-embd-q8": ("Q4_K_M", ["--output-tensor-type", "q8_0", "--token-embedding-type", "q8_0"]),
    # unsloth-style: low-bit experts, attention and the rest kept high
    "IQ2_XXS-attn-q8-down-q4k": ("IQ2_XXS", ["--tensor-type", "attn=q8_0", "--tensor-type", "ffn_down_exps=q4_k"]),
    "Q4_K_M-exps-iq3s-shexp-q6k": ("Q4_K_M", ["--tensor-type", "exps=iq3_s", "--tensor-type", "shexp=q6_k"]),
    "Q8_0-pure-f16-embd": ("Q8_0", ["--pure", "--token-embedding-type", "f16", "--output-tensor-type", "f16"]),
    # experts of another type in one layer: two expert size classes (the pool's slots, the plan)
    "IQ2_XXS-blk0-exps-q6k": ("IQ2_XXS", ["--tensor-type", r"blk\.0\.ffn_.*_exps=q6_k"]),
    # gate, up and down of one expert in three types
    "Q4_K_M-gate-up-down-differ": ("Q4_K_M", ["--tensor-type", "ffn_gate_exps=q4_k", "--tensor-type",
                                              "ffn_up_exps=q5_k", "--tensor-type", "ffn_down_exps=iq4_xs"]),
}
# llama-quantize refuses these without an importance matrix (and IQ2_M / IQ3_XS / the IQ2 mixes
# are better with one: we give one to every IQ1/IQ2 preset, as the hub's files have).
NEEDS_IMATRIX = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "Q2_K_S"}
BAR = 0.999


def f32_fixtures(fixtures: Path) -> list[str]:
    manifest = json.loads((fixtures / "manifest.json").read_text())
    return [f[: -len("-f32.gguf")] for f, e in manifest["files"].items()
            if e["quant"] == "F32" and (fixtures / f).exists()]


# --make-wide: the fixtures of tools/make_fixtures.py whose layers are not qwen3moe's (which
# q3moe256 covers), with every matmul row a multiple of 256 so that the K, TQ and IQ presets
# quantize them instead of falling back; made in the scratch dir only (MiBs each, never shipped).
W = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, initializer_range=0.05)
WIDE = {  # new name -> (make_fixtures fixture, config changes)
    "gptossw": ("gptossmx", dict(W, intermediate_size=256)),
    "gemma3w": ("gemma3", dict(W, intermediate_size=256, query_pre_attn_scalar=64)),
    "qwen3w": ("qwen3", dict(W, intermediate_size=256)),
    "mixtralw": ("mixtral", dict(W, intermediate_size=256, num_local_experts=4)),
    "qwen2moew": ("qwen2moe", dict(W, intermediate_size=256, num_experts=4, moe_intermediate_size=256,
                                   shared_expert_intermediate_size=256)),
    "glm4moew": ("glm256", {}),
    "qwen3nextw": ("qwen3nextq", dict(W, initializer_range=0.03, intermediate_size=256, num_experts=4, moe_intermediate_size=256,
                                      shared_expert_intermediate_size=256, linear_key_head_dim=64,
                                      linear_value_head_dim=64)),
    "qwen35moew": ("qwen35moe", dict(W, num_experts=4, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                                     linear_key_head_dim=64, linear_value_head_dim=64)),
}


def make_wide(out: Path, llama_cpp: Path, names: list[str]) -> None:
    """(in a Python with torch and transformers) make_fixtures.py's main over the WIDE variants."""
    import dataclasses

    sys.path.insert(0, str(ROOT / "tools"))
    import make_fixtures as mf

    base = {fx.name: fx for fx in mf.FIXTURES}
    wide = []
    for name in names:
        src, change = WIDE[name]
        fx = base[src]
        wide.append(dataclasses.replace(fx, name=name, config=dict(fx.config, **change), quant_types=(),
                                        ship_f32=True))
    mf.FIXTURES[:] = wide
    sys.argv = ["make_fixtures.py", "--out", str(out), "--llama-cpp", str(llama_cpp), "--work",
                str(out / "work")]
    mf.main()


# ----------------------------------------------------------------------------------------------
# llama.cpp side (a child process with a Python that can import the llama_cpp binding)
# ----------------------------------------------------------------------------------------------

def llama_worker(gguf: Path, tokens: Path, out: Path, llama_cpp_root: Path) -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    import make_fixtures as mf

    lc = mf.find_llama_cpp(llama_cpp_root)
    llama_cpp = mf.import_llama_cpp(lc)
    llm = mf.open_llama(llama_cpp, gguf)
    ids = np.load(tokens)
    np.save(out, mf.llama_logits(llm, ids))


def llama_cpp_logits(args, gguf: Path, tokens: np.ndarray) -> np.ndarray:
    tok_path, out = gguf.with_suffix(".tokens.npy"), gguf.with_suffix(".llama.npy")
    np.save(tok_path, tokens.astype(np.int32))
    cmd = [args.llama_python, str(Path(__file__).resolve()), "--llama-worker", str(gguf), str(tok_path), str(out),
           "--llama-cpp", str(args.llama_cpp)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not out.exists():
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"llama.cpp failed on {gguf.name} (exit {r.returncode}): {tail}")
    return np.load(out)


def quantize(args, stem: str, preset: str, base: str, flags: list[str]) -> tuple[Path, str]:
    """llama-quantize the fixture into the scratch dir; returns (path, llama-quantize's notes)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import make_fixtures as mf

    src = args.fixtures_dir / f"{stem}-f32.gguf"
    dst = args.out / f"{stem}-{preset}.gguf"
    flags = list(flags)
    if base in NEEDS_IMATRIX or any(f.split("=")[-1].upper() in NEEDS_IMATRIX for f in flags):
        imatrix = args.out / f"{stem}.imatrix.gguf"
        if not imatrix.exists():
            r = subprocess.run([sys.executable, str(ROOT / "tools" / "make_imatrix.py"), str(src), str(imatrix)],
                               capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
            if r.returncode != 0:
                raise RuntimeError(f"make_imatrix failed: {r.stderr.strip().splitlines()[-1:]}")
        flags += ["--imatrix", str(imatrix)]
    if not dst.exists() or args.requantize:
        lc = mf.find_llama_cpp(args.llama_cpp)
        r = subprocess.run([str(lc.quantize), *flags, str(src), str(dst), base, "2"], capture_output=True, text=True)
        if r.returncode != 0:
            dst.unlink(missing_ok=True)
            tail = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()][-3:]
            raise RuntimeError(f"llama-quantize {base} {' '.join(flags)} failed (exit {r.returncode}): "
                               + " | ".join(tail))
        (dst.with_suffix(".quantize.log")).write_text(r.stdout + r.stderr)
    log = dst.with_suffix(".quantize.log").read_text() if dst.with_suffix(".quantize.log").exists() else ""
    fallbacks = sorted({ln.split("using fallback quantization")[-1].strip() for ln in log.splitlines()
                        if "fallback quantization" in ln})
    return dst, ("fallback " + ",".join(fallbacks)) if fallbacks else ""


# ----------------------------------------------------------------------------------------------
# onebit side (a child process per file, so a crash in one backend is one row, not the sweep)
# ----------------------------------------------------------------------------------------------

def check_file(gguf: Path, tokens_path: Path, llama_path: Path, backends: list[str]) -> dict:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tools")]
    import onebit
    from onebit.backends import BACKENDS
    from oracle_figures import cosine

    tokens = np.load(tokens_path).astype(np.int64)
    ll = np.load(llama_path)
    res: dict = {"backends": {}}
    models = {}
    if "vulkan" in backends:
        from onebit.backends.vulkan.backend import VulkanBackend

        BACKENDS["vulkan"] = VulkanBackend  # lavapipe too
    for be in backends:
        row = res["backends"][be] = {}
        try:
            m = onebit.load(gguf, backend=be)
            if be == "vulkan":
                moved = sorted({f"{t.type_name}->{m.be.tensors[n].type_name}" for n, t in m.gguf.tensors.items()
                                if n in m.be.tensors and m.be.tensors[n].type_name != t.type_name})
                if moved:
                    row["dequantized_at_load"] = moved
            logits = m.net.forward(tokens, m.new_cache())
            c = cosine(logits, ll)
            row.update(min_cos=float(np.nanmin(c)), in_bar=int((c >= BAR).sum()), n=len(c),
                       finite=bool(np.isfinite(logits).all()))
            models[be] = m
        except Exception as e:  # noqa: BLE001 - the sweep records every failure
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            row["traceback"] = traceback.format_exc()[-2000:]
    if "numpy" in backends:  # every file: the model is exact enough to show decode errors a plain run hides
        try:
            from llamacpp_numerics import LlamaCppRoundingBackend

            m = onebit.load(gguf, backend="numpy")
            m.net.be = LlamaCppRoundingBackend(m.gguf)
            c = cosine(m.net.forward(tokens, m.new_cache()), ll)
            res["rounded"] = dict(min_cos=float(np.nanmin(c)), in_bar=int((c >= BAR).sum()), n=len(c))
            if res["rounded"]["in_bar"] < 0.95 * len(c):  # is the model chaotic? nudge x by 2 ulp before rounding
                import llamacpp_numerics as ln

                a = m.net.forward(tokens, m.new_cache())
                orig = ln.round_activation
                ln.round_activation = lambda x, q: orig((x * np.float32(1 + 2**-22)).astype(np.float32), q)
                try:
                    c = cosine(a, m.net.forward(tokens, m.new_cache()))
                finally:
                    ln.round_activation = orig
                res["nudged"] = dict(min_cos=float(np.nanmin(c)), in_bar=int((c >= BAR).sum()), n=len(c))
        except Exception as e:  # noqa: BLE001
            res["rounded"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    # streamed experts (the fewest slots the plan allows) == resident, bit for bit, per backend
    for be in [b for b in backends if b in models and b != "numpy" and models[b].cfg.n_experts]:
        from onebit.errors import UsageError

        k = models[be].cfg.n_experts_used
        want = models[be].net.forward(tokens, models[be].new_cache())
        for slots in (k, 2 * k, 3 * k, 4 * k):
            try:
                m = onebit.load(gguf, backend=be, slots=slots, budget="1GiB")
            except UsageError as e:
                if "below the minimum" in str(e):
                    continue
                res.setdefault("streamed", {})[be] = f"error: {e}"[:200]
                break
            except Exception as e:  # noqa: BLE001
                res.setdefault("streamed", {})[be] = f"error: {type(e).__name__}: {e}"[:200]
                break
            try:
                got = m.net.forward(tokens, m.new_cache())
                d = float(np.abs(got - want).max())
                res.setdefault("streamed", {})[be] = "same" if d == 0 else f"DIFFER max|d| {d:.3g} (slots {slots})"
            except Exception as e:  # noqa: BLE001
                res.setdefault("streamed", {})[be] = f"error: {type(e).__name__}: {e}"[:200]
            finally:
                m.close()
            break
    if "numpy" in models and "vulkan" in models:
        from conftest import greedy_tokens

        try:
            a = greedy_tokens(models["numpy"], tokens[:6], 6)
            b = greedy_tokens(models["vulkan"], tokens[:6], 6)
            res["greedy_same"], res["greedy"] = a == b, [a, b]
        except Exception as e:  # noqa: BLE001
            res["greedy_error"] = f"{type(e).__name__}: {e}"[:300]
    for m in models.values():
        m.close()
    return res


def run_check(args, gguf: Path, tokens: np.ndarray, ll: np.ndarray) -> dict:
    tok_path, ll_path = gguf.with_suffix(".tokens.npy"), gguf.with_suffix(".llama.npy")
    np.save(tok_path, tokens.astype(np.int32))
    np.save(ll_path, ll)
    out = gguf.with_suffix(".check.json")
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--check", str(gguf), str(tok_path), str(ll_path),
           str(out), "--backends", args.backends]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if r.returncode != 0 or not out.exists():
        tail = [ln for ln in r.stderr.splitlines() if ln.strip()][-1:] or ["(no output)"]
        return {"crash": f"exit {r.returncode}: {tail[0][:300]}"}
    return json.loads(out.read_text())


def cli_ok(gguf: Path) -> tuple[dict, str]:
    """`onebit info --json` (its per-type tensor counts) and `onebit plan`: errors as text."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    errs = []
    types = {}
    r = subprocess.run([sys.executable, "-m", "onebit.cli.main", "info", "--json", str(gguf)], capture_output=True,
                       text=True, env=env, cwd=ROOT)
    if r.returncode != 0:
        errs.append(f"info exit {r.returncode}: {r.stderr.strip()[:200]}")
    else:
        types = {t: v["tensors"] for t, v in json.loads(r.stdout)["types"].items()}
    r = subprocess.run([sys.executable, "-m", "onebit.cli.main", "plan", "--backend", "numpy", str(gguf)],
                       capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode != 0:
        errs.append(f"plan exit {r.returncode}: {r.stderr.strip()[:200]}")
    return types, "; ".join(errs)


def tensor_types(path: Path) -> dict[str, str]:
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


# ----------------------------------------------------------------------------------------------

def sweep(args) -> list[dict]:
    rows = []
    fixtures = args.fixtures.split(",") if args.fixtures else f32_fixtures(args.fixtures_dir)
    presets = args.presets.split(",") if args.presets else PRESETS + list(MIXES)
    args.out.mkdir(parents=True, exist_ok=True)
    for stem in fixtures:
        tokens = np.load(args.fixtures_dir / f"{stem}-f32.ref.npz")["tokens"].astype(np.int64)
        seen: dict[str, str] = {}
        for preset in presets:
            base, flags = MIXES.get(preset, (preset, []))
            row = {"file": stem, "preset": preset, "flags": " ".join(flags)}
            rows.append(row)
            t0 = time.time()
            try:
                path, notes = quantize(args, stem, preset, base, flags)
                row["notes"] = notes
                key = json.dumps(sorted(tensor_types(path).items()))
                row["types"], row["cli_error"] = cli_ok(path)
                ll = llama_cpp_logits(args, path, tokens)
                row["llama_finite"] = bool(np.isfinite(ll).all())
                if args.dedupe and key in seen:
                    row["same_types_as"] = seen[key]
                else:
                    seen.setdefault(key, preset)
                    row.update(run_check(args, path, tokens, ll))
            except RuntimeError as e:
                row["error"] = str(e)
            row["seconds"] = round(time.time() - t0, 1)
            print(summary_line(row), flush=True)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=1))
    return rows


def fmt_backend(b: dict) -> str:
    if "error" in b:
        return "ERROR " + b["error"][:80]
    s = f"{b['min_cos']:.5f} {b['in_bar']}/{b['n']}"
    if not b.get("finite", True):
        s += " non-finite"
    if b.get("dequantized_at_load"):
        s += " (F32 at load: " + ",".join(b["dequantized_at_load"]) + ")"
    return s


def verdict(row: dict, backends: list[str]) -> str:
    """ok | explained (below the bar, but the numpy run with llama.cpp's activation rounding
    modelled meets it) | same types as PRESET | FAIL: what failed."""
    if "error" in row:
        return "FAIL: " + row["error"]
    if "crash" in row:
        return "FAIL: crash " + row["crash"]
    if "same_types_as" in row:
        return "same types as " + row["same_types_as"]
    bad, below = [], []
    for be in backends:
        b = row.get("backends", {}).get(be, {})
        if "error" in b:
            bad.append(f"{be} error")
        elif b.get("in_bar", 0) < 0.95 * b.get("n", 1):
            below.append(be)
    rd = row.get("rounded", {})
    rounded_ok = bool(rd) and "error" not in rd and rd["in_bar"] >= 0.95 * rd["n"]
    nd = row.get("nudged", {})
    chaotic = bool(nd) and nd["in_bar"] < 0.95 * nd["n"]
    if "error" in rd:
        bad.append("rounded error")
    elif rd and not rounded_ok and not chaotic:
        bad.append("rounded below bar")
    if below and not rounded_ok and not chaotic:
        bad.append("below bar: " + ",".join(below))
    if row.get("greedy_same") is False:
        bad.append("greedy numpy != vulkan")
    if row.get("greedy_error"):
        bad.append("greedy error")
    for be, v in row.get("streamed", {}).items():
        if v != "same":
            bad.append(f"{be} streamed: {v}")
    if row.get("cli_error"):
        bad.append("cli: " + row["cli_error"])
    if not row.get("llama_finite", True):
        bad.append("llama.cpp non-finite")
    if bad:
        return "FAIL: " + "; ".join(bad)
    if chaotic:
        return (f"chaotic ({','.join(below)} below bar; rounded {rd['in_bar']}/{rd['n']}, and the rounded run "
                f"against itself with x nudged 2 ulp {nd['in_bar']}/{nd['n']})")
    return f"explained ({','.join(below)} below bar)" if below else "ok"


def summary_line(row: dict) -> str:
    parts = [f"{row['file']:10s} {row['preset']:28s}"]
    if "error" in row:
        return parts[0] + " ERROR " + row["error"]
    for be, b in row.get("backends", {}).items():
        parts.append(f"{be}: {fmt_backend(b)}")
    if "rounded" in row:
        r = row["rounded"]
        parts.append("rounded: " + (r["error"] if "error" in r else f"{r['min_cos']:.5f} {r['in_bar']}/{r['n']}"))
    if row.get("streamed"):
        parts.append("streamed: " + " ".join(f"{be}:{x}" for be, x in row["streamed"].items()))
    if row.get("greedy_same") is False:
        parts.append("GREEDY DIFFER")
    if row.get("cli_error"):
        parts.append("CLI " + row["cli_error"])
    if "crash" in row:
        parts.append("CRASH " + row["crash"])
    if "same_types_as" in row:
        parts.append("same types as " + row["same_types_as"])
    parts.append(f"[{row.get('seconds')}s]")
    return "  ".join(parts)


def summary(rows: list[dict], backends: list[str]) -> str:
    kinds = [verdict(r, backends).split(" ")[0].rstrip(":") for r in rows]
    lines = [f"{len(rows)} files: " + ", ".join(f"{kinds.count(k)} {k}" for k in ("ok", "explained", "chaotic", "same", "FAIL"))
             + " (explained: below the bar, the rounding model meets it; chaotic: the rounding model misses "
             "it too, and so does the rounding model against itself with its input nudged by 2 ulp; same: the "
             "tensor types of an earlier preset of that fixture, --dedupe)."]
    lines += [f"- FAIL {r['file']} {r['preset']}: {verdict(r, backends)[6:]}" for r in rows
              if verdict(r, backends).startswith("FAIL")]
    return "\n".join(lines)


def write_table(rows: list[dict], backends: list[str], path: Path, command: str) -> None:
    lines = ["# Quant sweep: llama-quantize presets of every f32 fixture, onebit vs llama.cpp", "",
             "Made by:", "", "```", command, "```", "",
             f"Per backend: the smallest per-position cosine of onebit's logits against llama.cpp's on the "
             f"same file (48 reference tokens) and the positions at cosine >= {BAR} (the bar: >= 95%). "
             "`rounded`: numpy with llama.cpp's activation rounding modelled (tests/llamacpp_numerics.py), "
             "on every file. `streamed`: MoE files loaded again with the fewest expert slots the plan "
             "allows, logits == resident bit for bit. `greedy`: 6 greedy tokens numpy == vulkan. "
             "`types`: `onebit info` tensors per type (llama-quantize falls back where rows do not divide "
             "the block).", "",
             summary(rows, backends), "",
             "| file | preset | types | " + " | ".join(backends) + " | rounded | greedy | streamed | verdict |",
             "|---|---|---|" + "---|" * len(backends) + "---|---|---|---|"]
    for r in rows:
        types = " ".join(f"{t}:{n}" for t, n in r.get("types", {}).items())
        cells = [fmt_backend(r["backends"][be]) if be in r.get("backends", {}) else "" for be in backends]
        rd = r.get("rounded", {})
        rounded = rd.get("error", "")[:60] if "error" in rd else (f"{rd['min_cos']:.5f} {rd['in_bar']}/{rd['n']}"
                                                                 if rd else "")
        greedy = {True: "same", False: "DIFFER"}.get(r.get("greedy_same"), r.get("greedy_error", ""))
        v = verdict(r, backends)
        streamed = " ".join(f"{be}:{x}" for be, x in r.get("streamed", {}).items())
        lines.append(f"| {r['file']} | {r['preset']} | {types} | " + " | ".join(cells)
                     + f" | {rounded} | {greedy} | {streamed} | {v.replace('|', '/')} |")
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-cpp", type=Path, default=Path("/work/deps"),
                    help="where tools/build_llama_cpp.sh put llama.cpp (as make_fixtures.py --llama-cpp)")
    ap.add_argument("--llama-python", default="/work/deps/venv/bin/python",
                    help="a Python that can import the llama_cpp binding (needs numpy, diskcache)")
    ap.add_argument("--fixtures", default="", help="fixture stems (default: every f32 fixture), e.g. q3moe256,llama")
    ap.add_argument("--fixtures-dir", type=Path, default=FIXTURES,
                    help="where the f32 fixtures and their manifest are (default tests/fixtures; "
                         "--make-wide's output dir for the wide ones)")
    ap.add_argument("--make-wide", type=Path, metavar="DIR",
                    help="make the wide (256-row) variants of the fixtures in DIR through make_fixtures.py "
                         "(runs it with --llama-python, which has torch) and stop")
    ap.add_argument("--wide", default=",".join(WIDE), help="which wide variants --make-wide makes")
    ap.add_argument("--presets", default="", help="presets and mix names (default: all), e.g. Q4_K_M,IQ2_M")
    ap.add_argument("--backends", default="numpy,cpu,vulkan")
    ap.add_argument("--out", type=Path, default=Path("/tmp/sweep"), help="scratch dir for the quantized files")
    ap.add_argument("--requantize", action="store_true", help="quantize again even if the file is there")
    ap.add_argument("--dedupe", action="store_true",
                    help="run onebit once per distinct tensor-type map of a fixture (llama.cpp still runs)")
    ap.add_argument("--table", type=Path, help="write the markdown table here")
    ap.add_argument("--command", help="the command(s) to name in the table (default: this one)")
    ap.add_argument("--json", type=Path, help="write every row (with tracebacks) here as it goes")
    ap.add_argument("--from-json", type=Path, nargs="+", metavar="JSON",
                    help="run nothing: make --table from these --json files (later rows win)")
    ap.add_argument("--llama-worker", nargs=3, type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--check", nargs=4, type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--in-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_wide:
        if "--in-child" in sys.argv:
            make_wide(args.make_wide, args.llama_cpp, args.wide.split(","))
            return 0
        cmd = [args.llama_python, str(Path(__file__).resolve()), "--make-wide", str(args.make_wide), "--wide",
               args.wide, "--llama-cpp", str(args.llama_cpp), "--in-child"]
        return subprocess.run(cmd, env=dict(os.environ, ONEBIT_PYTHON=sys.executable)).returncode
    if args.llama_worker:
        llama_worker(*args.llama_worker, args.llama_cpp)
        return 0
    if args.check:
        gguf, tokens, ll, out = args.check
        out.write_text(json.dumps(check_file(gguf, tokens, ll, args.backends.split(","))))
        return 0
    if args.from_json:  # a table from earlier runs' --json files (a later row of a file and preset wins)
        merged: dict = {}
        for f in args.from_json:
            for r in json.loads(f.read_text()):
                merged[(r["file"], r["preset"])] = r
        rows = list(merged.values())
    else:
        rows = sweep(args)
    backends = args.backends.split(",")
    if args.table:
        write_table(rows, backends, args.table, args.command or "python tools/sweep_quants.py " + " ".join(sys.argv[1:]))
    print(summary(rows, backends))
    return 0


if __name__ == "__main__":
    sys.exit(main())
