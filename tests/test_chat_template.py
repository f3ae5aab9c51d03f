"""Chat templates render like HF transformers, and a hostile template gives one TemplateError."""

from __future__ import annotations

import pytest

from onebit.chat_formats.chat_template import CHATML_TEMPLATE, render_chat
from onebit.errors import OnebitError, TemplateError
from onebit.formats.gguf_file import read_metadata

from conftest import fixture_path

MESSAGES = [
    {"role": "system", "content": "Be brief. ü"},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "And now?"},
]
CHATML = (
    "<|im_start|>system\nBe brief. ü<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nAnd now?<|im_end|>\n"
)


def test_fixture_template_renders_chatml():
    meta = read_metadata(fixture_path("qwen3moe-f32.gguf"))
    template = meta["tokenizer.chat_template"]
    out = render_chat(template, MESSAGES, source="qwen3moe-f32.gguf")
    assert out == CHATML + "<|im_start|>assistant\n"
    assert render_chat(template, MESSAGES, add_generation_prompt=False) == CHATML


@pytest.mark.parametrize("template", [None, "", "  \n"])
def test_missing_template_falls_back_to_chatml(template):
    assert render_chat(template, MESSAGES) == CHATML + "<|im_start|>assistant\n"
    assert render_chat(CHATML_TEMPLATE, MESSAGES, add_generation_prompt=False) == CHATML


# Llama 3.1-style: bos_token, trim_blocks/lstrip_blocks, loop.first, strip, tojson, tools.
LLAMA3_STYLE = """{{- bos_token }}
{%- if tools is not none %}
    {%- set tool_text = tools | tojson(indent=2) %}
{%- endif %}
{%- for message in messages %}
    {%- if loop.first and message['role'] == 'system' %}
<|start_header_id|>system<|end_header_id|>

{{ message['content'] | trim }}
{%- if tool_text is defined %}

Tools: {{ tool_text }}
{%- endif %}<|eot_id|>
    {%- else %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""


def test_hf_style_template_with_tools():
    tools = [{"name": "météo", "parameters": {"city": "string"}}]
    out = render_chat(LLAMA3_STYLE, MESSAGES[:2], bos_token="<|begin_of_text|>", tools=tools)
    # Expected string: HF transformers' own rendering of this template, checked when written.
    assert out == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief. ü\n"
        'Tools: [\n  {\n    "name": "météo",\n    "parameters": {\n      "city": "string"\n    }\n  }\n]'
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    no_tools = render_chat(LLAMA3_STYLE, MESSAGES[:2], bos_token="<|begin_of_text|>")
    assert "Tools:" not in no_tools


def test_helpers_and_extra_variables():
    tpl = ("{{ strftime_now('%Y') | length }}|{{ {'k': 'ü'} | tojson }}|"
           "{% for i in range(9) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}|"
           "{% generation %}{{ enable_thinking }}{% endgeneration %}|{{ eos_token }}")
    assert render_chat(tpl, [], eos_token="</s>", enable_thinking=False) == '4|{"k": "ü"}|012|False|</s>'


def test_template_cannot_change_the_messages():
    with pytest.raises(TemplateError, match="sandbox"):
        render_chat("{% set _ = messages.append({'role': 'x'}) %}", MESSAGES)
    assert len(MESSAGES) == 4


def test_raise_exception_is_a_template_error():
    tpl = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}"
    with pytest.raises(TemplateError, match=r"^model\.gguf: .*Conversation must start with user"):
        render_chat(tpl, MESSAGES, source="model.gguf")


@pytest.mark.parametrize("tpl", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ joiner.__init__.__globals__['os'] }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ '{0.__class__}'.format('') }}",
    "{{ (raise_exception|attr('__globals__')) }}",
    "{{ namespace.__init__ }}",
])
def test_sandbox_escapes_are_template_errors(tpl):
    with pytest.raises(TemplateError, match=r"^evil\.gguf: .*(sandbox|unsafe)"):
        render_chat(tpl, MESSAGES, source="evil.gguf")


@pytest.mark.parametrize("tpl", [
    "{% for i in range(10**9) %}x{% endfor %}",
    "{{ 'x' * 10**10 }}",
    "{{ [0] * 10**10 }}",
    "{% for i in range(100000) %}{{ 'y' * 100 }}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{{ 'a'.ljust(10**9) }}",
    "{{ 'a' | center(10**9) }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ '%999999999d' % 1 }}",
    "{{ '%999999999d' | format(1) }}",
    "{% set s = 'a' * 100000 %}{{ s.replace('a', s) }}",
    "{{ 'a' | indent(10**9, true) }}",
    "{{ lipsum(10**8) }}",
    "{{ [1] | batch(10**9, 'x') | list }}",
    "{{ [1] | slice(10**9) | list }}",
    "{{ messages | tojson(indent=10**9) }}",
])
def test_runaway_output_is_a_template_error(tpl):
    with pytest.raises(TemplateError, match=r"^big\.gguf: "):
        render_chat(tpl, MESSAGES, source="big.gguf")


def test_endless_loop_is_stopped_by_the_deadline():
    tpl = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with pytest.raises(TemplateError, match=r"^slow\.gguf: .*did not finish within 0\.5 s"):
        render_chat(tpl, MESSAGES, source="slow.gguf", timeout_s=0.5)


def test_output_cap_is_configurable():
    tpl = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert render_chat(tpl, MESSAGES, max_output_chars=100) == "Be brief. üHiHello!And now?"
    with pytest.raises(TemplateError, match="too large"):
        render_chat(tpl, MESSAGES, max_output_chars=5)


@pytest.mark.parametrize("tpl, problem", [
    ("{% for m in messages %}{{ m }}", "syntax error at line 1"),
    ("line one\n{% if %}", "syntax error at line 2"),
    ("{{ messages[0].content | no_such_filter }}", "syntax error"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed too deeply"),
    ("{{ undefined_thing.attr }}", "undefined"),
    ("{{ messages + 1 }}", "TypeError"),
    ("{% include 'other.jinja' %}", "failed"),
])
def test_broken_templates_are_template_errors(tpl, problem):
    with pytest.raises(TemplateError, match=problem) as info:
        render_chat(tpl, MESSAGES, source="broken.gguf")
    assert str(info.value).startswith("broken.gguf: ")
    assert isinstance(info.value, OnebitError) and info.value.exit_code == 2


def test_gemma_file_without_a_template_chats_in_gemma_turns(tmp_path):
    """A Gemma GGUF converted without its chat template (as some hub files are) is rendered in
    Gemma's turns, not ChatML, whose markers its vocabulary lacks."""
    import onebit
    from conftest import fixture_path
    from ggufedit import rewrite
    from onebit.apps.info import format_info, model_info

    path = rewrite(fixture_path("gemma3-f32.gguf"), tmp_path / "g.gguf", drop_meta=("tokenizer.chat_template",))
    m = onebit.load(path, backend="cpu")
    assert m.chat_template is None
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    text = m.apply_chat_template(msgs)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    ids = m.chat_tokens(msgs)
    assert ids[0] == m.tokenizer.bos_id and ids.count(m.tokenizer.bos_id) == 1
    assert m.tokenizer.token_to_id("<start_of_turn>") in ids
    # the file's own template (the fixture carries the same turns) renders the same
    assert onebit.load(fixture_path("gemma3-f32.gguf"), backend="cpu").apply_chat_template(msgs) == text
    assert "no (Gemma turns fallback)" in format_info(model_info(m.gguf, m.cfg))
    llama = rewrite(fixture_path("llama-f32.gguf"), tmp_path / "l.gguf", drop_meta=("tokenizer.chat_template",))
    ml = onebit.load(llama, backend="cpu")
    assert "<|im_start|>user" in ml.apply_chat_template(msgs)
    assert "no (ChatML fallback)" in format_info(model_info(ml.gguf, ml.cfg))
