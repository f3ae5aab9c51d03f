#!/usr/bin/env python3
"""Record HF transformers' renderings of real chat templates: the reference for
tests/test_template_refs.py, which holds onebit's renderer (onebit/chat_formats/chat_template.py) to them.

Usage (the fixture venv, which has transformers):
    /work/deps/venv/bin/python tools/make_template_refs.py \
        --templates /work/deps/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates

Copies every `*.jinja` there (llama.cpp's collection of the templates model publishers ship)
into tests/templates/ unchanged, and renders each with transformers'
`render_jinja_template` (what `tokenizer.apply_chat_template(..., tokenize=False)` runs) for
the conversations in CONVERSATIONS, with and without the generation prompt, writing
tests/fixtures/template_refs.json: per (template, conversation, add_generation_prompt) the text,
or the error when the template refuses the conversation (some require alternating roles or
reject a system message). `strftime_now` is pinned to DATE on both sides so that templates
that print today's date compare.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_TEMPLATES = ROOT / "tests" / "templates"
OUT_REFS = ROOT / "tests" / "fixtures" / "template_refs.json"

DATE = dt.datetime(2026, 12, 1, 9, 30, 0)
BOS, EOS = "<s>", "</s>"

# What a chat or a batch prompt sends: one turn, a system message, a history with a reply,
# text outside ASCII. Conversations a template refuses are recorded as errors.
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"}],
    [{"role": "user", "content": "Grüße, 世界 — \"quote\" <b>&amp;</b>\n\nTwo lines."},
     {"role": "assistant", "content": "Ça va? 🙂"}],
]


class FixedDatetime(dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return DATE if tz is None else DATE.replace(tzinfo=tz)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--templates", type=Path, required=True, help="a folder of .jinja chat templates")
    args = ap.parse_args()

    import transformers
    from transformers.utils import chat_template_utils as ctu

    ctu.datetime = FixedDatetime  # strftime_now reads the module's datetime
    paths = sorted(args.templates.glob("*.jinja"))
    if not paths:
        raise SystemExit(f"no .jinja files in {args.templates}")
    OUT_TEMPLATES.mkdir(parents=True, exist_ok=True)
    cases = []
    for path in paths:
        shutil.copyfile(path, OUT_TEMPLATES / path.name)
        tpl = path.read_text(encoding="utf-8")
        for i, conv in enumerate(CONVERSATIONS):
            for gen in (True, False):
                case = {"template": path.name, "conversation": i, "add_generation_prompt": gen}
                try:
                    case["text"] = ctu.render_jinja_template(
                        [json.loads(json.dumps(conv))], chat_template=tpl, add_generation_prompt=gen,
                        bos_token=BOS, eos_token=EOS)[0][0]
                except Exception as e:  # the template refused this conversation
                    case["error"] = f"{type(e).__name__}: {e}"
                cases.append(case)
    OUT_REFS.write_text(json.dumps({
        "source": f"transformers {transformers.__version__} render_jinja_template; templates from {args.templates}",
        "date": DATE.isoformat(), "bos_token": BOS, "eos_token": EOS,
        "conversations": CONVERSATIONS, "cases": cases,
    }, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    n_err = sum("error" in c for c in cases)
    print(f"{len(paths)} templates, {len(cases)} cases ({n_err} refused by their template) -> {OUT_REFS}")


if __name__ == "__main__":
    main()
