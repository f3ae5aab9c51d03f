"""The chat page at `/` in a real headless browser: Debian's `chromium`, driven over the DevTools
protocol (a websocket). The test starts the server, types a message, sends it, and checks that
the reply streams in (several updates) and equals the API's own reply, with tokens per second
shown."""

from __future__ import annotations

import itertools
import json
import re
import shutil
import signal
import subprocess
import time
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
ws_client = pytest.importorskip("websockets.sync.client")

from test_serve import DEFAULT, start  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WAIT_S = 120  # bounds on loops (hang guards), never asserted as timings

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt install chromium)")


class Page:
    """One browser tab over the DevTools protocol: `evaluate` runs JavaScript and returns its value."""

    def __init__(self, ws):
        self.ws = ws
        self.ids = itertools.count(1)

    def send(self, method: str, **params):
        i = next(self.ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=WAIT_S))
            if msg.get("id") == i:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def evaluate(self, js: str):
        r = self.send("Runtime.evaluate", expression=js, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise AssertionError(f"{js}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, js: str, what: str):
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            value = self.evaluate(js)
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"the page never showed {what}")


@pytest.fixture
def browser(tmp_path):
    proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                             "--disable-extensions", "--remote-debugging-port=0", f"--user-data-dir={tmp_path / 'profile'}",
                             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and port is None:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                break
            m = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            port = int(m.group(1)) if m else None
        assert port, "chromium did not start its DevTools endpoint"
        targets = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30).read())
        ws_url = next(t for t in targets if t["type"] == "page")["webSocketDebuggerUrl"]
        with ws_client.connect(ws_url, max_size=None, open_timeout=30) as ws:
            yield Page(ws)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_chat_page_streams_a_reply(tmp_path, browser):
    proc, url = start([DEFAULT, "--backend", "numpy", "--ctx", "512"], tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        want = client.chat.completions.create(
            model="default", max_tokens=12, temperature=0,
            messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}])
        browser.send("Page.enable")
        browser.send("Page.navigate", url=url + "/")
        browser.wait("document.readyState === 'complete' && document.getElementById('model').textContent",
                     "the model's name")
        assert browser.evaluate("document.getElementById('model').textContent") == "default"
        # count the reply's updates as they land (a streamed reply changes the text several times)
        browser.evaluate("""
            window.updates = 0;
            new MutationObserver(() => { window.updates += 1; })
              .observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true});
            document.getElementById('temperature').value = '0';
            document.getElementById('max_tokens').value = '12';
            document.getElementById('system').value = 'You are terse.';
            const box = document.getElementById('input');
            box.focus();
            true""")
        browser.send("Input.insertText", text="Hello there")  # typed, as a user would
        browser.send("Input.dispatchKeyEvent", type="keyDown", key="Enter", code="Enter", windowsVirtualKeyCode=13)
        browser.send("Input.dispatchKeyEvent", type="keyUp", key="Enter", code="Enter", windowsVirtualKeyCode=13)
        stats = browser.wait("document.getElementById('stats').textContent", "the reply's statistics")
        assert re.match(r"12 tokens, [\d.]+ tokens/s", stats), stats
        reply = browser.evaluate("document.querySelector('.msg.assistant').textContent")
        assert reply == want.choices[0].message.content
        assert browser.evaluate("document.querySelector('.msg.user').textContent") == "Hello there"
        assert browser.evaluate("window.updates") > 3  # the reply came in pieces
        assert browser.evaluate("document.getElementById('send').disabled") is False
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
