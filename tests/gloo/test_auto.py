"""compression="auto": measured choice, agreement across ranks, hysteresis, DDP's inline path."""

from __future__ import annotations

from collections.abc import Callable

from overlap.testing import RankPool
from tests.gloo import auto_cases as ac


def test_auto_picks_by_the_slowest_rank_and_keeps_its_choice(
    pools: Callable[[int], RankPool],
) -> None:
    res = pools(2).run(ac.picks_the_fastest_by_the_slowest_rank, timeout=120)
    for out in res:
        assert out["same"], "gradients differ across ranks"
        # 2 candidates x (1 settle + 2 measured) steps: decided at the end of step 6
        assert out["chosen_at"] == [None] * 5 + ["b"] * 3, out["chosen_at"]
        first = out["first"]
        assert first["choice"] == "b" and first["decided_at"] == 6, first
        assert first["costs_ms"]["a"] >= 140, first  # rank 1's cost, not rank 0's
        assert 18 <= first["costs_ms"]["b"] < 140, first
        kept = out["kept"]
        assert kept["choice"] == "b" and not kept["measuring"], kept
        switched = out["switched"]
        assert switched["choice"] == "a", switched
        assert [h[1] for h in switched["history"]] == ["b", "a"], switched
        assert out["lines"][0].startswith("auto: reducing with b from step 6"), out["lines"]
        assert "was b" in out["lines"][-1], out["lines"]
    assert res[0]["instants"] == ["auto: b", "auto: b", "auto: a"], res[0]["instants"]
    assert res[0]["switched"]["costs_ms"] == res[1]["switched"]["costs_ms"]


def test_one_stalled_step_does_not_decide(pools: Callable[[int], RankPool]) -> None:
    for out in pools(2).run(ac.one_stalled_step_does_not_decide, timeout=60):
        assert out["choice"] == "none", out
        assert out["costs_ms"]["none"] < 140 <= out["costs_ms"]["b"], out


def test_auto_choosing_none_runs_ddps_inline_path(pools: Callable[[int], RankPool]) -> None:
    for out in pools(2).run(ac.none_chosen_takes_the_inline_path_and_equals_ddp, timeout=60):
        assert out["choice"] == "none", out
        assert out["worst"] < 1e-6, out
        # steps 1-7: none (steps 0-2 on trial), b (3-5), then none, inline again
        assert out["inline"] == [True, True, False, False, False, True, True], out


def test_default_auto_agrees_and_resumes(pools: Callable[[int], RankPool]) -> None:
    for out in pools(2).run(ac.default_auto_agrees_and_resumes, timeout=120):
        assert out["same"] and out["agree"], out
        stats = out["stats"]
        # 4 candidates x (1 + 3) steps
        assert stats["decided_at"] == 16 and stats["choice"] in stats["costs_ms"], stats
        assert set(stats["costs_ms"]) == {"none", "fp16", "onebit", "powersgd"}, stats
        assert out["resumed"] == out["mid"], (out["resumed"], out["mid"])
        assert out["mid"]["measuring"] and out["mid"]["active"] == "onebit", out["mid"]


def test_auto_bad_input_is_refused_clearly(pools: Callable[[int], RankPool]) -> None:
    out = pools(2).run(ac.bad_auto_input, timeout=60)[0]
    assert "the one name taken is 'auto'" in out["string"], out
    assert "at least one candidate" in out["empty"], out
    assert "Compressor instances" in out["not a compressor"], out
    assert "distinct objects" in out["same object twice"], out
    assert "distinct names" in out["same name"], out
    assert "remeasure_every=5" in out["remeasure too soon"], out
    assert "margin" in out["margin"], out
    assert "trial_steps" in out["trial"], out
    assert "same candidates" in out["other candidates"], out
