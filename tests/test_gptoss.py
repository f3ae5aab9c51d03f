"""gpt-oss: its features each proven by the oracle, its new kernels against their twins, and
the invariants every MoE architecture keeps (backends agree, streamed == resident, prediction
changes nothing).

The oracle figures themselves (HF transformers and llama.cpp, gptoss-f32, gptossmx-f32 and
gptossmx-MXFP4_MOE) are tests/test_oracle.py's, which run every fixture.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import onebit
from conftest import chat_repl_output, cosine_rows, fixture_path, greedy_tokens
from onebit.backends import BACKENDS
from onebit.backends import numpy_backend as nb
from onebit.backends.vulkan import reference as ref
from onebit.backends.vulkan.backend import VulkanBackend
from onebit.apps.chat import ChatSession
from onebit.chat_formats.chat_template import render_chat
from onebit.chat_formats.harmony import HarmonyStream, is_harmony, split_reply
from onebit.models import gpt_oss
from onebit.moe.predict import settings_from

F32 = "gptoss-f32"
FILES = [F32, "gptossmx-MXFP4_MOE"]


@pytest.fixture(autouse=True)
def vulkan_registered(monkeypatch):
    monkeypatch.setitem(BACKENDS, "vulkan", VulkanBackend)


def _tokens(name: str, n: int = 48) -> np.ndarray:
    return np.load(fixture_path(f"{name}.ref.npz"))["tokens"][:n].astype(np.int64)


def _hf_cos(model) -> np.ndarray:
    hf = np.load(fixture_path(f"{F32}.ref.npz"))["logits_hf"]
    return cosine_rows(model.logits(_tokens(F32)), hf)


# -- the config -----------------------------------------------------------------------------

def test_config_from_the_file():
    cfg = onebit.load(fixture_path(f"{F32}.gguf"), backend="numpy").cfg
    assert cfg.arch == "gpt-oss" and cfg.n_experts == 4 and cfg.n_experts_used == 2
    assert cfg.swa_layers == (0, 2) and cfg.sliding_window == 4  # even layers slide, odd are full
    assert cfg.rope_neox and cfg.rope_yarn_factor == 4.0 and cfg.rope_yarn_orig_ctx == 64
    divisors, mscale = cfg.yarn_rope(cfg.rope_theta)
    assert divisors[0] == 1.0 and divisors[-1] == pytest.approx(4.0)  # fast kept, slow interpolated
    assert 1.0 < divisors[2] < 4.0  # and one ramped between (the fixture puts the ramp there)
    assert mscale == pytest.approx(1 + 0.1 * np.log(4.0))


def test_yarn_is_refused_where_the_architecture_does_not_apply_it(tmp_path):
    """A file of another architecture that asks for YaRN is refused, not run without it."""
    from ggufedit import rewrite

    dst = tmp_path / "yarn.gguf"
    rewrite(fixture_path("qwen3moe-f32.gguf"), dst, meta={"qwen3moe.rope.scaling.type": "yarn"})
    with pytest.raises(onebit.errors.UnsupportedModelError, match="yarn"):
        onebit.load(dst, backend="numpy")


# -- every feature is seen by the oracle ------------------------------------------------------

def test_the_f32_fixture_matches_transformers():
    cos = _hf_cos(onebit.load(fixture_path(f"{F32}.gguf"), backend="numpy"))
    assert cos.min() >= 0.99999


def _no_sinks(monkeypatch):
    orig = nb.EagerStep.attention
    monkeypatch.setattr(nb.EagerStep, "attention", lambda self, layer, q, k, v, window=0, scale=None, sinks=None:
                        orig(self, layer, q, k, v, window, scale))


def _plain_swiglu(monkeypatch):
    monkeypatch.setattr(nb.NumpyBackend, "glu_oai", staticmethod(lambda g, u, alpha, limit: nb.NumpyBackend.silu(g) * u))


def _unclamped(monkeypatch):
    orig = nb.NumpyBackend.glu_oai
    monkeypatch.setattr(nb.NumpyBackend, "glu_oai", staticmethod(lambda g, u, alpha, limit: orig(g, u, alpha, 1e30)))


def _no_expert_biases(monkeypatch):
    monkeypatch.setattr(nb.NumpyBackend, "expert_biases", lambda self, layer: None)


def _no_router_bias(monkeypatch):
    monkeypatch.setattr(gpt_oss.Network, "router_names",
                        staticmethod(lambda cfg, i: (f"blk.{i}.post_attention_norm.weight", f"blk.{i}.ffn_gate_inp.weight", None)))


FEATURES = {
    "sinks": _no_sinks,
    "clamped swiglu": _plain_swiglu,
    "the clamp": _unclamped,
    "expert biases": _no_expert_biases,
    "router bias": _no_router_bias,
    "sliding window": dict(swa_layers=()),
    "yarn": dict(rope_yarn_factor=0.0),
    "yarn's ramp": dict(rope_yarn_beta_fast=1e6, rope_yarn_beta_slow=1e6 * 2),  # every frequency interpolated
}


@pytest.mark.parametrize("feature", FEATURES)
def test_each_feature_turned_off_breaks_the_oracle(feature, monkeypatch):
    """Turn one feature off: transformers must notice, so the oracle test proves each of them."""
    change = FEATURES[feature]
    model = onebit.load(fixture_path(f"{F32}.gguf"), backend="numpy")
    if isinstance(change, dict):
        model.net.arch.cfg = dataclasses.replace(model.net.cfg, **change)
    else:
        change(monkeypatch)
    cos = _hf_cos(model)
    assert (cos < 0.9999).mean() > 0.2, f"{feature} off: min cos {cos.min():.6f}"


def test_the_clamp_is_reached():
    """The fixture's expert gate values cross the limit (else the clamp would be untested)."""
    seen = []
    orig = nb.NumpyBackend.glu_oai

    def spy(g, u, alpha, limit):
        seen.append((float(g.max()), float(np.abs(u).max())))
        return orig(g, u, alpha, limit)

    model = onebit.load(fixture_path(f"{F32}.gguf"), backend="numpy")
    model.net.be.glu_oai = spy
    model.logits(_tokens(F32))
    assert max(g for g, _ in seen) > gpt_oss.GLU[1] and max(u for _, u in seen) > gpt_oss.GLU[1]


# -- the new kernels against their twins --------------------------------------------------------

def _attention_by_loops(q, k, v, pos, window, scale, sinks):
    R, H, D = q.shape
    S, Hkv, Dv = v.shape
    out = np.zeros((R, H, Dv), np.float64)
    for r in range(R):
        keys = [j for j in range(S) if j <= pos[r] and (window == 0 or j > pos[r] - window)]
        for h in range(H):
            kvh = h // (H // Hkv)
            s = np.array([q[r, h] @ k[j, kvh] for j in keys], np.float64) * scale
            m = max(s.max(), sinks[h])
            p = np.exp(s - m)
            out[r, h] = p @ v[keys, kvh] / (p.sum() + np.exp(sinks[h] - m))
    return out.reshape(R, H * Dv)


@pytest.fixture(scope="module")
def vk_ops():
    from onebit.backends.vulkan.ops import VulkanOps

    return {red: VulkanOps(reduce=red) for red in ("none", "subgroup")}


@pytest.mark.parametrize("reduce", ["none", "subgroup"])
@pytest.mark.parametrize("S,R,window", [(1, 1, 0), (40, 1, 4), (300, 1, 0), (60, 7, 5), (30, 3, 0)])
def test_attention_sinks(vk_ops, S, R, window, reduce):
    """numpy's sinks against plain loops; the Vulkan kernel (both reductions) and the cpu kernel
    against numpy. A sink larger than every score is included (it dominates the denominator)."""
    from onebit.backends.cpu import small_ops

    rng = np.random.default_rng(S * 10 + R)
    H, Hkv, D = 8, 2, 32
    q = rng.standard_normal((R, H, D)).astype(np.float32)
    k = rng.standard_normal((S, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((S, Hkv, D)).astype(np.float32)
    sinks = (2 * rng.standard_normal(H)).astype(np.float32)
    sinks[3] = 40.0
    pos = np.arange(S - R, S)
    want = ref.attention(q, k, v, pos, window, 0.2, sinks)
    np.testing.assert_allclose(want, _attention_by_loops(q, k, v, pos, window, 0.2, sinks), rtol=0, atol=1e-5)
    np.testing.assert_allclose(vk_ops[reduce].attention(q, k, v, pos, window, 0.2, sinks), want, rtol=0, atol=2e-5)
    got = np.empty((R, H, D), np.float32)
    small_ops.attention_sinks(got, q, k, v, pos.astype(np.int64), window, 0.2, sinks)
    np.testing.assert_allclose(got.reshape(R, -1), want, rtol=0, atol=2e-5)
    # without sinks the kernel is what it was
    np.testing.assert_allclose(vk_ops[reduce].attention(q, k, v, pos, window, 0.2),
                               ref.attention(q, k, v, pos, window, 0.2), rtol=0, atol=2e-5)


def test_expert_bias_kernels(vk_ops):
    rng = np.random.default_rng(5)
    R, k, F, E, dim = 5, 2, 96, 4, 64
    g = (4 * rng.standard_normal((R, k, F))).astype(np.float32)  # beyond the limit in places
    u = (4 * rng.standard_normal((R, k, F))).astype(np.float32)
    ids = rng.integers(0, E, (R, k))
    bg, bu = rng.standard_normal((E, F)).astype(np.float32), rng.standard_normal((E, F)).astype(np.float32)
    alpha, limit = gpt_oss.GLU
    want = ref.expert_glu_oai(g, u, ids, bg, bu, alpha, limit)
    a = np.minimum(g + bg[ids], limit)  # the twin against its definition, written out
    b = np.clip(u + bu[ids], -limit, limit)
    np.testing.assert_allclose(want, a / (1 + np.exp(-alpha * a)) * (b + 1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(vk_ops["none"].expert_glu_oai(g, u, ids, bg, bu, alpha, limit), want,
                               rtol=1e-5, atol=1e-5)
    y = rng.standard_normal((R, dim)).astype(np.float32)
    w = rng.random((R, k)).astype(np.float32)
    bd = rng.standard_normal((E, dim)).astype(np.float32)
    want = ref.expert_down_bias(y, ids, w, bd)
    loops = y.astype(np.float64).copy()
    for r in range(R):
        for s in range(k):
            loops[r] += w[r, s] * bd[ids[r, s]]
    np.testing.assert_allclose(want, loops, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(vk_ops["none"].expert_down_bias(y, ids, w, bd), want, rtol=1e-6, atol=1e-6)


# -- backends agree, streamed == resident, prediction changes nothing -----------------------------

@pytest.mark.parametrize("backend", ["cpu", "vulkan"])
@pytest.mark.parametrize("name", FILES)
def test_backend_matches_numpy(name, backend):
    """Prefill logits within 1e-4 of numpy's, and greedy tokens identical (decode steps)."""
    path = fixture_path(f"{name}.gguf")
    ids = _tokens(name, 12)
    want_m, got_m = onebit.load(path, backend="numpy"), onebit.load(path, backend=backend)
    assert got_m.be.name == backend
    want, got = want_m.logits(ids), got_m.logits(ids)
    # The cpu backend's MXFP4 products take int16-rounded activations, and a float-order difference
    # upstream can move a rounding by one step: on this 2-layer file that moved the logits by 0.88x
    # (row kernels) and 1.09x (experts repacked, X16) of 1e-4 of the largest; llama.cpp's reference
    # (8-bit activations) is 2.3e-2 away. Float activations (vulkan, f32 files) keep 1e-4.
    tol = 2e-4 if backend == "cpu" and "MXFP4" in name else 1e-4
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())
    assert greedy_tokens(got_m, ids[:6], 8) == greedy_tokens(want_m, ids[:6], 8)


@pytest.mark.parametrize("backend", ["numpy", "cpu", "vulkan"])
def test_rows_in_one_forward_equal_single_row_steps(backend):
    """Invariant 7 over sinks, the window (4) and YaRN: 20 rows at once == 20 one-row steps."""
    m = onebit.load(fixture_path(f"{F32}.gguf"), backend=backend)
    ids = _tokens(F32, 20)
    whole = m.net.forward(ids, m.new_cache())
    cache = m.new_cache()
    steps = np.concatenate([m.net.forward(ids[i : i + 1], cache) for i in range(len(ids))])
    np.testing.assert_allclose(steps, whole, rtol=0, atol=1e-4 * np.abs(whole).max())


def _decode(m, ids, n=8):
    cache = m.new_cache()
    out = [m.net.forward(ids, cache)]
    for _ in range(n):
        out.append(m.net.forward(np.array([int(out[-1][-1].argmax())]), cache))
    return np.concatenate(out)


@pytest.mark.parametrize("backend", ["numpy", "cpu", "vulkan"])
def test_streamed_equals_resident_bit_for_bit(backend):
    path = fixture_path(f"{FILES[1]}.gguf")
    ids = _tokens(FILES[1], 12)
    want = _decode(onebit.load(path, backend=backend), ids)
    for slots in (2, 3):
        m = onebit.load(path, backend=backend, slots=slots, budget="1GiB")
        try:
            assert m.pool is not None and m.pool.n_slots == slots
            got = _decode(m, ids)
            assert m.pool.stats.demand_misses > 0
        finally:
            m.close()
        assert np.array_equal(got, want), f"{backend} slots={slots}"


@pytest.mark.parametrize("backend", ["numpy", "cpu", "vulkan"])
@pytest.mark.parametrize("mode", ["router", "block"])
def test_prediction_is_bit_identical_and_predicts(backend, mode):
    """Prediction (the router with its bias and norm; the block with sinks and YaRN) never
    changes the output, and on this model it ranks the next layer's experts well above chance."""
    path = fixture_path(f"{F32}.gguf")
    ids = _tokens(F32, 12)
    want = _decode(onebit.load(path, backend=backend), ids)
    m = onebit.load(path, backend=backend, slots=3, budget="1GiB", predict=settings_from(mode=mode))
    try:
        got = _decode(m, ids)
        st = m.predictor.stats
    finally:
        m.close()
    assert np.array_equal(got, want)
    routed = sum(s.routed for s in st.values())
    assert routed and sum(s.top_hits for s in st.values()) / routed > 0.5  # chance: k / E = 0.5

# -- harmony chat ---------------------------------------------------------------------------------



DATE = re.compile(r"Current date: \d{4}-\d{2}-\d{2}")
ANALYSIS, FINAL = "The user greets me; I greet back.", "Hello! How can I help?"
REPLY = f"<|channel|>analysis<|message|>{ANALYSIS}<|end|><|start|>assistant<|channel|>final<|message|>{FINAL}"


@pytest.fixture(scope="module")
def chat_model():
    return onebit.load(fixture_path(f"{F32}.gguf"), backend="numpy")


@pytest.mark.parametrize("i", range(6))
def test_harmony_template_renders_as_transformers(chat_model, i):
    """The file's template (llama.cpp's gpt-oss template) rendered by onebit == transformers'
    apply_chat_template on the same conversations (the current date aside)."""
    case = json.loads(fixture_path(f"{F32}.chat.json").read_text())["cases"][i]
    got = render_chat(chat_model.chat_template, case["messages"], case["add_generation_prompt"],
                      bos_token="<|startoftext|>", eos_token="<|return|>", **case["kwargs"])
    assert DATE.search(got) and DATE.search(case["text"])
    assert DATE.sub("", got) == DATE.sub("", case["text"])


def test_the_fixture_is_a_harmony_model(chat_model):
    tok = chat_model.tokenizer
    assert is_harmony(chat_model)
    stops = {tok.decode([t]) for t in tok.stop_ids}
    assert {"<|return|>", "<|call|>"} <= stops and "<|end|>" not in stops  # <|end|> ends a message only
    assert not is_harmony(onebit.load(fixture_path("qwen3moe-f32.gguf"), backend="numpy"))


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_harmony_stream_splits_channels_however_the_text_arrives(piece):
    s = HarmonyStream()
    for i in range(0, len(REPLY), piece):
        s.feed(REPLY[i : i + piece])
    s.feed("", final=True)
    assert (s.thinking, s.content) == (ANALYSIS, FINAL)


def test_harmony_stream_edge_cases():
    assert split_reply("no header at all, a <| stray") == ("", "no header at all, a <| stray")
    assert split_reply("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}") == ("", "")
    assert split_reply("<|channel|>commentary<|message|>Let me check.<|end|>") == ("", "Let me check.")
    assert split_reply("<|channel|>analysis<|message|>a<b<|end|>") == ("a<b", "")


class Scripted:
    """A sampler that writes a given reply (token by token), whatever the logits."""

    def __init__(self, ids):
        self.ids = list(ids)

    def __call__(self, logits):
        return self.ids.pop(0)


def _script(model, text=REPLY, stop="<|return|>"):
    return Scripted(model.tokenize(text, add_special=False) + [model.tokenizer.token_to_id(stop)])


def test_chat_session_parses_the_channels_and_stores_the_turn(chat_model):
    s = ChatSession(chat_model, temperature=0.0, max_tokens=200, system="Be kind.")
    s.sampler = _script(chat_model)
    got = list(s.send("Hi!"))
    assert "".join(r.text for r in got) == FINAL and "".join(r.reasoning for r in got) == ANALYSIS
    assert s.last.finish_reason == "stop"  # at <|return|>
    assert s.history[-1] == {"role": "assistant", "content": FINAL, "thinking": ANALYSIS}
    # the next turn renders the stored turn through the template (its reasoning dropped, as the
    # template does for earlier turns) and reuses the cached prompt
    s.sampler = _script(chat_model, "<|channel|>final<|message|>Bye.")
    assert "".join(r.text for r in s.send("Bye")) == "Bye."
    assert 0 < s.last.prompt_tokens_computed < s.last.prompt_tokens
    text = chat_model.apply_chat_template(s.messages()[:-1])
    assert f"<|start|>assistant<|channel|>final<|message|>{FINAL}<|end|>" in text and ANALYSIS not in text


@pytest.mark.parametrize("show", [False, True])
def test_chat_repl_hides_or_dims_the_reasoning(chat_model, monkeypatch, capsys, show):
    out = chat_repl_output(chat_model, _script(chat_model), monkeypatch, capsys, show)
    assert FINAL in out and "<|channel|>" not in out
    assert (f"\033[2m{ANALYSIS}\033[0m\n{FINAL}" in out) == show and (ANALYSIS in out) == show
    assert ("(reasoning; --show-reasoning shows it)" in out) == (not show)


@pytest.mark.parametrize("show", [False, True])
def test_generate_keeps_the_final_text_and_the_reasoning_per_flag(chat_model, monkeypatch, show):
    from onebit.apps import batch
    from onebit import model as model_mod

    monkeypatch.setattr(model_mod, "make_sampler", lambda *a, **kw: _script(chat_model))
    item = batch.PromptItem("1", 1, prompt="Hi!")
    rec = batch.generate_one(chat_model, item, chat=True, system=None, seed=None, max_tokens=200,
                             show_reasoning=show)
    assert rec["text"] == FINAL and rec["finish_reason"] == "stop"
    assert rec.get("reasoning") == (ANALYSIS if show else None)
    raw = batch.generate_one(chat_model, item, chat=False, system=None, seed=None, max_tokens=200)
    assert "<|channel|>" in raw["text"]  # without the chat template nothing is parsed


def test_onebit_chat_in_a_terminal_shows_a_reply_through_the_harmony_template():
    """`onebit chat` on the gpt-oss fixture (a random model: it writes no channel headers, so its
    text is the reply) in a real terminal: the reply is shown, the chat goes on, /quit."""
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed (apt-get install tmux)")
    from test_chat_tmux import Term

    t = Term([sys.executable, "-m", "onebit.cli.main", "chat", str(fixture_path(f"{F32}.gguf")), "--max-tokens", "12",
              "--temp", "0", "--backend", "numpy", "--show-reasoning"])
    try:
        s = t.wait_for(t.at_prompt(1))
        assert "gpt-oss" in s
        t.send("Hello there", "Enter")
        s = t.wait_for(t.at_prompt(2))
        reply = s.split("> Hello there", 1)[1].split("\n> ", 1)[0].strip()
        assert reply and "<|" not in reply
        t.send("/stats", "Enter")
        s = t.wait_for(lambda s: "finish: length" in s)
        t.send("/quit", "Enter")
        s = t.wait_for(lambda s: "EXITED" in s)
        assert "EXITED 0" in s and "Traceback" not in s
    finally:
        t.kill()


@pytest.mark.parametrize("show", [False, True])
def test_cli_generate_show_reasoning(show, tmp_path):
    """The flag reaches the results: `reasoning` is a field with it and absent without it; the
    streamed form prints the reply alone on stdout."""
    flag = ["--show-reasoning"] if show else []
    base = [sys.executable, "-m", "onebit.cli.main", "generate", "--model", str(fixture_path(f"{F32}.gguf")),
            "--prompt", "Hello", "--max-tokens", "5", "--backend", "numpy"]
    r = subprocess.run([*base, "--json", *flag], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert ("reasoning" in out) == show and len(out["tokens"]) == 5 and "<|" not in out["text"]
    r = subprocess.run([*base, *flag], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert r.stdout.rstrip("\n") == out["text"]  # greedy: the same reply, streamed
