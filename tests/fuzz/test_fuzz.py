"""The fuzz tier (``pytest -m fuzz tests/fuzz``): every command over hostile inputs.

Each case must end as the README promises: exit 2 with exactly one ``error:`` line on stderr (3 when nothing fits),
no traceback, no NaN / Infinity in --json output, no partial output file, within 10 s. The sweep's corpus cases
are in cases.py; the hypothesis properties below mutate valid files field by field.
"""

from __future__ import annotations

import json
import math

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cases import CORPUS, ROOT, all_cases, base_plan_text, run_dir
from harness import Case, describe, run_case

pytestmark = pytest.mark.fuzz

CASES = all_cases()


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_hostile_case(case: Case, tmp_path):
    outcome = run_case(case, tmp_path)
    verdict = outcome.classify(case, tmp_path)
    assert verdict == "ok", describe(case, outcome, verdict)


def test_sweep_is_large_enough():
    assert len(CASES) >= 500
    assert len({c.id for c in CASES}) == len(CASES)


# ---- hypothesis: one field of a valid file replaced by a hostile value ------------------------------------
HOSTILE = st.one_of(
    st.booleans(), st.none(), st.just(float("nan")), st.just(float("inf")), st.just(-float("inf")),
    st.integers(min_value=-(10**30), max_value=10**30), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8), st.lists(st.integers(0, 5), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _leaves(data, prefix=()):
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _leaves(v, (*prefix, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _leaves(v, (*prefix, i))
    yield prefix


def _replace(data, path, value):
    data = json.loads(json.dumps(data))
    if not path:
        return value
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


def _assert_behaves(outcome, json_out: bool):
    assert outcome.exception is None, outcome.exception
    assert outcome.exit_code in (0, 2), (outcome.exit_code, outcome.stderr)
    if outcome.exit_code == 2:
        lines = [ln for ln in outcome.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), outcome.stderr
    if json_out and outcome.exit_code == 0:
        assert "NaN" not in outcome.stdout and "Infinity" not in outcome.stdout
    assert outcome.seconds < 10


MODEL = yaml.safe_load((ROOT / "models" / "tiny-moe.yaml").read_text())
PLATFORM = yaml.safe_load((ROOT / "platforms" / "local-cpu.yaml").read_text())
FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck))
"""Examples per property: the active hypothesis profile's (conftest.py: 100; --hypothesis-profile=fuzz-stress: 1000)."""


@FUZZ
@given(path=st.sampled_from(sorted(set(_leaves(MODEL)), key=str)), value=HOSTILE)
def test_model_field_fuzz(tmp_path_factory, path, value):
    tmp = tmp_path_factory.mktemp("m")
    (tmp / "m.json").write_text(json.dumps(_replace(MODEL, path, value), allow_nan=True))
    for args in (["model", "show", "{tmp}/m.json", "--json"],
                 ["estimate", "--model", "{tmp}/m.json", "--platform", "local-cpu", "--nodes", "1", "--seq", "128",
                  "--global-batch", "8", "--json"]):
        _assert_behaves(run_case(Case("h", args), tmp), True)


@FUZZ
@given(path=st.sampled_from(sorted(set(_leaves(PLATFORM)), key=str)), value=HOSTILE)
def test_platform_field_fuzz(tmp_path_factory, path, value):
    tmp = tmp_path_factory.mktemp("p")
    (tmp / "p.json").write_text(json.dumps(_replace(PLATFORM, path, value), allow_nan=True))
    args = ["estimate", "--model", "tiny-moe", "--platform", "{tmp}/p.json", "--nodes", "2", "--dp", "4", "--ep", "2",
            "--seq", "128", "--global-batch", "8", "--json"]
    _assert_behaves(run_case(Case("h", args), tmp), True)


METRIC_FIELDS = ("step", "loss", "step_time_s", "tokens_per_s", "time_s", "memory_bytes", "schema_version")


@FUZZ
@given(field=st.sampled_from(METRIC_FIELDS), value=HOSTILE)
def test_metrics_field_fuzz(tmp_path_factory, field, value):
    tmp = tmp_path_factory.mktemp("r")
    rows = [{"schema_version": 1, "step": s, "loss": 6.0, "step_time_s": 2.0, "tokens_per_s": 500.0,
             "time_s": {"a2a": 0.2}, "memory_bytes": [{"total_bytes": 3.0e8}]} for s in (1, 2)]
    rows[1][field] = value
    run_dir(metrics=("\n".join(json.dumps(r, allow_nan=True) for r in rows) + "\n").encode())(tmp)
    _assert_behaves(run_case(Case("h", ["compare", "{tmp}/run", "--json"]), tmp), True)


@FUZZ
@given(tokens=st.lists(st.one_of(st.sampled_from(["nan", "inf", "-1", "0", "1e400", "N/A", "1024.5", "abc"]),
                                 st.integers(-5, 10**6).map(str),
                                 st.floats(allow_nan=False, allow_infinity=False).map(repr)),
                       min_size=1, max_size=14))
def test_nccl_line_fuzz(tmp_path_factory, tokens):
    from make_corpus import NCCL_HEADER

    tmp = tmp_path_factory.mktemp("n")
    (tmp / "log.txt").write_text(NCCL_HEADER + "  " + "  ".join(tokens) + "\n")
    args = ["calibrate", "import-nccl-tests", "{tmp}/log.txt", "--op", "all_to_all", "--nodes", "1",
            "--ranks-per-node", "2", "--scope", "node", "--platform", "frontier", "--out", "{tmp}/cal", "--json"]
    outcome = run_case(Case("h", args), tmp)
    _assert_behaves(outcome, True)
    csv = tmp / "cal" / "collectives.csv"
    if csv.exists():
        assert "nan" not in csv.read_text().lower() and "inf" not in csv.read_text().lower()


def test_corpus_is_committed():
    """The corpus the cases read is the one make_corpus.py writes (regenerate it after changing that file)."""
    assert len(list(CORPUS.rglob("*"))) > 250
    assert math.isfinite(len(base_plan_text()))


def _plan_leaves():
    plan = json.loads(base_plan_text())
    return sorted({p for p in _leaves(plan) if p and p[0] != "prediction"}, key=str)


@FUZZ
@given(data=st.data(), value=HOSTILE)
def test_plan_field_fuzz(tmp_path_factory, data, value):
    """One field of a saved plan.json (not its prediction: issue 14 types it) replaced: launch and compare stay
    one-line errors or succeed."""
    path = data.draw(st.sampled_from(_plan_leaves()))
    tmp = tmp_path_factory.mktemp("pl")
    plan = _replace(json.loads(base_plan_text()), path, value)
    text = json.dumps(plan, allow_nan=True)
    (tmp / "plan.json").write_text(text)
    run_dir(plan_text=text)(tmp)
    _assert_behaves(run_case(Case("h", ["launch", "--plan", "{tmp}/plan.json", "--out", "{tmp}/job", "--dry-run"]), tmp),
                    False)
    _assert_behaves(run_case(Case("h", ["compare", "{tmp}/run", "--json"]), tmp), True)
