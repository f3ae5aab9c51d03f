"""`onebit cache-sim` checks its trace as the GGUF loader checks a file (issue 36): one line
naming the trace line, exit 2, for a header-only trace, an out-of-range header, record layers,
expert ids and row widths the header rules out, ids that are not integers, overlong lines, and
a pool of fewer than one slot."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from onebit.moe import cachesim

HEADER = {"onebit_trace": 1, "model": "m", "n_layers": 2, "n_experts": 4, "k": 2}


def _rec(layer=0, experts=((0, 1),), phase="decode"):
    return json.dumps({"phase": phase, "layer": layer, "experts": [list(r) for r in experts]})


def _trace(tmp_path, *lines, header=HEADER):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join([json.dumps(header) if isinstance(header, dict) else header, *lines]) + "\n")
    return p


def _sim(monkeypatch, capsys, path, *slots):
    code, out, err = run_cli(monkeypatch, capsys, "cache-sim", str(path), *(a for s in slots or ("4",)
                                                                             for a in ("--slots", s)))
    return code, out, err


def _one_line_error(code, out, err):
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("onebit: error: "), (code, out, err)
    assert "internal error" not in err
    return lines[0]


def test_a_good_trace_still_replays(monkeypatch, capsys, tmp_path):
    p = _trace(tmp_path, _rec(0, [(0, 1), (2, 3)], "prompt"), _rec(1, [(1, 2), (0, 3)], "prompt"),
               _rec(0, [(0, 2)]), _rec(1, [(1, 3)]))
    code, out, err = _sim(monkeypatch, capsys, p, "4")
    assert code == 0 and "global-lru" in out, err


def test_header_only_trace_says_it_holds_no_records(monkeypatch, capsys, tmp_path):
    line = _one_line_error(*_sim(monkeypatch, capsys, _trace(tmp_path)))
    assert "holds no records" in line and "ZeroDivisionError" not in line


@pytest.mark.parametrize("key, value", [("n_experts", 1e308), ("n_experts", 0), ("n_layers", "2"), ("k", 5),
                                        ("n_experts", 10 ** 30), ("k", True)])
def test_header_values_out_of_range(monkeypatch, capsys, tmp_path, key, value):
    p = _trace(tmp_path, _rec(), header={**HEADER, key: value})
    line = _one_line_error(*_sim(monkeypatch, capsys, p))
    assert f"t.jsonl:1: trace header {key!r}" in line


@pytest.mark.parametrize("record, what", [
    (_rec(0, [(0, "a")]), "expert id 'a' is not an integer in 0..3"),
    (_rec(0, [(0, 1.5)]), "expert id 1.5 is not an integer"),
    (_rec(0, [(0, -1)]), "expert id -1 is not an integer in 0..3"),
    (_rec(0, [(0, 4)]), "expert id 4 is not an integer in 0..3"),
    (_rec(2, [(0, 1)]), "layer 2 is not an integer in 0..1"),
    (_rec(-1, [(0, 1)]), "layer -1"),
    (_rec(0, [(0, 1, 2)]), "has 3 entries; the header's k is 2"),
    (_rec(0, [()]), "has 0 entries"),
    (_rec(0, [(1, 1)]), "same expert twice"),
    (_rec(0, [(0, 1)], phase="sample"), "phase 'sample'"),
    ('{"phase": "decode", "layer": 0, "experts": [[0, 1]]', "malformed trace record"),
    ("[1, 2]", "not a JSON object"),
])
def test_bad_records_name_their_line(monkeypatch, capsys, tmp_path, record, what):
    p = _trace(tmp_path, _rec(0, [(0, 1)]), _rec(1, [(2, 3)]), record)
    line = _one_line_error(*_sim(monkeypatch, capsys, p))
    assert "t.jsonl:4: " in line and what in line, line


@pytest.mark.parametrize("slots", ["-1", "0"])
def test_slots_below_one(monkeypatch, capsys, tmp_path, slots):
    p = _trace(tmp_path, _rec())
    line = _one_line_error(*_sim(monkeypatch, capsys, p, "4", slots))
    assert f"--slots {slots}: the pool needs at least 1 slot" in line


def test_an_overlong_line_is_refused_after_a_bounded_read(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cachesim, "MAX_LINE", 4096)
    p = tmp_path / "t.jsonl"
    with open(p, "w") as f:
        f.write(json.dumps(HEADER) + "\n" + _rec() + "\n")
        f.write('{"phase": "decode", "layer": 0, "experts": [' + "[0, 1], " * 200_000 + "[0, 1]]}\n")
    line = _one_line_error(*_sim(monkeypatch, capsys, p))
    assert "t.jsonl:3: line longer than" in line


def test_simulate_itself_refuses_no_records_and_no_slots():
    from onebit.errors import UsageError
    from onebit.moe.trace import Access, Trace

    with pytest.raises(UsageError, match="no records"):
        cachesim.simulate(Trace(HEADER, []), "lru", 4)
    with pytest.raises(UsageError, match="at least 1 slot"):
        cachesim.simulate(Trace(HEADER, [Access(0, True, 0, (0,))]), "global-lru", 0)


@pytest.mark.parametrize("decay", ["-0.5", "1.5", "nan"])
def test_decay_outside_zero_to_one(monkeypatch, capsys, tmp_path, decay):
    p = _trace(tmp_path, _rec())
    line = _one_line_error(*run_cli(monkeypatch, capsys, "cache-sim", str(p), "--slots", "4", "--decay", decay))
    assert f"--decay {float(decay)}: give a number from 0 to 1" in line
