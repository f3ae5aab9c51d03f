"""Tools for a model whose chat template cannot show them (llama-server's generic tool-call
format): the tool definitions and how to call one go into the system message, earlier calls
and their results into the messages as `<tool_call>` / `<tool_response>` text, and the reply is
read back as `<tool_call>` blocks (toolcall.parse_tags) like a Hermes-style model's."""

from __future__ import annotations

import json

from ..chat_formats.toolcall import CLOSE, OPEN
from ..errors import OnebitError

PROBE = "onebit_probe_tool_7f3a"  # a tool name no template writes unless it shows the tools
_known: dict[str, bool] = {}  # template text -> whether it shows tools


def template_shows_tools(model) -> bool:
    """Whether the model's chat template writes the tools it is given (found by rendering one
    probe tool, as minja's capability check does)."""
    template = model.chat_template or model.fallback_template
    if template not in _known:
        probe = [{"type": "function", "function": {"name": PROBE, "description": "", "parameters": {
            "type": "object", "properties": {}}}}]
        try:
            text = model.apply_chat_template([{"role": "user", "content": "x"}], tools=probe)
        except OnebitError:
            text = ""
        _known[template] = PROBE in text
    return _known[template]


def instructions(tools: list[dict]) -> str:
    """The system message's part that shows the tools and how to call one."""
    defs = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    return ("You can call functions. Their definitions (JSON schemas):\n<tools>\n" + defs + "\n</tools>\n"
            "To call one, reply with only this, for each call:\n" + OPEN +
            '\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n' + CLOSE +
            "\nA function's result comes back in a <tool_response> block. When no call is needed, reply as usual.")


def generic_tool_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """`messages` with the tools in the system message, and tool calls and results as text."""
    out: list[dict] = []
    for m in messages:
        d = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id", "name")}
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [OPEN + "\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                              ensure_ascii=False) + "\n" + CLOSE for c in m["tool_calls"]]
            d["content"] = "\n".join(([m["content"]] if m.get("content") else []) + calls)
        elif m["role"] == "tool":
            d = {"role": "user", "content": "<tool_response>\n" + (m.get("content") or "") + "\n</tool_response>"}
        if out and d["role"] == "user" and out[-1]["role"] == "user":  # (templates that want turns to alternate)
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + d["content"]}
        else:
            out.append(d)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + instructions(tools)}
    else:
        out.insert(0, {"role": "system", "content": instructions(tools)})
    return out


__all__ = ["generic_tool_messages", "instructions", "template_shows_tools"]
