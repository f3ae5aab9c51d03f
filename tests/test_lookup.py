"""Lookup decoding (onebit/lookup.py, generate_step): drafts verified in rows, with rollback.

Greedy lookup == plain greedy decoding token for token, whatever the budget, wherever a
stop string, max tokens or an interrupt falls; the cache after a generation == the cache
plain decoding leaves; a forward over R rows then a rollback == single-row steps; and under
sampling, speculative sampling keeps the target distribution (a chi-square test with a
deliberately wrong acceptance rule as its negative control). Counters prove drafts were
proposed, accepted and rejected in every test that relies on them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import onebit
from conftest import fixture_path
from onebit.backends import BACKENDS
from onebit.backends.vulkan.backend import VulkanBackend
from onebit.apps.chat import ChatSession
from onebit.errors import UsageError
from onebit.generate import generate_step, stream_generate
from onebit import generate as generate_mod
from onebit.lookup import DEFAULT_DRAFTS, DraftPolicy, LookupStats, NgramDrafter, lookup_budget
from onebit.runner import Decoder
from onebit.sample import Sampler, make_sampler

MOE = ["qwen3moe-f32", "qwen2moe-f32", "olmoe-f32", "mixtral-f32"]
DENSE = ["llama-f32", "qwen2-f32", "qwen3-f32"]
N_GEN = 48

_loaded: dict[tuple[str, str], onebit.Model] = {}


@pytest.fixture(autouse=True)
def vulkan_registered(monkeypatch):
    monkeypatch.setitem(BACKENDS, "vulkan", VulkanBackend)


class VerifyAll(DraftPolicy):
    """Verifies every proposed draft, so the tests exercise drafts whatever the timings say
    (the real policy only changes how many rows a forward has: its own tests are below)."""

    def choose(self, tokens, drafts, lengths):
        super().choose(tokens, drafts, lengths)
        return len(drafts)


@pytest.fixture(autouse=True)
def every_draft(monkeypatch):
    monkeypatch.setattr(generate_mod, "DraftPolicy", VerifyAll)


def load(name: str, backend: str = "numpy") -> onebit.Model:
    key = (name, backend)
    if key not in _loaded:
        _loaded[key] = onebit.load(fixture_path(f"{name}.gguf"), backend=backend)
    return _loaded[key]


def prompt(name: str, n: int = 6) -> list[int]:
    return [int(t) for t in np.load(fixture_path(f"{name}.ref.npz"))["tokens"][:n]]


class Recording(Sampler):
    """A greedy sampler that records, per yielded draft, whether verification kept it."""

    def __init__(self):
        super().__init__(0.0, 1.0, 0.0, 0, None)
        self.verdicts: list[bool] = []

    def verify(self, logits, draft):
        ok, tok = super().verify(logits, draft)
        self.verdicts.append(ok)
        return ok, tok


def run(m, ids, lookup, max_tokens=N_GEN, stop=(), sampler=None, cache=None):
    """(tokens, text, finish, cache, stats) of one generation through stream_generate."""
    cache = m.new_cache() if cache is None else cache
    stats = LookupStats()
    toks, text, finish = [], "", None
    for r in stream_generate(m, ids, max_tokens=max_tokens, sampler=sampler or make_sampler(0.0), stop=stop,
                             cache=cache, lookup=lookup, lookup_stats=stats):
        text += r.text
        if r.token is not None:
            toks.append(r.token)
        finish = r.finish_reason
    return toks, text, finish, cache, stats


def step_tokens(m, ids, lookup, n=N_GEN):
    """n tokens straight from generate_step (no EOS or stop handling), the cache, the counters."""
    cache, stats = m.new_cache(), LookupStats()
    steps = generate_step(m.net, ids, cache, make_sampler(0.0), lookup=lookup, max_tokens=n,
                          max_positions=m.context_length, stats=stats)
    toks = [next(steps) for _ in range(n)]
    steps.close()
    return toks, cache, stats


def yielded_from_drafts(m, ids, lookup, max_tokens=N_GEN) -> list[int]:
    """Indices (into the generated tokens) of the tokens that came out of accepted drafts."""
    s = Recording()
    steps = generate_step(m.net, ids, m.new_cache(), s, lookup=lookup, max_tokens=max_tokens,
                          max_positions=m.context_length)
    out, n_seen = [], 0
    for i in range(max_tokens):
        next(steps)
        if len(s.verdicts) > n_seen and s.verdicts[-1] and len(s.verdicts) == n_seen + 1:
            out.append(i)
        n_seen = len(s.verdicts)
    steps.close()
    return out


# -- the drafter --------------------------------------------------------------------------


def rescan_next(tokens: list[int], n_max: int):
    """The reference: the token after the most recent earlier occurrence of the longest
    n-gram (n = n_max .. 1) ending the sequence, found by scanning."""
    L = len(tokens)
    for n in range(min(n_max, L), 0, -1):
        tail = tokens[L - n :]
        for j in range(L - n - 1, -1, -1):  # occurrence tokens[j:j+n], followed by tokens[j+n]
            if tokens[j : j + n] == tail:
                return tokens[j + n]
    return None


def test_drafter_equals_a_rescan_reference():
    rng = np.random.default_rng(0)
    for trial in range(300):
        vocab = int(rng.integers(2, 8))
        seq = [int(t) for t in rng.integers(0, vocab, size=int(rng.integers(0, 40)))]
        d = NgramDrafter(seq, n_max=3)
        k = int(rng.integers(0, 10))
        want, ctx = [], list(seq)
        while len(want) < k:
            t = rescan_next(ctx, 3)
            if t is None:
                break
            want.append(t)
            ctx.append(t)
        assert d.propose(k) == want, (seq, k)


def test_drafter_index_grows_by_n_max_entries_per_token_at_most():
    d = NgramDrafter(n_max=4)
    rng = np.random.default_rng(1)
    for i, t in enumerate(rng.integers(0, 1000, size=2000)):
        d.push(int(t))
        assert len(d.follows) <= 4 * (i + 1)


def test_drafter_prefers_the_longest_match():
    d = NgramDrafter([5, 1, 2, 9, 7, 2, 8, 1, 2], n_max=4)
    assert d.propose(1) == [9]  # "1 2" -> 9 beats "2" -> 8 (the latest single-token match)
    assert NgramDrafter([1, 2, 3], n_max=4).propose(4) == []


def test_lookup_budget_parsing():
    assert lookup_budget(0) == 0 and lookup_budget(3) == 3 and lookup_budget(96) == 8
    for bad in (-1, "x", "1.5"):
        with pytest.raises(UsageError):
            lookup_budget(bad)


def test_lookup_is_on_by_default_and_off_where_asked(monkeypatch):
    assert lookup_budget(None) == DEFAULT_DRAFTS == 8 and lookup_budget(None, default=0) == 0
    monkeypatch.setenv("ONEBIT_LOOKUP", "0")
    assert lookup_budget(None) == 8  # the library reads no environment (the CLI does: test_cli.py)


def test_model_generate_drafts_by_default_but_not_under_a_hook(monkeypatch):
    monkeypatch.delenv("ONEBIT_LOOKUP", raising=False)
    m = load("qwen3moe-f32")
    ids = prompt("qwen3moe-f32")
    want = [r.token for r in m.generate(ids, max_tokens=30, lookup=0)]
    st = LookupStats()
    assert [r.token for r in m.generate(ids, max_tokens=30, lookup_stats=st)] == want
    assert st.proposed > 0 and st.forwards < 30
    rows = []
    st = LookupStats()
    got = [r.token for r in m.generate(ids, max_tokens=30, lookup_stats=st,
                                       hook=lambda layer, e, logits: rows.append(len(e)))]
    assert got == want and st.proposed == 0
    n_moe = sum(1 for l in range(m.cfg.n_layers) if m.cfg.layer_is_moe(l))
    assert rows.count(1) == 29 * n_moe  # a hook sees one row per decode token: no verify rows


# -- rows and rollback --------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["numpy", "vulkan"])
@pytest.mark.parametrize("name", MOE)
def test_rows_then_rollback_equal_single_steps(name, backend):
    """R rows in one forward == R single steps (logits), and after trimming the last R - 1 rows
    the cache continues exactly as one that never held them: R = 1..9."""
    m = load(name, backend)
    ids = np.asarray(prompt(name, 4 + 9 + 9), np.int64)
    tol = (1e-5 if backend == "numpy" else 1e-4)
    for R in range(1, 10):
        rows = m.new_cache()
        m.net.forward(ids[:4], rows)
        got = m.net.forward(ids[4 : 4 + R], rows)
        single = m.new_cache()
        m.net.forward(ids[:4], single)
        want = np.concatenate([m.net.forward(ids[4 + r : 5 + r], single) for r in range(R)])
        np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())
        assert (got.argmax(-1) == want.argmax(-1)).all()
        # roll back to one row, then go on with other tokens: == a cache that only saw one row
        rows.trim(R - 1)
        fresh = m.new_cache()
        m.net.forward(ids[:5], fresh)
        other = ids[13 : 13 + R]
        got = m.net.forward(other, rows)
        want = m.net.forward(other, fresh)
        np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())


# -- greedy lookup == plain ---------------------------------------------------------------


@pytest.mark.parametrize("name", MOE + DENSE)
def test_greedy_lookup_equals_plain_for_every_budget(name):
    m = load(name)
    ids = prompt(name)
    want, want_cache, _ = step_tokens(m, ids, 0)
    want_text = run(m, ids, 0)[1:3]
    total = LookupStats()
    for budget in (1, 2, 9, 96):
        got, cache, st = step_tokens(m, ids, lookup_budget(budget))
        assert got == want, budget
        assert cache.offset == want_cache.offset
        assert st.proposed <= lookup_budget(budget) * st.forwards
        assert run(m, ids, lookup_budget(budget))[1:3] == want_text  # with EOS and text as the user sees it
        total.add(st)
    assert total.proposed > 0


def test_drafts_are_proposed_accepted_and_rejected_on_the_fixtures():
    total = LookupStats()
    for name in MOE + DENSE:
        total.add(step_tokens(load(name), prompt(name), 8)[2])
    assert total.accepted > 0 and total.proposed > total.accepted
    assert total.tokens_per_forward > 1.0


@pytest.mark.parametrize("name", ["qwen3moe-f32", "olmoe-f32"])
def test_lookup_on_vulkan_equals_plain(name):
    m = load(name, "vulkan")
    ids = prompt(name)
    want = run(m, ids, 0)
    got = run(m, ids, 8)
    assert got[:3] == want[:3] and got[3].offset == want[3].offset
    assert got[4].proposed > 0


def test_cache_after_lookup_equals_the_plain_cache():
    """Rejected drafts leave nothing behind: every layer's keys and values over the held
    positions == plain decoding's (within float32 rounding of a different matmul shape)."""
    m = load("qwen3moe-f32")
    ids = prompt("qwen3moe-f32")
    want = run(m, ids, 0)[3]
    got, st = run(m, ids, 8)[3:]
    assert st.proposed > st.accepted > 0  # drafts were rejected along the way
    assert got.offset == want.offset
    for a, b in zip(got, want):
        n = got.offset
        np.testing.assert_allclose(a.keys[:n], b.keys[:n], rtol=0, atol=1e-5 * np.abs(b.keys[:n]).max())
        np.testing.assert_allclose(a.values[:n], b.values[:n], rtol=0, atol=1e-5 * np.abs(b.values[:n]).max())


def accepted_positions(name):
    m = load(name)
    ids = prompt(name)
    pos = yielded_from_drafts(m, ids, 8)
    assert pos, "no draft was accepted: the test would prove nothing"
    return m, ids, pos


def test_max_tokens_inside_accepted_drafts():
    m, ids, pos = accepted_positions("qwen3moe-f32")
    plain = run(m, ids, 0)[0]
    for k in sorted(set(pos[:6] + [p + 1 for p in pos[:6]])):  # stop on a draft and just after one
        want = run(m, ids, 0, max_tokens=k)
        got = run(m, ids, 8, max_tokens=k)
        assert got[:3] == want[:3] and got[0] == plain[:k]
        assert got[3].offset == want[3].offset


def test_stop_strings_inside_accepted_drafts():
    m, ids, pos = accepted_positions("qwen3moe-f32")
    plain = run(m, ids, 0)[0]
    hit_inside = 0
    full = m.detokenize(plain)
    for p in pos[:8]:
        # the shortest text ending with token p whose first occurrence ends there
        end = len(m.detokenize(plain[: p + 1]))
        stop = None
        for q in range(p, -1, -1):
            start = len(m.detokenize(plain[:q]))
            cand = full[start:end]
            if cand.strip() and full.find(cand) == start:
                stop = cand
                break
        if stop is None:
            continue
        want = run(m, ids, 0, stop=[stop])
        got = run(m, ids, 8, stop=[stop])
        assert got[:3] == want[:3]
        assert got[3].offset == want[3].offset
        hit_inside += want[2] == "stop" and len(want[0]) - 1 in pos
    assert hit_inside > 0


def test_an_interrupt_inside_accepted_drafts_leaves_the_chat_as_plain_decoding_does():
    m, ids, pos = accepted_positions("qwen3moe-f32")
    k = pos[0]  # the consumer stops while the cache still holds rows of the accepted drafts
    sessions = []
    for lookup in (0, 8):
        s = ChatSession(m, max_tokens=24, temperature=0.0, lookup=lookup)
        with pytest.raises(KeyboardInterrupt):
            for i, _ in enumerate(s.send("tell me more")):
                if i == k:
                    raise KeyboardInterrupt
        sessions.append(s)
    plain, look = sessions
    assert look.prefix.tokens == plain.prefix.tokens and look.prefix.cache.offset == plain.prefix.cache.offset
    assert look.history == plain.history
    replies = [[r.token for r in s.send("and again") if r.token is not None] for s in sessions]
    assert replies[0] == replies[1]
    assert look.lookup_stats.proposed > 0


def test_chat_prefix_reuse_is_unchanged_by_lookup():
    m = load("olmoe-f32")
    turns = []
    for lookup in (0, 4):
        s = ChatSession(m, max_tokens=20, temperature=0.0, lookup=lookup)
        out = []
        for msg in ("hi", "what next", "go on"):
            out.append([r.token for r in s.send(msg) if r.token is not None])
            out.append(s.last.prompt_tokens_computed)
        turns.append(out)
    assert turns[0] == turns[1]


def test_chat_stats_show_the_conversations_drafts():
    """/stats: the drafts proposed and accepted over the whole conversation, as counted; no
    lookup line with lookup off."""
    from onebit.cli.chat_repl import format_stats

    m = load("olmoe-f32")
    s = ChatSession(m, max_tokens=20, temperature=0.0, lookup=4)
    for msg in ("one two one two one two one two", "again: one two one two"):
        list(s.send(msg))
    st = s.lookup_stats
    assert st.proposed > 0
    want = f"lookup: drafts proposed {st.proposed}, accepted {st.accepted} "
    assert want in format_stats(s) and "(up to 4 drafts per forward)" in format_stats(s)
    off = ChatSession(m, max_tokens=4, temperature=0.0, lookup=0)
    list(off.send("hi"))
    assert "lookup:" not in format_stats(off)


def test_model_generate_takes_lookup():
    m = load("mixtral-f32")
    ids = prompt("mixtral-f32")
    st = LookupStats()
    want = [r.token for r in m.generate(ids, max_tokens=30, lookup=0)]
    got = [r.token for r in m.generate(ids, max_tokens=30, lookup=6, lookup_stats=st)]
    assert got == want and st.forwards > 0
    assert 1 in m.net.draft_times and len(m.net.draft_times) > 1  # row-count timings kept for the next one
    with pytest.raises(UsageError):
        list(m.generate(ids, max_tokens=3, lookup=-2))


def test_drafts_never_run_past_the_context():
    m = onebit.load(fixture_path("qwen3moe-f32.gguf"), n_ctx=24, backend="cpu")
    ids = prompt("qwen3moe-f32")
    want = run(m, ids, 0, max_tokens=100)
    got = run(m, ids, 8, max_tokens=100)
    assert got[:3] == want[:3] and want[2] == "length"
    assert got[3].offset <= 24


# -- sampling keeps the distribution ------------------------------------------------------


class BigramNet(Decoder):
    """A tiny deterministic 'model': the logits after a token depend on it and on its position
    parity (a table), so a speculative step must reproduce a context-dependent distribution."""

    vocab = 5

    def __init__(self):
        rng = np.random.default_rng(42)
        self.table = rng.normal(0, 1.2, size=(2, self.vocab, self.vocab)).astype(np.float32)

    def forward(self, ids, cache, hook=None, last_only=False):
        pos = cache.offset + np.arange(len(ids))
        out = self.table[pos % 2, ids]
        cache.offset += len(ids)
        return out[-1:] if last_only else out


class CountingCache:
    can_trim = True

    def __init__(self):
        self.offset = 0

    def trim(self, n):
        self.offset -= n


class SqrtAcceptance(Sampler):
    """A wrong rule (accept with sqrt(p)): the chi-square test must catch it."""

    def verify(self, logits, draft):
        order, p = self.distribution(logits)
        hit = order == draft
        if self.rng.random() < math.sqrt(float(p[hit].sum())):
            return True, int(draft)
        rest = np.where(hit, 0.0, p)
        return False, int(order[self.rng.choice(len(order), p=rest / rest.sum())])


def joint_counts(sampler_cls, lookup, n, **kw):
    """Counts of (2nd, 3rd) generated token over n seeded runs: drafts verify both of them."""
    net = BigramNet()
    prompt_ids = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]  # every bigram seen: a draft is always proposed
    counts = np.zeros((net.vocab, net.vocab), np.int64)
    stats = LookupStats()
    for seed in range(n):
        s = sampler_cls(1.0, kw.get("top_p", 1.0), 0.0, kw.get("top_k", 0), seed)
        steps = generate_step(net, prompt_ids, CountingCache(), s, lookup=lookup, stats=stats)
        next(steps)
        a, b = next(steps), next(steps)
        steps.close()
        counts[a, b] += 1
    return counts, stats


def chi_square_p(obs: np.ndarray, exp_p: np.ndarray) -> float:
    """Upper-tail p-value of Pearson's statistic (Wilson-Hilferty approximation), cells with
    expected count >= 5."""
    n = obs.sum()
    e = exp_p * n
    keep = e >= 5
    stat = float(((obs[keep] - e[keep]) ** 2 / e[keep]).sum())
    df = int(keep.sum()) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def exact_joint(**kw) -> np.ndarray:
    """The target distribution of (2nd, 3rd) generated token, from the table itself."""
    net, s = BigramNet(), Sampler(1.0, kw.get("top_p", 1.0), 0.0, kw.get("top_k", 0), 0)

    def dist(parity, tok):
        order, p = s.distribution(net.table[parity, tok])
        out = np.zeros(net.vocab)
        out[order] = p
        return out

    first = dist(11 % 2, 1)  # after the prompt's last token (position 11)
    joint = np.zeros((net.vocab, net.vocab))
    for t1 in range(net.vocab):
        pa = dist(12 % 2, t1)
        for a in range(net.vocab):
            joint[a] += first[t1] * pa[a] * dist(13 % 2, a)
    return joint


@pytest.mark.parametrize("kw", [{}, {"top_k": 3}])
def test_speculative_sampling_keeps_the_distribution(kw):
    n = 6000
    exact = exact_joint(**kw)
    plain, _ = joint_counts(Sampler, 0, n, **kw)
    spec, stats = joint_counts(Sampler, 3, n, **kw)
    wrong, _ = joint_counts(SqrtAcceptance, 3, n, **kw)
    assert stats.proposed > 0 and 0 < stats.accepted < stats.proposed
    assert chi_square_p(plain, exact) > 1e-3  # the test's own yardstick holds for plain sampling
    assert chi_square_p(spec, exact) > 1e-3
    assert chi_square_p(wrong, exact) < 1e-6, "the test cannot tell a wrong acceptance rule"


def test_seeded_speculative_sampling_is_reproducible():
    m = load("qwen3moe-f32")
    ids = prompt("qwen3moe-f32")
    runs = [run(m, ids, 8, sampler=make_sampler(0.8, seed=7))[0] for _ in range(2)]
    assert runs[0] == runs[1]


def test_seeded_lookup_sampling_gives_the_tokens_plain_sampling_gives():
    """One draw per token, in order (see Sampler.verify): the same seed, the same tokens."""
    m = load("qwen3moe-f32")
    ids = prompt("qwen3moe-f32")
    for seed in range(3):
        want = run(m, ids, 0, sampler=make_sampler(0.9, top_k=20, seed=seed))[0]
        got, st = run(m, ids, 8, sampler=make_sampler(0.9, top_k=20, seed=seed))[0::4]
        assert got == want and st.proposed > 0


# -- the draft policy ---------------------------------------------------------------------


def test_policy_drafts_when_drafts_are_right_and_rows_cheap():
    p = DraftPolicy()
    for R in range(1, 10):
        p.timed(R, 1.0 + 0.05 * (R - 1))
    toks = list(range(20))
    p.hits[4], p.tries[4] = 95.0, 100.0
    assert p.choose(toks, [1, 2, 3, 4, 5, 6, 7, 8], [4] * 8) == 8
    q = DraftPolicy()
    for R in range(1, 10):
        q.timed(R, 1.0 + 0.05 * (R - 1))
    q.hits[1], q.tries[1] = 5.0, 100.0
    assert q.choose(toks, [1, 2], [1, 1]) == 0  # 1.05 expected tokens for 1.05x the time: not worth it


def test_policy_stops_drafting_when_rows_cost_as_much_as_steps():
    p = DraftPolicy()
    for R in range(1, 10):
        p.timed(R, float(R))  # compute-bound: R rows take R times as long
    p.hits[4], p.tries[4] = 90.0, 100.0
    assert p.choose(list(range(10)), [1] * 8, [4] * 8) == 0


def test_policy_learns_the_accept_rate_from_every_proposal():
    p = DraftPolicy()
    toks = [1, 2, 3]
    p.choose(toks, [7, 8, 9], [2, 2, 2])  # proposed after [1, 2, 3]
    toks += [7, 8]  # two right so far: still open
    p.score(toks)
    assert p.tries[2] == 4.0
    toks += [5]  # the third was wrong
    p.score(toks)
    assert (p.hits[2], p.tries[2]) == (3.0, 7.0)


def test_policy_rates_outlive_a_generation_when_kept():
    """A second generation sharing the rates (as the network keeps them) starts from what the
    first learned; a fresh one starts from the prior."""
    rates, times = {}, {R: 1.0 + 0.1 * (R - 1) for R in range(1, 10)}
    first = DraftPolicy(times=times, learned=rates)
    assert first.choose([1, 2, 3], [4], [2]) == 1  # the prior (0.25 right) pays at 1.1x a step
    toks = [1, 2, 3]
    for _ in range(20):  # every draft behind a 2-token match wrong
        first.choose(toks, [4], [2])
        toks = toks + [5]
    first.score(toks)
    assert first.rate(2) < 0.05
    assert DraftPolicy(times=times, learned=rates).choose(toks, [4], [2]) == 0
    assert DraftPolicy(times=times).choose(toks, [4], [2]) == 1


def test_policy_memory_is_bounded_so_a_change_of_text_is_followed():
    p = DraftPolicy()
    p.hits[3], p.tries[3] = 10_000.0, 10_000.0  # long right
    toks = [1, 2, 3]
    for _ in range(40):  # then wrong 40 times in a row
        p.choose(toks, [9], [3])
        toks = toks + [8]
    p.score(toks)
    assert p.tries[3] == DraftPolicy.MEMORY
    assert p.rate(3) < 0.6  # without the bound it would still be 10000 / 10040 = 0.996


def _gated_run(per_forward, n=800):
    """n decode forwards through a policy whose model always wants to draft (accept rates
    pinned high, rows priced as free), on a fake clock: per_forward(d) = (seconds, tokens made)
    for a forward verifying d drafts. The share of forwards that drafted, and the gate."""
    t = [0.0]
    p = DraftPolicy(clock=lambda: t[0])
    for R in range(1, 10):
        p.timed(R, 1.0)
    made, drafted = 0, 0
    for i in range(n):
        p.hits[4], p.tries[4] = 95.0, 100.0
        d = p.choose(list(range(i + 10)), [1] * 8, [4] * 8)
        p.started(made)
        dt, made = per_forward(d)
        t[0] += dt
        drafted += d > 0
    return drafted / n, p.gate


def test_gate_turns_drafting_off_when_measured_decode_is_slower_with_it():
    """Drafts that the model prices as paying but that make decode slower (3 s a token against
    1 s): after the first EXPLORE windows the gate keeps them off, but for one window in EXPLORE."""
    share, gate = _gated_run(lambda d: (3.0, 1) if d else (1.0, 1))
    assert not gate.on and gate.mean[True] > gate.mean[False]
    assert 0.1 < share < 0.25  # 8 windows at the start + 1 in 8 after, of 100


def test_gate_keeps_drafting_when_it_pays():
    share, gate = _gated_run(lambda d: (1.2, 3) if d else (1.0, 1))
    assert gate.on and share > 0.85


def test_gate_is_fed_by_generation_and_its_off_state_verifies_nothing(monkeypatch):
    """Through generate_step: with the network's gate off (and off measured faster), lookup
    verifies no drafts (the output is plain decoding's), and the forwards reach the gate."""
    monkeypatch.setattr(generate_mod, "DraftPolicy", DraftPolicy)
    name = "qwen3moe-f32"
    m = onebit.load(fixture_path(f"{name}.gguf"), backend="numpy")
    try:
        want = step_tokens(m, prompt(name), 0)[0]
        m.net.draft_learned["gate"] = {"on": False, "mean": {True: 1e9, False: 1e-9}, "windows": 1}
        got, _, st = step_tokens(m, prompt(name), 8)
        assert got == want and st.proposed == 0
        assert m.net.draft_learned["gate"]["windows"] >= 1 + (N_GEN - 1) // DraftPolicy.WINDOW - 1
        assert m.net.draft_learned["hits"] != [1.0] * len(m.net.draft_learned["hits"]) or \
            m.net.draft_learned["tries"] != [4.0] * len(m.net.draft_learned["tries"])  # proposals still scored
    finally:
        m.close()


# -- streamed experts ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["numpy", "cpu", "vulkan"])
def test_streamed_lookup_equals_resident_plain(backend):
    """Through a pool smaller than the experts (the union of the rows' experts acquired per
    forward), lookup gives the tokens resident plain decoding gives, and drafts ran."""
    name = "qwen3moe-f32"
    want = step_tokens(load(name, backend), prompt(name), 0)[0]
    m = onebit.load(fixture_path(f"{name}.gguf"), backend=backend, slots=6, budget="1GiB")
    try:
        assert m.pool is not None
        got, _, st = step_tokens(m, prompt(name), 8)
        assert got == want
        assert st.accepted > 0 and st.proposed > st.accepted
        assert m.pool.stats.demand_misses > 0  # it did stream
    finally:
        m.close()


def test_a_plain_callable_sampler_works_with_lookup():
    """A caller's own sampler (any callable of the logits, no `verify`): lookup keeps a draft
    exactly when the sampler's draw equals it, so the tokens are the sampler's plain ones."""
    m = load("qwen3moe-f32")
    ids = prompt("qwen3moe-f32")
    want, _, _ = step_tokens(m, ids, 0)
    cache, st = m.new_cache(), LookupStats()
    steps = generate_step(m.net, ids, cache, lambda logits: int(np.argmax(logits)), lookup=8, max_tokens=N_GEN,
                          stats=st)
    got = [next(steps) for _ in range(N_GEN)]
    steps.close()
    assert got == want and st.accepted > 0
