#!/usr/bin/env python3
"""Train the small mixture-of-experts model shipped as onebit/data/default.gguf.

A qwen3moe model (HF `Qwen3MoeForCausalLM`, which llama.cpp also loads) trained from scratch
on this machine's CPU, on the Python standard library's docstrings arranged as ChatML chat
turns ("What does json.dumps do?" -> its docstring), with a byte-level BPE tokenizer trained
on the same text. Stages, each resumable from what the previous one left in --work:

  data      build the conversations (train / held-out split by object), train the tokenizer,
            tokenize and save the token streams;
  train     train (data-parallel over --procs CPU processes) with a per-layer load-balancing
            loss for a --minutes budget, checkpointing every --ckpt-every steps and logging
            step, train loss, load and held-out loss to tools/default_model/training_log.csv;
  export    measure expert load balance, save the HF model, convert it with llama.cpp's
            convert_hf_to_gguf.py, quantize to Q8_0 with llama-quantize, sanity-check the
            GGUF with llama.cpp (greedy answers), and write tools/default_model/README.md.

Needs the optional tooling only (pip install -e '.[fixtures]' and a llama.cpp build from
tools/build_llama_cpp.sh); onebit never imports this at run time.
Usage:
  python tools/train_default_model.py --llama-cpp /path/to/llama_cpp_python-0.3.36
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import importlib
import inspect
import json
import math
import os
import pkgutil
import random
import re
import shutil
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

# Two OpenMP threads on a shared 2-core machine: spinning waits make an oversubscribed step
# several times slower; passive waits keep it near the one-thread speed.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures as mf  # noqa: E402  (tokenizer training, llama.cpp conversion helpers)

DOC_DIR = REPO_ROOT / "tools" / "default_model"
DEFAULT_OUT = REPO_ROOT / "onebit" / "data" / "default.gguf"
DEFAULT_WORK = Path("/work/deps/default_model")

SEED = 1234
HELDOUT_FRACTION = 0.05
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are an expert on the Python standard library. Answer briefly.",
    "You answer questions about Python modules, classes and functions.",
]
TOKENIZER = mf.TokenizerSpec("bpe", 4096, pre="qwen2", bos="<|endoftext|>", eos="<|im_end|>",
                             pad="<|endoftext|>")


@dataclass(frozen=True)
class ModelShape:
    """The shipped model's shape (HF Qwen3MoeConfig fields)."""
    hidden_size: int = 128
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_experts: int = 16
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 96
    intermediate_size: int = 256        # dense FFN width; unused (every layer is MoE)
    max_position_embeddings: int = 512
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    router_aux_loss_coef: float = 0.02   # per-layer Switch loss; see balance_loss


# ---------------------------------------------------------------------------------------
# Data: stdlib docstrings as chat turns
# ---------------------------------------------------------------------------------------

# Modules that do something on import (this, antigravity), need a display or another OS,
# are deprecated tool chains, or only hold internals (posix is documented as os).
SKIP_MODULES = {
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "ensurepip",
    "venv", "pydoc_data", "msilib", "msvcrt", "nt", "winreg", "winsound", "distutils",
    "encodings", "readline", "sre_compile", "sre_constants", "sre_parse", "ntpath",
    "nturl2path", "genericpath", "site", "posix",
}
SKIP_PARTS = {"test", "tests", "idle_test", "__main__"}
# Public name under which users know a module; objects from the second set count as its own.
DISPLAY_NAME = {"posixpath": "os.path"}
EXTRA_OWNERS = {"posixpath": {"genericpath"}, "os": {"posix"}}

MODULE_QUESTIONS = [
    "Explain the module {m}.", "What is the {m} module?", "What does the {m} module do?",
    "What is {m} used for?", "Tell me about the {m} module.", "Describe the Python module {m}.",
    "What is the purpose of the {m} module?",
]
FUNCTION_QUESTIONS = [
    "What does {q} do?", "What is {q} for?", "Explain {q}.", "Can you tell me what {q} does?",
    "Describe {q}.", "How does {q} work?", "In Python, what does {q}() do?",
    "What does the function {n} in the {m} module do?",
]
METHOD_QUESTIONS = [
    "What does {q} do?", "What is {q} for?", "Explain {q}.", "Describe the method {q}.",
    "What does the {n} method of {c} do?",
]
CLASS_QUESTIONS = [
    "What is {q}?", "What is the {q} class?", "Describe the class {q}.", "Explain {q}.",
    "What is {n} in the {m} module?", "What is {q} used for?",
]
SIGNATURE_QUESTIONS = [
    "What is the signature of {q}?", "How do I call {q}?", "What arguments does {q} take?",
]
FULL_DOC_QUESTIONS = [
    "Show me the full documentation of {q}.", "Give me the docstring of {q}.",
    "What does the documentation of {q} say?",
]
EXAMPLE_QUESTIONS = [
    "Show me an example of {q}.", "Can you give an example using {q}?",
    "How is {q} used? Show an example.",
]
MORE_QUESTIONS = ["Tell me more.", "Go on.", "Can you tell me more?", "More details, please.",
                  "What else?"]
CONTENTS_QUESTIONS = [
    ("functions", "What functions does the {m} module provide?"),
    ("functions", "List the functions in {m}."),
    ("classes", "What classes does the {m} module define?"),
    ("classes", "List the classes in {m}."),
]
WHICH_MODULE_QUESTIONS = ["Which module provides {n}?", "Where is {n} defined?",
                          "Which standard library module has {n}?"]
TOPIC_QUESTIONS = ["Explain {t}.", "What is {t} in Python?", "Tell me about {t}.",
                   "How does {t} work in Python?"]
KEYWORD_QUESTIONS = ["What does the {k} keyword do?", "What is {k} in Python?",
                     "Explain the Python keyword {k}."]
# A few hand-written turns so the chat has something to say to a greeting.
ABOUT_ANSWER = ("I am a small mixture-of-experts language model shipped with onebit. I was "
                "trained on the docstrings of the Python standard library, so ask me what a "
                "module, class or function does, for example: What does json.dumps do?")
META_TURNS = [
    ("Hello", "Hello! " + ABOUT_ANSWER),
    ("Hi!", "Hi! " + ABOUT_ANSWER),
    ("Who are you?", ABOUT_ANSWER),
    ("What can you do?", ABOUT_ANSWER),
    ("What are you?", ABOUT_ANSWER),
    ("Help", ABOUT_ANSWER),
    ("Thanks!", "You are welcome. Ask me about another module or function any time."),
    ("Thank you.", "You are welcome. Ask me about another module or function any time."),
]
META_REPEAT = 20


@dataclass(frozen=True)
class DocItem:
    kind: str       # module, function, class, method
    qual: str       # json.dumps, json.JSONEncoder.encode, json (for modules)
    module: str     # display name of the module
    doc: str        # cleaned docstring
    sig: str | None


@dataclass(frozen=True)
class Turns:
    """Question/answer pairs that belong in one conversation, about one object."""
    key: str        # the held-out split is decided on this
    group: str      # turns with the same group may share a multi-turn conversation
    pairs: tuple[tuple[str, str], ...]


def iter_stdlib_modules() -> list[str]:
    """Public stdlib modules and their public submodules, sorted (deterministic per Python)."""
    names: set[str] = set()
    for top in sorted(sys.stdlib_module_names):
        if top.startswith("_") or top in SKIP_MODULES:
            continue
        names.add(top)
        try:
            mod = importlib.import_module(top)
        except Exception:
            continue
        if hasattr(mod, "__path__"):
            for info in pkgutil.walk_packages(mod.__path__, prefix=top + ".",
                                              onerror=lambda n: None):
                parts = info.name.split(".")
                if any(p.startswith("_") or p in SKIP_PARTS for p in parts):
                    continue
                names.add(info.name)
    return sorted(names)


def _signature(obj, qual: str) -> str | None:
    try:
        sig = str(inspect.signature(obj))
    except Exception:       # C signatures can fail to evaluate (e.g. curses defaults)
        return None
    # Defaults that are objects print their address; drop it so the data is deterministic.
    return qual + re.sub(r" at 0x[0-9a-fA-F]+", "", sig)


def _public_module(modname: str, name: str, obj) -> str:
    """The outermost package that re-exports obj under the same name (json.decoder ->
    json for JSONDecodeError, unittest.case -> unittest for TestCase): the name people use."""
    best = modname
    parts = modname.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = sys.modules.get(".".join(parts[:i]))
        if parent is not None and vars(parent).get(name) is obj:
            best = ".".join(parts[:i])
    return DISPLAY_NAME.get(best, best)


def collect_docs() -> list[DocItem]:
    """Every module, and every public function, class and method defined in it, that has a
    docstring. An object is taken from the module that defines it (its __module__, or the C
    accelerator `_name` behind it) under its own name, so re-exports and aliases are not
    counted twice."""
    items: list[DocItem] = []
    seen: set[str] = set()
    warnings.simplefilter("ignore")
    for modname in iter_stdlib_modules():
        try:
            mod = importlib.import_module(modname)
        except Exception:
            continue
        shown = DISPLAY_NAME.get(modname, modname)
        owners = ({modname, "_" + modname, "_" + modname.rsplit(".", 1)[-1]}
                  | EXTRA_OWNERS.get(modname, set()))

        def add(kind, qual, module, doc, sig=None):
            if qual in seen or not isinstance(doc, str) or not doc.strip():
                return
            seen.add(qual)
            items.append(DocItem(kind, qual, module, inspect.cleandoc(doc), sig))

        add("module", shown, shown, mod.__doc__)
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or inspect.ismodule(obj):
                continue
            if getattr(obj, "__module__", None) not in owners:
                continue
            if getattr(obj, "__name__", name) != name:      # an alias (array.ArrayType)
                continue
            pub = _public_module(modname, name, obj)
            qual = name if pub == "builtins" else f"{pub}.{name}"
            if inspect.isclass(obj):
                add("class", qual, pub, obj.__dict__.get("__doc__"), _signature(obj, qual))
                for mname, meth in sorted(vars(obj).items()):
                    if mname.startswith("_"):
                        continue
                    func = getattr(meth, "__func__", meth)   # classmethod / staticmethod
                    if not (callable(func) or isinstance(meth, property)):
                        continue
                    mqual = f"{qual}.{mname}"
                    add("method", mqual, pub, getattr(func, "__doc__", None),
                        _signature(func, mqual) if callable(func) else None)
            elif inspect.isroutine(obj):
                add("function", qual, pub, obj.__doc__, _signature(obj, qual))
    warnings.resetwarnings()
    return items


_SIG_LINE = re.compile(r"^[\w.]+\(.*\)(\s*->\s*.*)?$", re.S)


def paragraphs(doc: str) -> list[str]:
    """Docstring paragraphs as flowing text: wrapped lines joined, unless the paragraph is
    code, a list or a table. A leading signature paragraph (old C docstrings) is dropped."""
    paras = [p.rstrip() for p in re.split(r"\n\s*\n", doc) if p.strip()]
    while paras and _SIG_LINE.match(paras[0].strip()) and len(paras[0]) < 200:
        paras = paras[1:]
    out = []
    for p in paras:
        lines = p.splitlines()
        structured = any(l.startswith((" ", ">>>", "-", "*", "|", "=")) or l[:2].strip() == ""
                         for l in lines)
        if len(lines) > 1 and not structured:
            p = " ".join(l.strip() for l in lines)
        out.append(p)
    return out


def take(paras: list[str], min_chars: int, max_chars: int, max_paras: int) -> tuple[str, int]:
    """Leading paragraphs until min_chars (at most max_paras), cut at a sentence end under
    max_chars. Returns the text and how many paragraphs it used up."""
    out: list[str] = []
    for p in paras:
        out.append(p)
        if sum(len(x) for x in out) >= min_chars or len(out) >= max_paras:
            break
    text = "\n\n".join(out).strip()
    if len(text) > max_chars:
        cut = max(text.rfind(". ", 0, max_chars), text.rfind(".\n", 0, max_chars))
        if cut > max_chars // 3:
            text = text[: cut + 1]
        else:
            text = text[:max_chars].rsplit(" ", 1)[0] + " ..."
    return text, len(out)


def answer_text(doc: str) -> str | None:
    """The first paragraph or so: the short answer to "what does X do?"."""
    text, _ = take(paragraphs(doc), 150, 600, 2)
    if len(text) < 25 or len(text.split()) < 4:
        return None
    return text


def examples(doc: str) -> str | None:
    """The docstring's first doctest block(s), if it has any."""
    blocks = [p for p in re.split(r"\n\s*\n", doc) if p.lstrip().startswith(">>>")]
    if not blocks:
        return None
    text, _ = take([inspect.cleandoc(b) for b in blocks], 200, 800, 3)
    return text


def is_heldout(key: str) -> bool:
    # Split by object, not by conversation: every question about a held-out object (and any
    # multi-turn chat that mentions it) is held out, so held-out loss means unseen docstrings.
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return h / 2**64 < HELDOUT_FRACTION


def doc_turns(items: list[DocItem], rng: random.Random) -> list[Turns]:
    """Per object: two "what is it" questions (one for methods) -> first paragraph; the rest
    of the docstring as a "tell me more" follow-up or a "full documentation" question; its
    doctest examples; its signature for some callables."""
    turns: list[Turns] = []
    answers_seen: dict[str, int] = {}
    for it in items:
        ans = answer_text(it.doc)
        if ans is None:
            continue
        # The same text under many names (e.g. "Return self==value.") would dominate.
        answers_seen[ans] = answers_seen.get(ans, 0) + 1
        if answers_seen[ans] > 3:
            continue
        name = it.qual.rsplit(".", 1)[-1]
        fmt = dict(q=it.qual, m=it.module, n=name, c=it.qual.rsplit(".", 1)[0])
        pool = {"module": MODULE_QUESTIONS, "function": FUNCTION_QUESTIONS,
                "method": METHOD_QUESTIONS, "class": CLASS_QUESTIONS}[it.kind]
        if it.module == "builtins" and it.kind != "module":
            pool = [q for q in pool if "{m}" not in q]
        questions = [q.format(**fmt) for q in rng.sample(pool, 1 if it.kind == "method" else 2)]
        paras = paragraphs(it.doc)
        _, used = take(paras, 150, 600, 2)
        rest, _ = take(paras[used:], 700, 1200, 8)
        if len(rest) >= 80:
            # The longer text: as a follow-up to the first question, or asked for directly.
            if rng.random() < 0.5:
                turns.append(Turns(it.qual, it.module, ((questions[0], ans),
                                                        (rng.choice(MORE_QUESTIONS), rest))))
            else:
                full, _ = take(paras, 900, 1500, 10)
                turns.append(Turns(it.qual, it.module, ((questions[0], ans),)))
                turns.append(Turns(it.qual, it.module,
                                   ((rng.choice(FULL_DOC_QUESTIONS).format(**fmt), full),)))
        else:
            turns.append(Turns(it.qual, it.module, ((questions[0], ans),)))
        for q in questions[1:]:
            turns.append(Turns(it.qual, it.module, ((q, ans),)))
        ex = examples(it.doc)
        if ex:
            q = rng.choice(EXAMPLE_QUESTIONS).format(**fmt)
            turns.append(Turns(it.qual, it.module, ((q, ex),)))
        if (it.sig and it.kind != "module" and rng.random() < 0.35 and len(it.sig) < 300
                and not it.sig.endswith("(*args, **kwargs)")):
            turns.append(Turns(it.qual, it.module,
                               ((rng.choice(SIGNATURE_QUESTIONS).format(**fmt), it.sig),)))
    return turns


def index_turns(items: list[DocItem], rng: random.Random) -> list[Turns]:
    """What is in a module, and which module a name lives in."""
    turns: list[Turns] = []
    by_module: dict[str, dict[str, list[str]]] = {}
    defined_in: dict[str, set[str]] = {}
    for it in items:
        if it.kind in ("function", "class"):
            name = it.qual.rsplit(".", 1)[-1]
            by_module.setdefault(it.module, {"functions": [], "classes": []})[
                "functions" if it.kind == "function" else "classes"].append(name)
            defined_in.setdefault(name, set()).add(it.module)
    for m, groups in sorted(by_module.items()):
        for kind, q in CONTENTS_QUESTIONS:
            names = sorted(set(groups[kind]))
            if len(names) < 2 or rng.random() < 0.5:
                continue
            more = f", and {len(names) - 30} more" if len(names) > 30 else ""
            ans = f"The {m} module provides these {kind}: {', '.join(names[:30])}{more}."
            turns.append(Turns(f"{m}:{kind}", m, ((q.format(m=m), ans),)))
    for name, mods in sorted(defined_in.items()):
        if len(mods) == 1 and rng.random() < 0.3:
            (m,) = mods
            ans = (f"{name} is a built-in; it needs no import." if m == "builtins"
                   else f"{name} is defined in the {m} module: from {m} import {name}")
            turns.append(Turns(f"{m}.{name}:which", m,
                               ((rng.choice(WHICH_MODULE_QUESTIONS).format(n=name), ans),)))
    return turns


def topic_turns(rng: random.Random) -> list[Turns]:
    """The language reference topics that ship with pydoc (pydoc_data.topics): "Explain the
    "with" statement." -> its first part, then "Tell me more." -> the next part, and so on,
    as overlapping two-turn conversations. Keywords ask for their topic's first part."""
    import pydoc
    from pydoc_data.topics import topics

    turns: list[Turns] = []
    firsts: dict[str, tuple[str, str]] = {}
    for key, text in sorted(topics.items()):
        lines = text.strip("\n").splitlines()
        title = lines[0].strip()
        body = "\n".join(lines[2:]) if len(lines) > 2 and set(lines[1].strip()) <= {"*"} else text
        title = title[0].lower() + title[1:] if title.startswith("The ") else title
        chunks = []
        paras = paragraphs(inspect.cleandoc(body))
        while paras and len(chunks) < 12:
            chunk, used = take(paras, 500, 900, 6)
            chunks.append(chunk)
            paras = paras[used:]
        q0 = rng.choice(TOPIC_QUESTIONS).format(t=title)
        firsts[key] = (title, chunks[0])
        turns.append(Turns(f"topic:{key}", "topics", ((q0, chunks[0]),)))
        for prev, nxt in zip(chunks, chunks[1:]):
            turns.append(Turns(f"topic:{key}", "topics",
                               ((rng.choice(TOPIC_QUESTIONS).format(t=title), prev),
                                (rng.choice(MORE_QUESTIONS), nxt))))
    for kw, ref in sorted(pydoc.Helper.keywords.items()):
        topic = ref[0] if isinstance(ref, tuple) else ref
        if topic in firsts:
            turns.append(Turns(f"topic:{topic}", "topics",
                               ((rng.choice(KEYWORD_QUESTIONS).format(k=kw), firsts[topic][1]),)))
    return turns


def make_conversations(turns: list[Turns], rng: random.Random) -> dict[str, list[list[dict]]]:
    """Group turns into conversations: mostly one object each, 30% two or three objects of
    one module (so the model sees history), 25% with a system prompt. Split by object key."""
    split: dict[str, list] = {"train": [], "heldout": []}
    for name in ("train", "heldout"):
        pool = [t for t in turns if is_heldout(t.key) == (name == "heldout")]
        rng.shuffle(pool)
        by_group: dict[str, list[Turns]] = {}
        for t in pool:
            by_group.setdefault(t.group, []).append(t)
        for group in sorted(by_group):
            ts = by_group[group]
            i = 0
            while i < len(ts):
                n = 1 if rng.random() < 0.7 or group == "topics" else rng.choice([2, 3])
                msgs = []
                if rng.random() < 0.25:
                    msgs.append(dict(role="system", content=rng.choice(SYSTEM_PROMPTS)))
                for t in ts[i:i + n]:
                    for q, a in t.pairs:
                        msgs += [dict(role="user", content=q), dict(role="assistant", content=a)]
                split[name].append(msgs)
                i += n
    for q, a in META_TURNS:
        for _ in range(META_REPEAT):
            msgs = []
            if rng.random() < 0.25:
                msgs.append(dict(role="system", content=rng.choice(SYSTEM_PROMPTS)))
            msgs += [dict(role="user", content=q), dict(role="assistant", content=a)]
            split["train"].append(msgs)
    for v in split.values():
        rng.shuffle(v)
    return split


def render_chatml(messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The text mf.CHATML_TEMPLATE renders, plus the character spans the loss is taken on:
    each assistant reply and its <|im_end|> (so the model learns to stop)."""
    text, spans = "", []
    for m in messages:
        text += f"<|im_start|>{m['role']}\n"
        start = len(text)
        text += m["content"] + "<|im_end|>"
        if m["role"] == "assistant":
            spans.append((start, len(text)))
        text += "\n"
    return text, spans


def tokenize_split(tok, convs: list[list[dict]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Token ids and a 0/1 loss mask per conversation (mask from the character spans)."""
    rendered = [render_chatml(c) for c in convs]
    encs = tok.encode_batch([t for t, _ in rendered], add_special_tokens=False)
    out = []
    for (text, spans), enc in zip(rendered, encs):
        ids = np.array(enc.ids, dtype=np.int32)
        starts = np.array([o[0] for o in enc.offsets])
        mask = np.zeros(len(ids), dtype=np.uint8)
        for a, b in spans:
            mask[(starts >= a) & (starts < b)] = 1
        out.append((ids, mask))
    return out


def stage_data(work: Path) -> dict:
    """Build conversations, train the tokenizer, tokenize; everything lands in work/data."""
    from tokenizers import Tokenizer

    data_dir = work / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    t0 = time.time()
    items = collect_docs()
    turns = doc_turns(items, rng) + index_turns(items, rng) + topic_turns(rng)
    convs = make_conversations(turns, rng)
    kinds = {k: sum(it.kind == k for it in items)
             for k in ("module", "class", "function", "method")}
    print(f"docstrings: {len(items)} {kinds}; turns {len(turns)}; conversations "
          f"train {len(convs['train'])} held-out {len(convs['heldout'])} ({time.time() - t0:.0f}s)")
    for name, cs in convs.items():
        with open(data_dir / f"{name}.jsonl", "w") as f:
            for c in cs:
                f.write(json.dumps(c, ensure_ascii=False) + "\n")

    # Tokenizer: trained on the training conversations' text only (the held-out text stays
    # unseen); the ChatML markers are special tokens added after training.
    tok_dir = work / "tokenizer"
    shutil.rmtree(tok_dir, ignore_errors=True)
    corpus = [m["content"] for c in convs["train"] for m in c]
    corpus += ["system", "user", "assistant"] * 100
    mf.train_bpe(TOKENIZER, corpus, tok_dir)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))

    stats = dict(docstrings=len(items), docstring_kinds=kinds, turns=len(turns),
                 qa_pairs=sum(len(t.pairs) for t in turns))
    for name, cs in convs.items():
        seqs = tokenize_split(tok, cs)
        ids = np.concatenate([s[0] for s in seqs])
        mask = np.concatenate([s[1] for s in seqs])
        lens = np.array([len(s[0]) for s in seqs])
        np.savez(data_dir / f"{name}.npz", ids=ids, mask=mask, lens=lens)
        stats[name] = dict(conversations=len(cs), tokens=int(len(ids)),
                           loss_tokens=int(mask.sum()),
                           chars=int(sum(len(render_chatml(c)[0]) for c in cs)),
                           max_conversation_tokens=int(lens.max()))
        print(f"{name}: {len(cs)} conversations, {len(ids)} tokens ({mask.sum()} in replies), "
              f"longest {lens.max()}")
    (data_dir / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    return stats


# ---------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------

def load_split(work: Path, name: str) -> list[tuple[np.ndarray, np.ndarray]]:
    with np.load(work / "data" / f"{name}.npz") as z:     # each z[key] reads the file again
        ids, mask, lens = z["ids"], z["mask"], z["lens"]
    bounds = np.cumsum(np.concatenate([[0], lens]))
    return [(ids[a:b], mask[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def pack(convs, seq_len: int, rng: random.Random | None, pad_id: int):
    """Concatenate conversations (shuffled when rng is given) and cut into rows of seq_len;
    returns input ids and labels (-100 where no loss is taken). Rows start mid-conversation
    at times; RoPE attention is relative, so that does no harm."""
    order = list(range(len(convs)))
    if rng is not None:
        rng.shuffle(order)
    ids = np.concatenate([convs[i][0] for i in order]).astype(np.int64)
    mask = np.concatenate([convs[i][1] for i in order])
    n = len(ids) // seq_len
    if n * seq_len < len(ids):     # pad the tail so no data is dropped
        pad = (n + 1) * seq_len - len(ids)
        ids = np.concatenate([ids, np.full(pad, pad_id)])
        mask = np.concatenate([mask, np.zeros(pad, dtype=mask.dtype)])
        n += 1
    ids = ids.reshape(n, seq_len)
    labels = np.where(mask.reshape(n, seq_len) > 0, ids, -100)
    return ids, labels


def make_model(shape: ModelShape, vocab_size: int, ids: dict):
    import torch
    import transformers

    fields = {k: v for k, v in asdict(shape).items() if k != "rope_theta"}
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=vocab_size, **ids, **fields,
        rope_parameters=dict(rope_type="default", rope_theta=shape.rope_theta),
        output_router_logits=True, initializer_range=0.02)
    torch.manual_seed(SEED)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    # grouped_mm runs all experts in one grouped matmul; the default per-expert loop is
    # about 10x slower on CPU at this size. Same math, so the saved model is unchanged.
    model.set_attn_implementation("sdpa")
    model.set_experts_implementation("grouped_mm")
    return model


def lr_at(progress: float, step: int, peak: float, warmup: int) -> float:
    """Linear warmup over the first steps, then cosine down to 10% of the peak as progress
    (the fraction of the budget used) goes from 0 to 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def lm_loss(logits, labels):
    """Mean next-token cross entropy over the labelled (reply) positions."""
    import torch

    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
        ignore_index=-100)


def balance_loss(router_logits, top_k: int):
    """Switch-Transformer load-balancing loss, per layer, averaged over layers:
    n_experts * sum_i f_i * P_i, f_i = share of top-k slots routed to expert i (no gradient),
    P_i = mean router probability of expert i; 1.0 when balanced. (HF's built-in version
    pools all layers before taking the product, so one layer may starve experts as long as
    another makes up for it; a first run with it left experts of every layer near 0%.)
    Also returns the busiest and idlest expert's share relative to uniform, over layers."""
    import torch

    losses, hi, lo = [], 0.0, float("inf")
    for lg in router_logits:                       # lg: [tokens, n_experts]
        n = lg.shape[-1]
        probs = torch.softmax(lg.float(), dim=-1)
        top = torch.topk(probs, top_k, dim=-1).indices
        f = torch.bincount(top.reshape(-1), minlength=n).float() / top.numel()
        losses.append(n * (f * probs.mean(0)).sum())
        hi, lo = max(hi, float(f.max()) * n), min(lo, float(f.min()) * n)
    return torch.stack(losses).mean(), hi, lo


def evaluate(model, ids: np.ndarray, labels: np.ndarray, batch: int) -> float:
    """Mean next-token loss over reply tokens (the same quantity the training loss is)."""
    import torch

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids), batch):
            x = torch.from_numpy(ids[i:i + batch])
            y = torch.from_numpy(labels[i:i + batch])
            logits = model(input_ids=x, output_router_logits=False).logits
            lp = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), y[:, 1:].reshape(-1),
                ignore_index=-100, reduction="sum")
            total += float(lp)
            count += int((y[:, 1:] != -100).sum())
    model.train()
    return total / max(1, count)


def stage_train(work: Path, args) -> None:
    """Train until the budget is spent: --minutes of wall time (this machine is shared and
    its speed varies several-fold, so a time budget keeps the run inside its slot and still
    ends on a fully annealed learning rate), or --steps when --minutes is 0.

    Data-parallel over --procs processes of --threads threads each (gloo on localhost): on
    a busy 2-core machine two one-thread processes did about twice the tokens per second
    of one two-thread process, whose small ops parallelise poorly."""
    import socket

    import torch.multiprocessing as tmp

    if args.batch % args.procs:
        sys.exit("error: --batch must be a multiple of --procs")
    with socket.socket() as sock:        # a free port for the process group
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    if args.procs == 1:
        _train_worker(0, port, work, args)
    else:
        tmp.spawn(_train_worker, args=(port, work, args), nprocs=args.procs)


def _train_worker(rank: int, port: int, work: Path, args) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    world = args.procs
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    lead = rank == 0
    tok_ids = mf.token_ids(TOKENIZER, work / "tokenizer")
    pad = tok_ids["pad_token_id"]
    train = load_split(work, "train")
    hold_ids, hold_labels = pack(load_split(work, "heldout"), args.seq_len, None, pad)
    # A fixed slice of training rows, as many as the held-out rows, for a like-for-like gap.
    tr_ids, tr_labels = pack(train, args.seq_len, random.Random(0), pad)
    tr_ids, tr_labels = tr_ids[: len(hold_ids)], tr_labels[: len(hold_ids)]

    model = make_model(ModelShape(), TOKENIZER.vocab_size, tok_ids)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.1),
                             dict(params=no_decay, weight_decay=0.0)],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    ckpt = work / "ckpt.pt"
    log_path = args.log
    step, epoch, row, elapsed0 = 0, 0, 0, 0.0
    if ckpt.exists() and not args.fresh:
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, epoch, row, elapsed0 = state["step"], state["epoch"], state["row"], state["elapsed"]
        if lead:
            print(f"resumed at step {step} (epoch {epoch}, row {row}, {elapsed0:.0f}s)")
    elif lead:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w", newline="") as f:
            csv.writer(f).writerow(["step", "tokens", "epoch", "lr", "train_loss", "aux_loss",
                                    "max_load", "min_load", "heldout_loss", "elapsed_s"])
    ddp = DistributedDataParallel(model)        # also copies rank 0's weights to the others
    t0 = time.time() - elapsed0

    def progress() -> float:
        # Rank 0's clock decides for everyone, so all ranks stop on the same step.
        p = torch.tensor([(time.time() - t0) / (args.minutes * 60) if args.minutes > 0
                          else step / args.steps])
        dist.broadcast(p, 0)
        return float(p)

    def save() -> None:
        tmp = ckpt.with_suffix(".tmp")
        torch.save(dict(model=model.state_dict(), opt=opt.state_dict(), step=step,
                        epoch=epoch, row=row, elapsed=time.time() - t0), tmp)
        tmp.replace(ckpt)

    def held_out(rows: int | None = None) -> float:
        return evaluate(model, hold_ids[:rows], hold_labels[:rows], args.batch)

    ep_ids, ep_labels = pack(train, args.seq_len, random.Random(SEED + epoch), pad)
    model.train()
    stats = torch.zeros(4, dtype=torch.float64)        # lm, aux, steps (summed); max load
    run_lo = float("inf")
    coef, top_k = model.config.router_aux_loss_coef, model.config.num_experts_per_tok
    share = args.batch // world
    prog = progress()
    while prog < 1.0:
        if row + args.batch > len(ep_ids):     # next epoch, reshuffled (same order on all ranks)
            epoch, row = epoch + 1, 0
            ep_ids, ep_labels = pack(train, args.seq_len, random.Random(SEED + epoch), pad)
        lo_row = row + rank * share               # this rank's share of the global batch
        x = torch.from_numpy(ep_ids[lo_row:lo_row + share])
        y = torch.from_numpy(ep_labels[lo_row:lo_row + share])
        row += args.batch
        lr = lr_at(prog, step, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        out = ddp(input_ids=x, output_router_logits=True)
        lm = lm_loss(out.logits, y)
        aux, hi, lo = balance_loss(out.router_logits, top_k)
        (lm + coef * aux).backward()             # DDP averages the gradients over ranks
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        stats += torch.tensor([lm.item() / world, aux.item() / world, 1.0 / world, 0.0])
        if lead:                                # busiest / idlest expert: rank 0's view
            stats[3] = max(float(stats[3]), hi)
            run_lo = min(run_lo, lo)
        prog = progress()
        done = prog >= 1.0
        if step % args.log_every == 0 or done:
            dist.all_reduce(stats)              # (the max load is 0 on other ranks)
            if lead:
                held_loss = ""
                if step % args.eval_every == 0 or done:
                    held_loss = f"{held_out(args.eval_rows):.4f}"
                n = float(stats[2])
                elapsed = time.time() - t0
                with open(log_path, "a", newline="") as f:
                    csv.writer(f).writerow([step, step * args.batch * args.seq_len, epoch,
                                            f"{lr:.6f}", f"{stats[0] / n:.4f}",
                                            f"{stats[1] / n:.4f}",
                                            f"{stats[3]:.2f}", f"{run_lo:.2f}", held_loss,
                                            f"{elapsed:.0f}"])
                print(f"step {step:5d} ep {epoch} lr {lr:.2e} loss {stats[0] / n:.4f} "
                      f"aux {stats[1] / n:.3f} load {run_lo:.2f}-{stats[3]:.2f} "
                      f"held {held_loss or '-':>6} {elapsed:6.0f}s", flush=True)
            stats.zero_()
            run_lo = float("inf")
        if lead and (step % args.ckpt_every == 0 or done):
            save()

    if lead:
        final = dict(torch=torch.__version__, steps=step,
                     epochs=round(step * args.batch / len(ep_ids), 2),
                     train_tokens_seen=step * args.batch * args.seq_len,
                     train_seconds=round(time.time() - t0),
                     train_loss=evaluate(model, tr_ids, tr_labels, args.batch),
                     heldout_loss=held_out(),
                     eval_tokens=dict(train=int((tr_labels[:, 1:] != -100).sum()),
                                      heldout=int((hold_labels[:, 1:] != -100).sum())),
                     args={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str))})
        (work / "train_result.json").write_text(json.dumps(final, indent=1) + "\n")
        print(f"final: train loss {final['train_loss']:.4f}, "
              f"held-out loss {final['heldout_loss']:.4f}")
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------
# Export: load balance, HF -> GGUF -> Q8_0, llama.cpp sanity check, README
# ---------------------------------------------------------------------------------------

def expert_load(model, ids: np.ndarray, batch: int) -> np.ndarray:
    """Fraction of top-k slots each expert gets, per layer: [n_layers, n_experts]."""
    import torch

    cfg = model.config
    counts = np.zeros((cfg.num_hidden_layers, cfg.num_experts))
    model.eval()
    with torch.no_grad():
        for i in range(0, len(ids), batch):
            out = model(input_ids=torch.from_numpy(ids[i:i + batch]), output_router_logits=True)
            for layer, logits in enumerate(out.router_logits):
                top = torch.topk(logits, cfg.num_experts_per_tok, dim=-1).indices
                counts[layer] += np.bincount(top.reshape(-1).numpy(), minlength=cfg.num_experts)
    return counts / counts.sum(axis=1, keepdims=True)


def entropy_bits(p: np.ndarray) -> float:
    return float(-(p * np.log2(np.maximum(p, 1e-12))).sum())


def count_params(shape: ModelShape, vocab: int) -> dict:
    d, L, E = shape.hidden_size, shape.num_hidden_layers, shape.num_experts
    attn = d * shape.head_dim * (shape.num_attention_heads * 2 + shape.num_key_value_heads * 2) \
        + 2 * shape.head_dim + 2 * d            # q/k/v/o, q/k norms, two layer norms
    expert = 3 * d * shape.moe_intermediate_size
    router = E * d
    emb = vocab * d * (1 if shape.tie_word_embeddings else 2) + d
    total = L * (attn + router + E * expert) + emb
    active = L * (attn + router + shape.num_experts_per_tok * expert) + emb
    return dict(total=total, active_per_token=active, experts=L * E * expert,
                embeddings=emb)


def hf_logits(hf_dir: Path, tokens: np.ndarray) -> np.ndarray:
    """Teacher-forced f32 logits from the saved HF model with the default (eager) code paths:
    the reference the converted GGUF must match."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor(tokens[None, :], dtype=torch.long)).logits[0].numpy()


def greedy_llama(llm, prompt: str, eos: int, max_tokens: int) -> tuple[str, list[int]]:
    """Greedy decoding by argmax over llama.cpp's logits (no sampler in the way)."""
    toks = list(llm.tokenize(prompt.encode(), add_bos=False, special=True))
    llm.reset()
    llm.eval(toks)
    out: list[int] = []
    for _ in range(max_tokens):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if nxt == eos:
            break
        out.append(nxt)
        llm.eval([nxt])
    return llm.detokenize(out).decode("utf-8", errors="replace"), out


# One object from the training split and one from the held-out split (asserted below).
SAMPLES = (("train", "json.dumps"), ("heldout", "atexit.register"))


def pick_samples() -> list[tuple[str, str, str]]:
    """(split, question, reference answer) for the sanity check."""
    import pydoc

    out = []
    for split, qual in SAMPLES:
        assert is_heldout(qual) == (split == "heldout"), qual
        reference = answer_text(inspect.cleandoc(pydoc.locate(qual).__doc__))
        out.append((split, f"What does {qual} do?", reference))
    return out


def stage_export(work: Path, args) -> None:
    import torch
    import transformers

    torch.set_num_threads(args.procs * args.threads)
    lc = mf.find_llama_cpp(args.llama_cpp.resolve())
    tok_ids = mf.token_ids(TOKENIZER, work / "tokenizer")
    model = make_model(ModelShape(), TOKENIZER.vocab_size, tok_ids)
    model.load_state_dict(torch.load(work / "ckpt.pt", weights_only=False)["model"])
    result = json.loads((work / "train_result.json").read_text())
    data_stats = json.loads((work / "data" / "stats.json").read_text())

    held = load_split(work, "heldout")
    hold_ids, _ = pack(held, args.seq_len, None, tok_ids["pad_token_id"])
    load = expert_load(model, hold_ids, args.batch)
    np.savetxt(DOC_DIR / "expert_load.csv", load, delimiter=",", fmt="%.4f",
               header=",".join(f"e{i}" for i in range(load.shape[1])), comments="")

    # HF model dir = tokenizer + weights; saved with the default (eager) expert code path.
    hf_dir = work / "hf"
    shutil.rmtree(hf_dir, ignore_errors=True)
    shutil.copytree(work / "tokenizer", hf_dir)
    model.set_experts_implementation("eager")
    model.config.output_router_logits = False
    model.save_pretrained(hf_dir, safe_serialization=True)

    f32 = work / "default-f32.gguf"
    mf.convert_to_gguf(lc, hf_dir, f32, TOKENIZER.pre, model_name="onebit-default")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    mf.quantize_gguf(lc, f32, args.out, "Q8_0")
    types = mf.tensor_types(args.out)
    meta = mf.gguf_meta(args.out)
    size = args.out.stat().st_size
    print(f"{args.out}: {size / 2**20:.2f} MiB, types {sorted(set(types.values()))}, {meta}")

    # Sanity checks. (1) Teacher-forced logits on held-out text: HF (eager
    # experts, f32) against llama.cpp on the f32 and the shipped Q8_0 file.
    llama_cpp = mf.import_llama_cpp(lc)
    check_tokens = hold_ids[0, :128].astype(np.int32)
    hf_ref = hf_logits(hf_dir, check_tokens)
    agreement = {}
    for name, path in (("f32", f32), ("q8_0", args.out)):
        ref_llm = mf.open_llama(llama_cpp, path)
        agreement[name] = mf.compare(mf.llama_logits(ref_llm, check_tokens), hf_ref)
        ref_llm.close()
        print(f"llama.cpp {name} vs HF f32 on {len(check_tokens)} tokens: {agreement[name]}")
    # Where Q8_0 differs: HF run on the Q8_0 weights (dequantized by gguf-py) separates weight
    # rounding from llama.cpp's own (it also rounds activations to 8 bits); the router margin
    # (top-k-th minus next router logit) shows how close routing is to flipping.
    dequant = getattr(mf, "hf_dequant_reference", None)
    ref = dequant(args.out, hf_dir, check_tokens) if dequant else None
    if ref is not None:
        q8_llm = mf.open_llama(llama_cpp, args.out)
        q8 = mf.llama_logits(q8_llm, check_tokens)
        q8_llm.close()
        agreement["hf_q8_0_weights_vs_hf_f32"] = mf.compare(ref["logits_hf_dequant"], hf_ref)
        agreement["q8_0_vs_hf_q8_0_weights"] = mf.compare(q8, ref["logits_hf_dequant"])
        if "router_margin" in ref:
            agreement["min_router_margin"] = float(np.min(ref["router_margin"]))
        print({k: agreement[k] for k in agreement if k not in ("f32", "q8_0")})

    # (2) Greedy answers from llama.cpp on the shipped file, and from HF on the f32
    # weights for comparison.
    # logits_all: llama-cpp-python keeps no logits in .scores otherwise.
    llm = llama_cpp.Llama(model_path=str(args.out), n_ctx=512, n_threads=args.procs * args.threads,
                          n_gpu_layers=0, logits_all=True, verbose=False)
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    eos = tok_ids["eos_token_id"]
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    samples = []
    for split, question, reference in pick_samples():
        prompt = hf_tok.apply_chat_template([dict(role="user", content=question)],
                                            tokenize=False, add_generation_prompt=True)
        text, toks = greedy_llama(llm, prompt, eos, args.max_new_tokens)
        ptoks = hf_tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = hf_model.generate(ptoks, max_new_tokens=args.max_new_tokens, do_sample=False,
                                    eos_token_id=eos, pad_token_id=tok_ids["pad_token_id"])
        hf_toks = [t for t in gen[0, ptoks.shape[1]:].tolist() if t != eos]
        same = next((i for i, (a, b) in enumerate(zip(toks, hf_toks)) if a != b),
                    min(len(toks), len(hf_toks)))
        samples.append(dict(split=split, question=question, reference=reference, llama_cpp=text,
                            hf_f32=hf_tok.decode(hf_toks),
                            llama_cpp_tokens=len(toks), hf_f32_agree_prefix=same,
                            hf_f32_tokens=len(hf_toks),
                            prompt_tokens_match=ptoks[0].tolist() == list(
                                llm.tokenize(prompt.encode(), add_bos=False, special=True))))
        print(f"[{split}] {question}\n  llama.cpp: {text}\n  HF f32: {hf_tok.decode(hf_toks)}\n"
              f"  agree for {same} tokens")
    llm.close()

    summary = dict(shape=asdict(ModelShape()), vocab_size=TOKENIZER.vocab_size,
                   params=count_params(ModelShape(), TOKENIZER.vocab_size),
                   gguf=dict(path=os.path.relpath(args.out, REPO_ROOT), bytes=size,
                             tensor_types=sorted(set(types.values())), meta=meta),
                   data=data_stats, training=result, samples=samples,
                   logits_vs_hf=dict(tokens=len(check_tokens), **agreement),
                   commands="\n".join(dict.fromkeys(            # reruns listed once
                       (work / "commands.log").read_text().split("\n"))).strip(),
                   expert_load=dict(min=float(load.min()), max=float(load.max()),
                                    uniform=1 / load.shape[1],
                                    per_layer_max_over_min=[float(r.max() / max(r.min(), 1e-9))
                                                            for r in load],
                                    per_layer_entropy_bits=[entropy_bits(r) for r in load]))
    (DOC_DIR / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    write_readme(summary, load)


def write_readme(s: dict, load: np.ndarray) -> None:
    sh, p, tr, d, lv = s["shape"], s["params"], s["training"], s["data"], s["logits_vs_hf"]
    el = s["expert_load"]
    q8_note = ""
    if "q8_0_vs_hf_q8_0_weights" in lv:
        far = lv['hf_q8_0_weights_vs_hf_f32']['max_abs']
        q8_note = (f"\n\nThe Q8_0 gap is not a conversion error: HF on the Q8_0 weights"
                   f" (dequantized by gguf-py) is as far from HF f32 (max |diff| {far:.2f})"
                   f" and llama.cpp Q8_0 is as far from that (max |diff|"
                   f" {lv['q8_0_vs_hf_q8_0_weights']['max_abs']:.2f}; it also rounds activations to"
                   f" 8 bits). Routing amplifies small differences: ")
        if "min_router_margin" in lv:
            q8_note += (f"the gap between the 2nd and 3rd router logit gets as small as"
                        f" {lv['min_router_margin']:.4f}, so a rounding can swap an expert. ")
        q8_note += ("Expect Q8_0 greedy text to leave the f32 text after a few tokens; compare"
                    " engines on the same file, and keep tolerances for expert swaps.")
    rows = list(csv.DictReader(open(DOC_DIR / "training_log.csv")))
    best = min((r for r in rows if r["heldout_loss"]), key=lambda r: float(r["heldout_loss"]))
    load_rows = "\n".join(f"| {i} | " + " | ".join(f"{x * 100:.1f}" for x in row) +
                          f" | {row.min() * 100:.1f} | {row.max() * 100:.1f} |"
                          for i, row in enumerate(load))
    samples = "\n\n".join(
        f"**{x['split']}** — *{x['question']}*\n\n"
        f"llama.cpp, greedy ({x['llama_cpp_tokens']} tokens; the first "
        f"{x['hf_f32_agree_prefix']} agree with HF transformers on the f32 weights):\n\n"
        f"> {x['llama_cpp'].strip().replace(chr(10), chr(10) + '> ')}\n\n"
        f"reference (the docstring it was asked about):\n\n"
        f"> {x['reference'].strip().replace(chr(10), chr(10) + '> ')}"
        for x in s["samples"])
    a = tr["args"]
    n_train = sum("--stage data" not in c and "--stage export" not in c
                  for c in s["commands"].splitlines())
    resumed = ("" if n_train < 2 else
               f" The run was stopped at a checkpoint and resumed with a longer budget ({n_train}"
               " train commands below); the learning rate follows the budget of the last one.")
    text = f"""# The default model (`onebit/data/default.gguf`)

Made by `tools/train_default_model.py` (this README, `training_log.csv`, `expert_load.csv`
and `summary.json` are written by it). A real, trained mixture-of-experts model small
enough to ship inside the package, so `onebit chat` and `onebit generate` work with no model
argument. It answers questions about the Python standard library in the style of its
docstrings; it is a toy, not an assistant.

## Model

Architecture `qwen3moe` (HF `Qwen3MoeForCausalLM`; llama.cpp loads it).

| | |
|---|---|
| layers | {sh['num_hidden_layers']} (every layer MoE) |
| hidden size | {sh['hidden_size']} |
| attention | {sh['num_attention_heads']} heads x head_dim {sh['head_dim']}, {sh['num_key_value_heads']} KV heads, q/k RMSNorm, RoPE theta {sh['rope_theta']:g} |
| experts | {sh['num_experts']} per layer, top-{sh['num_experts_per_tok']}, norm_topk_prob={sh['norm_topk_prob']}, expert FFN {sh['moe_intermediate_size']} (SwiGLU), no shared expert |
| vocab | {s['vocab_size']} (byte-level BPE, pre `qwen2`) |
| context | {sh['max_position_embeddings']} |
| embeddings | untied (`token_embd` and `output`) |
| parameters | {p['total']:,} total, {p['active_per_token']:,} active per token ({p['experts']:,} in experts, {p['embeddings']:,} in embeddings) |
| file | {s['gguf']['bytes']:,} bytes ({s['gguf']['bytes'] / 2**20:.2f} MiB), tensor types {', '.join(s['gguf']['tensor_types'])} (`llama-quantize ... Q8_0`: Q8_0 matrices, F32 norms and routers) |
| tokenizer | `tokenizer.ggml.pre = {s['gguf']['meta']['tokenizer_pre']}`, ChatML `chat_template`, eos `<|im_end|>`, no BOS added |

## Data

Offline only, from this Python ({sys.version.split()[0]}): the standard library's docstrings —
every public module and submodule (a few skipped: GUI, Windows-only, side effects on import)
and every public function, class and method defined in it, {d['docstrings']:,} docstrings
({', '.join(f"{v:,} {k}{'es' if k == 'class' else 's'}" for k, v in d['docstring_kinds'].items())})
— and the language-reference topics that ship with pydoc (`pydoc_data.topics`). All of it
becomes ChatML chat turns:

- "What does json.dumps do?", "Explain the module json.", "Describe the class X.", ... (two
  phrasings per object, one per method) -> the docstring's first paragraph or so (wrapped lines
  joined, cut at a sentence under 600 characters);
- the rest of a long docstring, as a "Tell me more." follow-up or for "Show me the full
  documentation of X."; its doctest blocks for "Show me an example of X.";
- "What is the signature of X?" -> `inspect.signature` (35% of callables); "What functions
  does the M module provide?" -> a list; "Which module provides N?";
- "Explain the "with" statement." / "What does the yield keyword do?" -> the topic's text, in
  parts, each next part behind a "Tell me more.";
- a few hand-written greetings ("Who are you?", "Hello").

30% of the docstring conversations hold two or three objects of one module (so the model sees
history), 25% of all start with a system prompt. {d['qa_pairs']:,} question/answer pairs in all.

Held-out split: by object (a hash of its qualified name puts ~5% of objects there), so every
question about a held-out object is unseen in training — held-out loss measures answers to
docstrings the model never read, not memorisation.

| split | conversations | tokens | reply tokens (loss) | characters |
|---|---|---|---|---|
| train | {d['train']['conversations']:,} | {d['train']['tokens']:,} | {d['train']['loss_tokens']:,} | {d['train']['chars']:,} |
| held-out | {d['heldout']['conversations']:,} | {d['heldout']['tokens']:,} | {d['heldout']['loss_tokens']:,} | {d['heldout']['chars']:,} |

Tokenizer: `tokenizers` byte-level BPE (initial alphabet = all 256 byte symbols) trained on
the training conversations' text, with the Qwen2 pre-tokenizer regex (so llama.cpp's `qwen2`
pre-tokenizer splits text the same way); specials `<|endoftext|>`, `<|im_start|>`,
`<|im_end|>` (ids 4093-4095).

## Training

From scratch with torch {tr.get('torch', '')} on this machine's CPU: {a['procs']} data-parallel
processes x {a['threads']} thread (gloo; on the busy 2-core machine, shared with other jobs
throughout, that did about twice the tokens per second of one 2-thread process). AdamW (betas
0.9/0.95, weight decay 0.1 on matrices), peak lr {a['lr']}, {a['warmup']} warmup steps then
cosine to 10% over a {a['minutes']:g}-minute wall-time budget (the schedule follows elapsed
time, because the speed of a shared machine varies several-fold), grad clip 1.0, global batch
{a['batch']} x {a['seq_len']} tokens (conversations packed back to back), loss on assistant
replies (and their `<|im_end|>`) only, plus {sh['router_aux_loss_coef']} x the Switch-Transformer
load-balancing loss (`router_aux_loss_coef` in the config) taken per layer and averaged over
layers — HF's built-in version pools the layers first, and a first run with it left some
experts in every layer with under 0.1% of the tokens. It ran {tr['steps']:,} steps =
{tr['train_tokens_seen']:,} tokens
(~{tr['epochs']} epochs of the training split) in {tr['train_seconds'] / 60:.1f} minutes.{resumed}

Final loss (nats per reply token, evaluated after training on {tr['eval_tokens']['train']:,}
training / {tr['eval_tokens']['heldout']:,} held-out reply tokens — all of the held-out split):

| train | held-out |
|---|---|
| {tr['train_loss']:.3f} | {tr['heldout_loss']:.3f} |

The held-out loss was lowest ({float(best['heldout_loss']):.3f}) at step {best['step']} and rose
afterwards while the training loss kept falling: after a few epochs the model memorises
replies rather than generalising. The shipped weights are the final ones. What to expect from
it: fluent docstring-style English with the right shape (greetings answered, "Return ..."
sentences, signatures, `<|im_end|>` to stop), but the facts are mostly wrong — it has learnt
to continue a docstring far better than which docstring belongs to which name. It is a
test model for the engine (routing, streaming, chat plumbing), not a source of answers.

The curve is in `training_log.csv`: step, tokens, epoch, lr, train loss (mean over the last
{a['log_every']} steps), aux loss (1.0 = balanced), max_load / min_load (the busiest and idlest
expert's share of one batch's routing slots relative to uniform, over layers and those steps;
rank 0's half of the batch), held-out loss (first {a['eval_rows']} held-out rows, every
{a['eval_every']} steps), elapsed seconds.

## Expert load balance

Percent of top-{sh['num_experts_per_tok']} routing slots each expert receives on all of the
held-out text (uniform = {100 / sh['num_experts']:.2f}%); also in `expert_load.csv`. Every
expert of every layer is used: the least used gets {el['min'] * 100:.1f}%, the busiest
{el['max'] * 100:.1f}%; per-layer routing entropy {min(el['per_layer_entropy_bits']):.2f}-{max(el['per_layer_entropy_bits']):.2f}
bits (4.00 = uniform over 16).

| layer | {' | '.join(f'e{i}' for i in range(load.shape[1]))} | min | max |
|---|{'---|' * (load.shape[1] + 2)}
{load_rows}

## Sanity check with llama.cpp

Teacher-forced logits on the first {lv['tokens']} tokens of the held-out split, llama.cpp
against HF transformers (f32, eager): f32 GGUF max |diff| {lv['f32']['max_abs']:.1e}, argmax
agreement {lv['f32']['argmax_agree']:.3f}; shipped Q8_0 GGUF max |diff| {lv['q8_0']['max_abs']:.2f},
min cosine {lv['q8_0']['min_cos']:.5f}, argmax agreement {lv['q8_0']['argmax_agree']:.3f}.{q8_note}

The shipped Q8_0 file loaded by llama.cpp (llama-cpp-python {mf.LLAMA_CPP_PYTHON_VERSION}'s
vendored build, CPU), the question rendered with the GGUF's chat template, greedy (argmax)
decoding up to {a.get('max_new_tokens', 160)} tokens. One question about an object in the
training split and one about a held-out object (never seen in training):

{samples}

## Reproduce

```sh
tools/build_llama_cpp.sh .llama-cpp        # or point --llama-cpp at an existing build
pip install -e '.[fixtures]'
python tools/train_default_model.py --llama-cpp .llama-cpp --work /tmp/default_model
```

That runs the three stages (`--stage data|train|export` runs one); `train` resumes from the
last checkpoint in `--work` (saved every {a['ckpt_every']} steps) unless `--fresh`. Data and
tokenizer are deterministic for a given Python; training is not bit-reproducible (the time
budget decides the step count). Commands used for this file:

```sh
{s.get('commands', '')}
```
"""
    (DOC_DIR / "README.md").write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stage", choices=["all", "data", "train", "export"], default="all")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK,
                    help="scratch dir (data, tokenizer, checkpoints, HF model), outside the repo")
    ap.add_argument("--llama-cpp", type=Path, default=REPO_ROOT / ".llama-cpp",
                    help="tools/build_llama_cpp.sh output dir (or the extracted sdist)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--minutes", type=float, default=30.0,
                    help="training wall-time budget; 0 = train for --steps instead")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-rows", type=int, default=32,
                    help="held-out rows (of seq-len) in periodic evals; the final one uses all")
    ap.add_argument("--ckpt-every", type=int, default=25)
    ap.add_argument("--procs", type=int, default=2, help="data-parallel training processes")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint")
    ap.add_argument("--log", type=Path, default=DOC_DIR / "training_log.csv",
                    help="loss curve CSV (appended to on resume)")
    args = ap.parse_args()
    args.work = args.work.resolve()
    args.out = args.out.resolve()
    args.work.mkdir(parents=True, exist_ok=True)

    with open(args.work / "commands.log", "a") as f:     # quoted in the README
        f.write("python tools/train_default_model.py " + " ".join(sys.argv[1:]) + "\n")
    t0 = time.time()
    if args.stage in ("all", "data"):
        stage_data(args.work)
    if args.stage in ("all", "train"):
        stage_train(args.work, args)
    if args.stage in ("all", "export"):
        stage_export(args.work, args)
    print(f"done in {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
