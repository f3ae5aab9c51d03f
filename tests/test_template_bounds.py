"""Chat templates render in a bounded worker process (issue 36): the memory and C-level time
bombs the sandbox's growth caps cannot see are stopped with one line naming the file and the
limit; the worker survives for the next turn (one process for many renders) or is replaced."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import fixture_path
from onebit.chat_formats import chat_template as ct
from onebit.chat_formats.chat_template import render_chat
from onebit.errors import TemplateError

MESSAGES = [{"role": "user", "content": "Hi"}]
B = "{% set b = 'x' * 1000000 %}"

# The examples, verbatim in shape: each one a single C-level call (or a short loop of
# them) that took gigabytes or minutes while every growth cap passed.
BOMBS = {
    "sum": "{% set l = [0]*1000000 %}{{ ([l]*1000)|sum(start=[])|length }}",
    "join filter": B + "{{ ([b]*5000)|join }}",
    "str.join": B + "{{ ''.join([b]*5000) }}",
    "~ doubling": "{% set ns = namespace(s='x'*1000000) %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                  "{% endfor %}{{ ns.s|length }}",
    "format": B + "{{ ('%s'*1000)|format(*([b]*1000)) }}",
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_memory_bombs_stop_at_the_render_limit(name):
    with pytest.raises(TemplateError) as info:
        render_chat(BOMBS[name], MESSAGES, source="bomb.gguf")
    msg = str(info.value)
    assert msg.startswith("bomb.gguf: ") and f"more than {ct.RENDER_MEMORY >> 20} MB of memory" in msg, msg
    assert "\n" not in msg
    assert render_chat(None, MESSAGES) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_a_long_c_level_call_is_stopped_by_the_wall_clock_limit():
    # One `sum` of a million 210 KB integers: about 40 s of CPU inside one C call, with almost no
    # memory. A deadline checked between Python steps cannot fire inside it (and, the call holding
    # the GIL, the caller could not even return); the worker is killed at the limit instead. The
    # caller's own CPU time shows the work did not run in it (no wall-clock measure).
    tpl = "{% set a = 7 ** 600000 %}{{ ([a] * 1000000)|sum % 10 }}"
    before = ct._WORKER.started
    cpu = time.process_time()
    with pytest.raises(TemplateError, match=r"^slow\.gguf: the chat template did not finish within 0\.5 s \(the limit"):
        render_chat(tpl, MESSAGES, source="slow.gguf", timeout_s=0.5)
    assert time.process_time() - cpu < 5.0
    assert render_chat(None, MESSAGES).startswith("<|im_start|>user")  # a fresh worker
    assert ct._WORKER.started == before + 1


def test_one_worker_serves_many_turns():
    render_chat(None, MESSAGES)
    before = ct._WORKER.started
    for i in range(30):
        msgs = MESSAGES + [{"role": "assistant", "content": "x" * i}, {"role": "user", "content": "again"}]
        assert render_chat(None, msgs).count("<|im_start|>") == 4
    with pytest.raises(TemplateError, match="refused these messages: no"):
        render_chat("{{ raise_exception('no') }}", MESSAGES)
    assert render_chat(None, MESSAGES)
    assert ct._WORKER.started == before  # errors the template raises keep the worker


def test_an_interrupt_during_a_render_leaves_no_half_read_reply():
    tpl = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    # Ctrl-C as a terminal gives it, to the thread waiting on the render (os.kill may pick another
    # thread, a kernel's or the timer's, and the wait would not wake), with Python's default
    # handler, the signal not blocked (an earlier test in the same worker may have left either)
    timer = threading.Timer(0.3, signal.pthread_kill, (threading.get_ident(), signal.SIGINT))
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            render_chat(tpl, MESSAGES, timeout_s=30)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, before)
        if signal.SIGINT in blocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    assert ct._WORKER.proc is None  # stopped, not left rendering
    assert render_chat(None, MESSAGES).startswith("<|im_start|>user")


def test_unpicklable_messages_are_a_template_error():
    with pytest.raises(TemplateError, match="cannot be passed to the chat template"):
        render_chat(None, [{"role": "user", "content": lambda: 0}], source="m.gguf")


def test_cli_bomb_template_is_one_line_exit_2(tmp_path):
    from ggufedit import rewrite

    path = rewrite(fixture_path("qwen3moe-f32.gguf"), tmp_path / "bomb.gguf",
                   meta={"tokenizer.chat_template": BOMBS["join filter"]})
    r = subprocess.run([sys.executable, "-m", "onebit.cli.main", "chat", str(path)], input="hello\n",
                       capture_output=True, text=True, timeout=300)
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(err) == 1 and err[0].startswith(f"onebit: error: {path}: the chat template needed more than 256 MB")


def test_a_forked_child_starts_its_own_worker():
    render_chat(None, MESSAGES)
    parent_worker = ct._WORKER.proc.pid
    pid = os.fork()
    if pid == 0:  # the child renders through a worker of its own, leaving the parent's alone
        ok = False
        try:
            ok = render_chat(None, MESSAGES).startswith("<|im_start|>") and ct._WORKER.proc.pid != parent_worker
            ct._WORKER.stop()
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert ct._WORKER.proc.pid == parent_worker and render_chat(None, MESSAGES)


def test_a_short_template_fuzz_run_hits_the_bounds_and_never_fails():
    """tools/fuzz_gguf.py's template fuzzer (random compositions of filters and loops), 30
    cases: every case renders or gives one error line naming the file, and some of them reach
    the bounds (the time limit or a growth cap), so the run exercises them."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    import fuzz_gguf

    got = fuzz_gguf.template_run(range(30), seed=3, timeout_s=1.0, log=None)
    assert got["failures"] == [], got["failures"][:3]
    assert got["kinds"].get("time limit", 0) + got["kinds"].get("growth cap", 0) > 0, got["kinds"]
