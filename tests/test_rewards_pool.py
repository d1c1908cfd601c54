"""The reward worker pool: per-call time limits, hung and dying workers, errors with their samples.

One reward file whose behaviour the response picks ("hang", "raise", "exit", ...), and one scorer
per module, so the whole file starts worker processes only a few times (~0.4 s each).
"""

import logging
import time

import pytest

from fitrl.config.schema import RewardConfig
from fitrl.roles.reward import RewardError, RewardScorer

pytestmark = pytest.mark.slow  # worker processes: not in the fast tier

LIMIT = 0.6        # seconds per call
BEHAVIOURS = '''
import os, time

def behave(response, answer, extra=None):
    if response == "hang":
        time.sleep(10**6)
    if response == "raise":
        raise KeyError("no such field")
    if response == "exit":
        os._exit(3)
    if response == "str":
        return "high"
    if response == "unpicklable":
        return lambda: 1.0
    if response == "pid":
        return float(os.getpid())
    return {"score": float(answer), "extra": float((extra or {}).get("w", 0.0))}
'''


def reward_cfg(function, kwargs=None, **options):
    cfg = RewardConfig(function, dict(kwargs or {}))
    for name, value in options.items():
        setattr(cfg, name, value)
    return cfg


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    f = tmp_path_factory.mktemp("rewards") / "behave.py"
    f.write_text(BEHAVIOURS)
    s = RewardScorer(reward_cfg(f"{f}:behave", num_workers=2, timeout=LIMIT, fallback_score=-1.0,
                                max_error_fraction=0.5))
    s.score(["warm"], [0])                     # wait for the workers once, outside any timing
    yield s
    s.close()


def worker_pids(s):
    return {w.proc.pid for w in s.pool._workers}


def test_sleeping_forever_costs_at_most_the_limit_and_scoring_continues(scorer, caplog):
    before = [w.proc for w in scorer.pool._workers]
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fitrl.rewards"):
        out = scorer.score(["a", "hang", "b", "hang", "c"], [1, 2, 3, 4, 5], [f"t.jsonl:{i}" for i in range(5)])
    scores, comps = out.scores, out.components
    elapsed = time.monotonic() - t0
    assert scores.tolist() == [1.0, -1.0, 3.0, -1.0, 5.0]          # the fallback, never a silent 0
    assert comps["extra"].tolist() == [0.0] * 5
    assert out.health["reward/timeouts"] == 2.0 and out.health["reward/errors"] == 0.0
    assert out.health["reward/worker_restarts"] == 2.0
    # Two workers, two hangs: one limit each in parallel plus start-up, ~2.7 s; 10x slack for a loaded
    # machine still tells a bounded call from the hang (10**6 s). The counts above are the exact checks.
    assert elapsed < 10 * (2 * LIMIT + 1.5), elapsed
    logged = [r.getMessage() for r in caplog.records if "timed out" in r.getMessage()]
    assert len(logged) == 2 and "'hang'" in logged[0] and "t.jsonl:1" in logged[0]
    # The hung workers were killed, and the pool scores on with their replacements.
    assert all(p.poll() is not None for p in before if p.pid not in worker_pids(scorer))
    out = scorer.score(["a", "b"], [7, 8])
    assert out.scores.tolist() == [7.0, 8.0] and out.health["reward/timeouts"] == 0.0


def test_every_call_is_bounded_even_when_all_hang(scorer):
    t0 = time.monotonic()
    out = scorer.score(["hang"] * 4, [0] * 4)
    assert out.scores.tolist() == [-1.0] * 4 and out.health["reward/timeouts"] == 4.0
    # 4 calls over 2 workers: 2 rounds of one limit each, plus the replacements' start-up (10x slack).
    assert time.monotonic() - t0 < 10 * (2 * LIMIT + 3.0)


def test_raising_and_dying_calls_get_the_fallback_and_are_reported(scorer, caplog):
    with caplog.at_level(logging.WARNING, logger="fitrl.rewards"):
        out = scorer.score(["raise", "a", "exit", "b", "c"], [1] * 5, [f"e.jsonl:{i}" for i in range(5)],
                           extras=[{}, {"w": 2}, {}, {}, {}])
    scores, comps = out.scores, out.components
    assert scores.tolist() == [-1.0, 1.0, -1.0, 1.0, 1.0] and comps["extra"].tolist() == [0, 2, 0, 0, 0]
    assert out.health["reward/errors"] == 2.0 and out.health["reward/timeouts"] == 0.0
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "KeyError: 'no such field'" in text and "'raise'" in text and "e.jsonl:0" in text
    assert "in behave" in text                                       # the worker's traceback comes along
    assert "worker process died (exit code 3)" in text and "e.jsonl:2" in text
    # Over max_error_fraction the function is broken, not unlucky: the run stops with the sample.
    with pytest.raises(RewardError, match=r"behave raised KeyError: 'no such field' on response 'raise'.*"
                                          r"2 of 3 responses raised"):
        scorer.score(["raise", "raise", "a"], [1] * 3)


@pytest.mark.parametrize("response,message", [
    ("str", "behave returned str"),
    ("unpicklable", "behave returned _Unpicklable .*function"),
])
def test_wrong_return_type_fails_naming_the_function(scorer, response, message):
    with pytest.raises(RewardError, match=message):
        scorer.score(["a", response], [1, 1])
    assert scorer.score(["a"], [1]).scores.tolist() == [1.0]               # the pool is still usable


def test_work_is_spread_over_the_workers(scorer):
    deadline = time.monotonic() + 10      # a worker replaced by an earlier test may still be starting
    while True:
        pids = set(scorer.score(["pid"] * 16, [0] * 16).scores.tolist())
        if len(pids) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert pids == {float(p) for p in worker_pids(scorer)}


def test_pathological_math_is_cut_at_the_limit():
    """sympy evaluating a power tower never returns; math-verify's signal timeout is off in the pool."""
    with RewardScorer(reward_cfg("math", num_workers=2, timeout=1.0)) as s:
        responses = [r"\boxed{\frac{1}{2}}", r"\boxed{9^{9^{9^{9}}}}", "The answer is 0.5", r"\boxed{2}"]
        t0 = time.monotonic()
        out = s.score(responses, ["0.5"] * 4)
        scores, comps = out.scores, out.components
        assert time.monotonic() - t0 < 10 * (1.0 + 5.0)              # start-up included; 10x slack
        assert scores.tolist() == pytest.approx([1.0, 0.0, 1.0, 0.1]) and out.health["reward/timeouts"] == 1.0
        assert comps["accuracy"].tolist() == [1.0, 0.0, 1.0, 0.0]
        serial = RewardScorer(reward_cfg("math", num_workers=0))     # same verdicts without the pool
        keep = [0, 2, 3]
        assert serial.score([responses[i] for i in keep], ["0.5"] * 3).scores.tolist() == [scores[i] for i in keep]


def test_batched_call_is_bounded_as_one_call(tmp_path):
    f = tmp_path / "batch_hang.py"
    f.write_text("import time\ndef slow(responses, answers):\n    time.sleep(10**6)\n")
    with RewardScorer(reward_cfg(f"{f}:slow", batched=True, num_workers=1, timeout=LIMIT)) as s:
        out = s.score(["a", "b", "c"], [0] * 3)
        assert out.scores.tolist() == [0.0] * 3 and out.health["reward/timeouts"] == 3.0


def test_module_reference_resolves_in_the_workers(tmp_path, monkeypatch):
    pkg = tmp_path / "my_rewards_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text("def exact(response, answer, bonus=0.0):\n"
                                    "    return float(response == answer) + bonus\n")
    monkeypatch.syspath_prepend(str(tmp_path))           # the workers get the driver's sys.path
    with RewardScorer(reward_cfg("my_rewards_pkg.scoring:exact", {"bonus": 0.5}, num_workers=1)) as s:
        assert s.score(["a", "b"], ["a", "a"]).scores.tolist() == [1.5, 0.5]


def test_close_stops_the_workers(tmp_path):
    s = RewardScorer(reward_cfg("arith", num_workers=2))
    assert s.score(["7"], [7]).scores.tolist() == [1.0]
    procs = [w.proc for w in s.pool._workers]
    s.close()
    assert all(p.poll() is not None for p in procs)
    with pytest.raises(RuntimeError, match="closed"):
        s.score(["7"], [7])


@pytest.mark.parametrize("workers", [0, 2])
def test_a_raising_function_shows_its_own_frames_once(tmp_path, caplog, workers):
    """The user's frames, none of fitrl's worker frames, on the first failure; one line after."""
    import logging

    from fitrl.config.algorithm import RewardConfig
    from fitrl.roles.reward import RewardScorer

    f = tmp_path / "raising.py"
    f.write_text("def helper(x):\n    return 1 / x\n\n\ndef reward(response, answer):\n    return helper(len(response) % 2)\n")
    caplog.set_level(logging.WARNING, logger="fitrl.rewards")
    with RewardScorer(RewardConfig(function=f"{f}:reward", num_workers=workers, max_error_fraction=1.0)) as scorer:
        assert scorer.score(["ab", "abc", "abcd"], ["1"] * 3).scores.tolist() == [0.0, 1.0, 0.0]
    first, second = [r.getMessage() for r in caplog.records if "raised on" in r.getMessage()]
    assert f'File "{f}", line 2, in helper' in first and "return 1 / x" in first
    assert "fitrl/rewards" not in first and "fitrl/roles" not in first
    assert second.endswith("ZeroDivisionError: division by zero") and "\n" not in second
