"""`onebit serve` under load: requests per second and time to first token at 1 / 4 / 16
concurrent clients, through the real `openai` client (streamed chat completions).

Starts `onebit serve` on a free loopback port (or uses --url), then for each client count C
runs C threads that share --requests requests (each thread sends its share back to back) (distinct prompts:
a short question with a number in it; the chat template is the shared prefix), greedy,
--max-tokens each with the end-of-generation tokens banned (every reply is exactly that
long). Time to first token is measured from sending to the first streamed content; a
request's whole time from sending to its last chunk. The server runs one request at a time,
so TTFT grows with the queue: at C clients a request waits for about C-1 others.

    python bench/bench_serve.py [--model M.gguf] [--backend cpu] [--clients 1 4 16]
        [--requests 16] [--max-tokens 32] [--rounds 5] [--url http://127.0.0.1:8080]
"""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start_server(model: str, backend: str, ctx: int, log_path: Path) -> tuple[subprocess.Popen, str]:
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "onebit.cli.main", "serve", model, "--backend", backend,
                             "--ctx", str(ctx), "--port", "0", "-q"], stdout=log, stderr=log)
    for _ in range(6000):  # up to 10 minutes (a first cpu-backend run compiles its kernels)
        m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log_path.read_text())
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not start:\n" + log_path.read_text())


def one_request(client, model: str, prompt: str, max_tokens: int, ban: dict) -> tuple[float, float, int]:
    """(time to first token, total time, completion tokens) of one streamed request."""
    t0 = time.perf_counter()
    first = None
    usage = None
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            max_tokens=max_tokens, temperature=0, stream=True, logit_bias=ban,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if first is None and chunk.choices and (chunk.choices[0].delta.content or
                                                getattr(chunk.choices[0].delta, "reasoning_content", None)):
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            usage = chunk.usage
    total = time.perf_counter() - t0
    return (first if first is not None else total), total, usage.completion_tokens if usage else 0


def run_level(client, model: str, clients: int, per_client: int, max_tokens: int, ban: dict, offset: int):
    results, errors = [], []

    def worker(c: int):
        for k in range(per_client):
            n = offset + c * per_client + k
            try:
                results.append(one_request(client, model, f"Question {n}: what is {n} times {n % 7 + 2}?",
                                           max_tokens, ban))
            except Exception as e:  # noqa: BLE001 - counted and shown
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return results, errors, wall


class Direct:
    """The same requests through Model.generate in this process, one after another: the
    engine without the server (and without a client), as the baseline."""

    def __init__(self, model_path: str, backend: str, ctx: int):
        import onebit
        from onebit.apps.serve import penalties

        self.m = onebit.load(model_path, backend=backend, n_ctx=ctx)
        self.ban = penalties(0, 0, {t: -100 for t in self.m.tokenizer.stop_ids})
        self.run(0, 1, 4)  # warm up (lookup decoding: 8 drafts, as `onebit serve` without $ONEBIT_LOOKUP)

    def run(self, offset: int, n: int, max_tokens: int) -> tuple[float, float]:
        """(requests/s, median time to first token)."""
        ttft = []
        t0 = time.perf_counter()
        for k in range(offset, offset + n):
            t1 = time.perf_counter()
            msgs = [{"role": "user", "content": f"Question {k}: what is {k} times {k % 7 + 2}?"}]
            for i, _ in enumerate(self.m.generate(msgs, max_tokens=max_tokens, processors=[self.ban])):  # lookup as serve
                if i == 0:
                    ttft.append(time.perf_counter() - t1)
        return n / (time.perf_counter() - t0), statistics.median(ttft)


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "onebit" / "data" / "default.gguf"))
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=16, help="requests per client count and round")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--url", help="use a running server instead of starting one")
    args = ap.parse_args()

    import openai

    direct = None if args.url else Direct(args.model, args.backend, args.ctx)
    ban = {str(t): -100 for t in (direct.m if direct else __import__("onebit").load(args.model, backend="numpy"))
           .tokenizer.stop_ids}  # every reply is max_tokens long
    proc = None
    tmp = tempfile.TemporaryDirectory()
    if args.url is None:
        proc, url = start_server(args.model, args.backend, args.ctx, Path(tmp.name) / "server.log")
    else:
        url = args.url.rstrip("/")
    rows: dict[str, list] = {}
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        one_request(client, model, "warm up", 4, ban)
        offset = 0
        for rnd in range(args.rounds):  # engine alone, then the server at each client count; repeated
            if direct is not None:
                rps, ttft = direct.run(offset, args.requests, args.max_tokens)
                offset += args.requests
                rows.setdefault("engine alone", []).append((rps, ttft, ttft, 0, args.requests, 0))
            for c in args.clients:
                per_client = max(1, args.requests // c)
                results, errors, wall = run_level(client, model, c, per_client, args.max_tokens, ban, offset)
                offset += c * per_client
                ttft = [r[0] for r in results]
                rows.setdefault(c, []).append((len(results) / wall, statistics.median(ttft), pct(ttft, 0.9),
                                               sum(r[2] for r in results) / wall, len(results), len(errors)))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        tmp.cleanup()
    print(f"model {Path(args.model).name}, backend {args.backend}, {args.max_tokens} tokens per reply "
          f"(end-of-generation tokens banned), greedy; server: streamed through the openai client, "
          f"{args.requests} requests per client count; {args.rounds} rounds (engine alone, 1, 4, 16 "
          f"clients, in turn), medians over rounds [min-max]")
    print()
    print("| clients | requests/round | errors | req/s | x engine alone | tok/s | TTFT median s | TTFT p90 s |")
    print("|---|---|---|---|---|---|---|---|")
    base = [r[0] for r in rows.get("engine alone", [])]
    for key, rs in rows.items():
        rps = [r[0] for r in rs]
        ratio = "" if not base or key == "engine alone" else \
            f"{statistics.median([a / b for a, b in zip(rps, base)]):.2f}"
        tok = "" if key == "engine alone" else f"{statistics.median([r[3] for r in rs]):.0f}"
        print(f"| {key} | {rs[0][4]} | {sum(r[5] for r in rs)} | {statistics.median(rps):.2f} "
              f"[{min(rps):.2f}-{max(rps):.2f}] | {ratio} | {tok} | {statistics.median([r[1] for r in rs]):.3f} | "
              f"{statistics.median([r[2] for r in rs]):.3f} |")


if __name__ == "__main__":
    main()
