"""`onebit serve --parallel N` under load, against llama-server `-np N` on the same GGUF:
requests per second, tokens per second in total, and time to first token (median, p95) at
1 / 4 / 16 concurrent clients, through the real `openai` client (streamed chat completions).

Both servers are started once on free loopback ports (onebit: `--parallel N`, with --budget
where given; llama-server: `-np N -c ctx*N`, so each slot holds --ctx, its own chat template,
--threads as onebit's) and stay up, so memory holds both models: leave --llama-server out to
measure onebit alone (a file that needs the machine's memory, e.g. one streamed at a budget).
For each round and client count C, each server in turn (onebit first on even rounds,
llama-server first on odd ones) gets --requests requests from C threads that share them
(each thread sends its share back to back): distinct prompts (a short question with a number
in it; the chat template is the shared prefix), greedy, --max-tokens each with the
end-of-generation tokens banned (`logit_bias`, and llama-server's `ignore_eos`), so every reply
is that long. Time to first token runs from sending to the first streamed text; tokens are the
usage's completion tokens (else the text chunks streamed). Medians over rounds; the ratios
(onebit at 4 clients over onebit at 1 client, the same requests one after another; onebit over
llama-server at each client count) are medians of the per-round ratios.

    python bench/bench_serve.py --model M.gguf [--llama-server PATH] [--parallel 4] [--budget 8GiB]
        [--backend cpu] [--ctx 1024] [--clients 1 4 16] [--requests 16] [--max-tokens 32] [--rounds 5]
        [--threads N]
"""

from __future__ import annotations

import argparse
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
START_S = 900  # a first cpu-backend run compiles its kernels; a large file loads


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    """Until GET /health answers 200 (both servers answer 503 while they load)."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server did not start:\n{log_path.read_text()[-4000:]}")


def start_onebit(args, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "onebit.cli.main", "serve", args.model, "--backend", args.backend, "--ctx",
           str(args.ctx), "--parallel", str(args.parallel), "--port", str(port), "-q"]
    if args.budget:
        cmd += ["--budget", args.budget]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    return launch(cmd, port, log_path)


def start_llama(args, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port), "-np",
           str(args.parallel), "-c", str(args.ctx * args.parallel), "--jinja", "--no-webui"]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    return launch(cmd, port, log_path)


def launch(cmd: list[str], port: int, log_path: Path) -> tuple[subprocess.Popen, str]:
    """Start a server's command, its output to log_path; (process, its URL) once it answers."""
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url, log_path)
    return proc, url


def one_request(client, prompt: str, max_tokens: int, ban: dict) -> tuple[float, float, int]:
    """(time to first token, total time, completion tokens) of one streamed request."""
    t0 = time.perf_counter()
    first, usage, chunks = None, None, 0
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True, logit_bias=ban,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices:
            d = chunk.choices[0].delta
            if d.content or getattr(d, "reasoning_content", None):
                chunks += 1
                if first is None:
                    first = time.perf_counter() - t0
        if chunk.usage is not None:
            usage = chunk.usage
    total = time.perf_counter() - t0
    return (first if first is not None else total), total, usage.completion_tokens if usage else chunks


def run_level(client, clients: int, per_client: int, max_tokens: int, ban: dict, offset: int):
    results, errors = [], []

    def worker(c: int):
        for k in range(per_client):
            n = offset + c * per_client + k
            try:
                results.append(one_request(client, f"Question {n}: what is {n} times {n % 7 + 2}?", max_tokens,
                                           ban))
            except Exception as e:  # noqa: BLE001 - counted and shown
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [r[0] for r in results] or [float("nan")]
    return {"rps": len(results) / wall, "tps": sum(r[2] for r in results) / wall,
            "ttft50": statistics.median(ttft), "ttft95": pct(ttft, 0.95), "n": len(results), "errors": len(errors)}


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "onebit" / "data" / "default.gguf"))
    ap.add_argument("--llama-server", help="llama-server binary (tools/build_llama_cpp.sh); none: onebit only")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--parallel", type=int, default=4, help="slots of each server (onebit --parallel, llama -np)")
    ap.add_argument("--budget", help="onebit serve --budget (e.g. 8GiB: a file larger than that streams)")
    ap.add_argument("--threads", type=int, help="compute threads of each server (default: theirs)")
    ap.add_argument("--ctx", type=int, default=1024, help="context per slot")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=16, help="requests per client count, server and round")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import openai

    from onebit.formats.gguf_file import GGUFFile
    from onebit.formats.tokenizer import Tokenizer

    # (the tokenizer from the file's header only: no weights in this process beside the servers')
    ban = {str(t): -100 for t in Tokenizer.from_metadata(GGUFFile(args.model).metadata, args.model).stop_ids}
    tmp = tempfile.TemporaryDirectory()
    procs, urls = [], {}
    rows: dict[tuple[str, int], list[dict]] = {}
    try:
        proc, urls["onebit"] = start_onebit(args, Path(tmp.name) / "onebit.log")
        procs.append(proc)
        if args.llama_server:
            proc, urls["llama-server"] = start_llama(args, Path(tmp.name) / "llama.log")
            procs.append(proc)
        clients = {name: openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=1800)
                   for name, url in urls.items()}
        for client in clients.values():
            one_request(client, "warm up", 4, ban)
        offset = 0
        for rnd in range(args.rounds):
            for c in args.clients:
                order = list(clients) if rnd % 2 == 0 else list(clients)[::-1]  # alternating: ABBA...
                per_client = max(1, args.requests // c)
                for name in order:
                    rows.setdefault((name, c), []).append(run_level(clients[name], c, per_client, args.max_tokens,
                                                                    ban, offset))
                offset += c * per_client  # (both servers get the same prompts at a level)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        tmp.cleanup()
    report(args, rows)


def report(args, rows: dict) -> None:
    print(f"model {Path(args.model).name}; onebit serve --backend {args.backend} --parallel {args.parallel}"
          + (f" --budget {args.budget}" if args.budget else "")
          + (f" against llama-server -np {args.parallel}" if args.llama_server else "")
          + f"; --ctx {args.ctx} per slot; {args.max_tokens} tokens per reply (end-of-generation tokens banned), "
            f"greedy, streamed through the openai client; {args.requests} requests per client count; "
            f"{args.rounds} rounds, servers alternating; medians over rounds [min-max]")
    print()
    print("| server | clients | requests | errors | req/s | tok/s | TTFT median s | TTFT p95 s |")
    print("|---|---|---|---|---|---|---|---|")
    med = lambda rs, k: statistics.median([r[k] for r in rs])  # noqa: E731
    for (name, c), rs in rows.items():
        tps = [r["tps"] for r in rs]
        print(f"| {name} | {c} | {rs[0]['n']} | {sum(r['errors'] for r in rs)} | {med(rs, 'rps'):.2f} | "
              f"{med(rs, 'tps'):.1f} [{min(tps):.1f}-{max(tps):.1f}] | {med(rs, 'ttft50'):.3f} | "
              f"{med(rs, 'ttft95'):.3f} |")
    print()

    def ratio(a, b) -> str:
        if a not in rows or b not in rows:
            return "n/a"
        return f"{statistics.median([x['tps'] / y['tps'] for x, y in zip(rows[a], rows[b])]):.2f}"

    print(f"onebit tok/s at 4 clients over onebit at 1 client (one after another): "
          f"{ratio(('onebit', 4), ('onebit', 1))}")
    for c in args.clients:
        print(f"onebit tok/s over llama-server -np {args.parallel} at {c} clients: "
              f"{ratio(('onebit', c), ('llama-server', c))}")


if __name__ == "__main__":
    main()
