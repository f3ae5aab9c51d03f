"""Drive `onebit chat` in a real terminal (tmux): ask, interrupt, /stats, /reset, /quit."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid

import pytest

from conftest import fixture_path

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")


class Term:
    def __init__(self, cmd: list[str]):
        self.name = f"onebit-{uuid.uuid4().hex[:8]}"
        shell_cmd = " ".join(cmd) + "; echo EXITED $?; sleep 30"
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", "160", "-y", "50", shell_cmd], check=True)

    def screen(self) -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name, "-S", "-200"], capture_output=True,
                              text=True).stdout

    def send(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def wait_for(self, predicate, timeout=90.0) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            s = self.screen()
            if predicate(s):
                return s
            time.sleep(0.1)
        raise AssertionError(f"timed out; screen:\n{self.screen()}")

    def prompts(self, s: str) -> int:
        return sum(1 for line in s.splitlines() if line.startswith("> ") or line.rstrip() == ">")

    def at_prompt(self, n: int):
        """The n-th input prompt is on screen and is the last non-empty line."""
        def ok(s):
            lines = [ln for ln in s.splitlines() if ln.strip()]
            return self.prompts(s) >= n and lines and lines[-1].strip() == ">"
        return ok

    def kill(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


def test_chat_session_in_tmux():
    model = fixture_path("q3moe256-Q4_K_M.gguf")  # numpy dequantizes per token: replies slow enough to interrupt
    t = Term([sys.executable, "-m", "onebit.cli.main", "chat", str(model), "--max-tokens", "300", "--temp", "0.8",
              "--seed", "1", "--backend", "numpy"])
    try:
        s = t.wait_for(t.at_prompt(1))
        assert "onebit chat" in s and "/help" in s
        t.send("What does json.dumps do?", "Enter")
        s = t.wait_for(t.at_prompt(2))
        t.send("And json.loads?", "Enter")
        s = t.wait_for(t.at_prompt(3))
        t.send("Tell me a very long story about the os module", "Enter")
        time.sleep(1.0)
        t.send("C-c")
        s = t.wait_for(lambda s: "(reply stopped)" in s)
        s = t.wait_for(t.at_prompt(4))
        t.send("/stats", "Enter")
        s = t.wait_for(lambda s: "decode:" in s and "finish: interrupted" in s)
        assert "tok/s" in s and "from cache" in s
        t.send("/reset", "Enter")
        t.wait_for(lambda s: "(conversation cleared)" in s)
        t.send("/quit", "Enter")
        s = t.wait_for(lambda s: "EXITED" in s)
        assert "EXITED 0" in s and "Traceback" not in s
    finally:
        t.kill()


@pytest.mark.kernels_of(fixture_path("qwen3moe-f32.gguf"))  # (for the `onebit chat` it starts)
def test_chat_ctrl_c_twice_at_prompt_exits():
    t = Term([sys.executable, "-m", "onebit.cli.main", "chat", str(fixture_path("qwen3moe-f32.gguf"))])
    try:
        t.wait_for(t.at_prompt(1))
        t.send("C-c")
        t.wait_for(lambda s: "Ctrl-C again" in s)
        t.send("C-c")
        s = t.wait_for(lambda s: "EXITED" in s)
        assert "EXITED 0" in s and "Traceback" not in s
    finally:
        t.kill()
