"""The request fuzzer's short run (tools/fuzz_serve.py) against an in-process server, a load that
stalls then fails mid-switch, and the GGUF fuzzer's value-type mutations (tools/fuzz_gguf.py
--types): every hostile request gets a status below 500 (or 503), and a second client gets the
reply it gets alone throughout."""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import fuzz_gguf  # noqa: E402

pytest.importorskip("fastapi")
import fuzz_serve  # noqa: E402
from test_serve_robust import DEFAULT, Served, ask  # noqa: E402

from onebit.apps import serve_app  # noqa: E402


def test_short_request_fuzz_run(tmp_path, monkeypatch):
    monkeypatch.setattr(serve_app, "MAX_BODY", 1 << 20)  # oversized cases stay small on loopback
    s = Served(tmp_path, head_timeout=2.0)
    errors = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: errors.append(record.getMessage())
    log = logging.getLogger("onebit.apps.serve")
    log.addHandler(handler)
    try:
        res = fuzz_serve.run(s.url, range(60), seed=2026, max_body=1 << 20, log=lambda line: None)
    finally:
        log.removeHandler(handler)
        s.stop()
    assert not errors, errors  # no internal error logged (a client gone mid-body is no bug)
    assert not res["failures"], res["failures"]
    assert res["n_wrong"] == 0 and res["checks"] > 0, res["wrong"]
    assert len(res["kinds"]) >= 10, res["kinds"]


def test_a_load_that_stalls_then_fails_mid_switch(tmp_path, monkeypatch):
    import shutil

    import onebit

    s = Served(tmp_path)
    try:
        shutil.copy(DEFAULT, s.models / "slow.gguf")
        real = onebit.load
        started = threading.Event()

        def load(spec, **kw):
            if str(kw.get("path", "")).endswith("slow.gguf"):
                started.set()
                time.sleep(1.0)
                raise MemoryError()  # killed mid-load, as the machine ran out
            return real(spec, **kw)

        monkeypatch.setattr(onebit, "load", load)
        got = {}
        t = threading.Thread(target=lambda: got.update(slow=ask(s, "slow")))
        t.start()
        assert started.wait(60)
        other = ask(s)  # queued behind the stalled switch, then served by the model reloaded
        t.join(60)
        assert got["slow"][0] == 400 and got["slow"][1]["error"]["code"] == "model_load_failed", got
        assert other[0] == 200 and other[1]["model"] == "main", other
    finally:
        s.stop()


def test_value_type_mutations_fail_cleanly():
    res = fuzz_gguf.run(range(40), seed=7, fixtures=["qwen3moe-f32", "q3moe256-Q4_K_M"], log=lambda line: None,
                        types=True)
    assert res["counts"]["fail"] == 0, res["failures"][:5]
    assert res["counts"]["error"] > 20, res["counts"]
