"""Tool calls: how a model writes one, reading them back out of a reply, forcing one.

Tools reach the model through its chat template (the template renders `tools` and the
earlier turns' `tool_calls` and `role: tool` results). Two ways of writing a call are read:

- `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen3, Qwen3.5, GLM,
  Hermes and most templates that mention `<tool_call>`; also the fallback for others);
- gpt-oss harmony: a message addressed `to=functions.NAME` on the commentary channel, its
  JSON arguments after `<|message|>`, ended by `<|call|>`.

A call that does not parse stays in the reply as text. `tool_choice: required` (or a named
function) is a grammar over the same syntax, so the reply is a call whatever the model.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Optional

from .harmony import is_harmony
from .structured import json_rule, lark_grammar, literal

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it
    id: str = ""

    def __post_init__(self):
        if not self.id:
            self.id = "call_" + secrets.token_hex(12)

    def to_openai(self, index: Optional[int] = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


def tool_format(model) -> str:
    """'harmony' (gpt-oss) or 'tags' (<tool_call> blocks)."""
    return "harmony" if is_harmony(model) else "tags"


def _call_from_json(text: str) -> Optional[ToolCall]:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


def parse_tags(text: str) -> tuple[str, list[ToolCall]]:
    """(text left, calls) of a reply with <tool_call> blocks. Only when every block parses
    are they taken out; otherwise the reply is all text. A last block cut off before its
    closing tag (max_tokens) is text too."""
    if OPEN not in text:
        return text, []
    calls = []
    for m in _BLOCK.finditer(text):
        call = _call_from_json(m.group(1).strip())
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    rest = _BLOCK.sub("", text)
    if OPEN in rest:  # an unclosed block
        return text, []
    return rest.strip(), calls


_HARMONY_CALL = re.compile(
    r"to=functions\.([A-Za-z0-9_.\-]+)[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>(.*?)(?=<\|call\|>|<\|end\|>|<\|start\|>|$)",
    re.S)


def parse_harmony(raw: str) -> list[ToolCall]:
    """Calls in a raw harmony reply (markers included); each is a message to functions.NAME."""
    calls = []
    for m in _HARMONY_CALL.finditer(raw):
        args = m.group(2).strip()
        try:
            obj = json.loads(args)
        except ValueError:
            return []
        if not isinstance(obj, dict):
            return []
        calls.append(ToolCall(m.group(1), json.dumps(obj, ensure_ascii=False)))
    return calls


def check_tools(tools: list[dict]) -> dict[str, dict]:
    """name -> parameters schema of OpenAI-style tools ({type: function, function: {name,
    parameters}}); raises ValueError with what is wrong."""
    out = {}
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        out[name] = params
    return out


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with references to its own root ("#", "#/properties/...") pointing under `base`
    (references into the definitions, which move to the new root, stay as they are)."""
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#") and not v.startswith(("#/$defs/", "#/definitions/")):
            out[k] = base + v[1:]
        else:
            out[k] = _rebased(v, base)
    return out


def forced_grammar(model, tools: dict[str, dict]) -> str:
    """A grammar whose every sentence is one call of one of `tools` (name -> parameters), in
    the model's own syntax."""
    tok = model.tokenizer
    if tool_format(model) == "harmony":
        alts = [f'"commentary to=functions.{name} " {literal(tok, "<|constrain|>")} "json" '
                f'{literal(tok, "<|message|>")} {json_rule(params)}' for name, params in tools.items()]
        body = "\n    | ".join(alts)
        return lark_grammar(f'start: {literal(tok, "<|channel|>")} call\ncall: {body}\n')
    alts = []
    for name, params in tools.items():
        # the parameters sit under /properties/arguments: their definitions move to the root,
        # where their references ("#/$defs/City", as pydantic writes them) still find them
        params = dict(params)
        defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
        schema = {"type": "object", "properties": {"name": {"const": name},
                                                   "arguments": _rebased(params, "#/properties/arguments")},
                  "required": ["name", "arguments"], "additionalProperties": False, **defs}
        alts.append(json_rule(schema))
    body = "\n    | ".join(alts)
    return lark_grammar(f'start: {literal(tok, OPEN)} "\\n" call "\\n" {literal(tok, CLOSE)}\ncall: {body}\n')
