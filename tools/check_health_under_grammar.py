"""/health while the server compiles hostile structured-output grammars: start `onebit serve`
(the shipped model, cpu) on a loopback port, send each hostile `response_format` schema (a
pattern that explodes, an anyOf of 5,000 branches, a schema that is only a reference to itself)
while another client polls /health every 50 ms, and print each request's status and time and
the worst /health latency meanwhile.

    python tools/check_health_under_grammar.py [--port 18777]
"""
import json, subprocess, sys, threading, time, urllib.request, socket
import argparse
ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--port", type=int, default=18777)
port = ap.parse_args().port
p = subprocess.Popen([sys.executable, "-m", "onebit.cli.main", "serve", "--port", str(port), "--backend", "cpu", "-q"], stderr=subprocess.DEVNULL)
url = f"http://127.0.0.1:{port}"
for _ in range(600):
    try:
        if urllib.request.urlopen(url + "/health", timeout=1).status == 200: break
    except Exception: time.sleep(0.2)
HOSTILE = {
 "pattern": {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}}, "required": ["a"]},
 "anyOf": {"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]} for i in range(5000)]},
 "ref": {"$ref": "#"},
}
def post(schema):
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    t = time.perf_counter()
    try:
        r = urllib.request.urlopen(req, timeout=120); code = r.status
    except urllib.error.HTTPError as e: code = e.code
    return code, time.perf_counter() - t
for name, schema in HOSTILE.items():
    lat, done = [], []
    def poll():
        while not done:
            t = time.perf_counter(); urllib.request.urlopen(url + "/health", timeout=60).read(); lat.append(time.perf_counter() - t); time.sleep(0.05)
    th = threading.Thread(target=poll); th.start()
    code, dt = post(schema); done.append(1); th.join()
    print(f"{name}: request {code} in {dt:.2f} s; /health answered {len(lat)} times meanwhile, worst {max(lat)*1000:.0f} ms, median {sorted(lat)[len(lat)//2]*1000:.1f} ms")
p.terminate(); p.wait(30)
