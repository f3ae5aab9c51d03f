"""`generate --input F --output F` is refused before anything runs; a `--device` that names no
device is exit 2 whatever Vulkan finds."""

from __future__ import annotations

import json

import pytest

from conftest import fixture_path, run_cli

MODEL = str(fixture_path("qwen3moe-f32.gguf"))


def test_output_that_is_the_input_is_refused(tmp_path, monkeypatch, capsys):
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"id": f"p{i}", "prompt": "hi"}) + "\n" for i in range(2)))
    before = jsonl.read_bytes()
    link = tmp_path / "link.jsonl"
    link.symlink_to(jsonl)
    for out in (jsonl, link):
        code, _, err = run_cli(monkeypatch, capsys, "generate", "--model", MODEL, "--backend", "numpy", "-n", "1",
                               "--input", str(jsonl), "--output", str(out))
        assert code == 2 and "is the --input file" in err, err
    assert jsonl.read_bytes() == before


@pytest.mark.parametrize("found", ["no devices", "no loader"])
def test_a_device_that_names_nothing_is_exit_2_without_vulkan(monkeypatch, capsys, found):
    from onebit.backends.vulkan import backend as vk
    from onebit.backends.vulkan.device import VulkanUnavailableError

    def list_devices():
        if found == "no loader":
            raise VulkanUnavailableError("Vulkan is not available here (no loader)")
        return []

    monkeypatch.setattr(vk, "list_devices", list_devices)
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--model", MODEL, "-p", "hi", "-n", "1", "--device", "99")
    assert code == 2 and "warning" not in err, err
