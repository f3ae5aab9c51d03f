"""onebit's chat-template renderer against HF transformers' on the real templates model
publishers ship (llama.cpp's collection, copied into tests/templates/): the same text for
every conversation in tests/fixtures/template_refs.json, and a TemplateError wherever
transformers' renderer raised (a template that refuses a system message or a non-alternating
history). The references are made by tools/make_template_refs.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import onebit.chat_formats.chat_template as ct
from onebit.errors import TemplateError

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))
from make_template_refs import FixedDatetime  # noqa: E402  the date both renderers see

REFS = json.loads((HERE / "fixtures" / "template_refs.json").read_text(encoding="utf-8"))
TEMPLATES = sorted({c["template"] for c in REFS["cases"]})


def test_the_references_cover_the_collection():
    assert len(TEMPLATES) >= 70 and all((HERE / "templates" / t).is_file() for t in TEMPLATES)
    rendered = sum("text" in c for c in REFS["cases"])
    assert rendered >= 0.9 * len(REFS["cases"])  # most conversations render; a few are refused


@pytest.mark.parametrize("template", TEMPLATES)
def test_renders_as_transformers(monkeypatch, template):
    monkeypatch.setattr(ct, "datetime", FixedDatetime)
    tpl = (HERE / "templates" / template).read_text(encoding="utf-8")
    for case in (c for c in REFS["cases"] if c["template"] == template):
        messages = json.loads(json.dumps(REFS["conversations"][case["conversation"]]))
        what = f"{template}, conversation {case['conversation']}, add_generation_prompt={case['add_generation_prompt']}"

        def render():
            return ct.render_chat(tpl, messages, add_generation_prompt=case["add_generation_prompt"],
                                  bos_token=REFS["bos_token"], eos_token=REFS["eos_token"], source=template)

        if "error" in case:
            with pytest.raises(TemplateError):
                render()
        else:
            assert render() == case["text"], what
