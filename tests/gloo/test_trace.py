"""A real 2-rank traced run: both ranks, every bucket, comm starting before backward ends."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from overlap.testing import RankPool
from overlap.trace import OverlapReport, load_spans
from tests.gloo import trace_cases


def test_merged_trace_shows_both_ranks_every_bucket_and_overlap(
    pools: Callable[[int], RankPool], tmp_path: Path
) -> None:
    path = str(tmp_path / "trace.json")
    res = pools(2).run(trace_cases.traced_training, path, timeout=120)
    assert res[0]["written"] == path and res[1]["written"] is None  # rank 0 writes
    doc = json.loads(Path(path).read_text())
    assert doc["otherData"]["world_size"] == 2
    spans, world = load_spans(path)
    by_rank = defaultdict(list)
    for s in spans:
        by_rank[s[5]["rank"]].append(s)
    assert sorted(by_rank) == [0, 1]
    for r, ss in by_rank.items():
        buckets = {s[5]["bucket"] for s in ss if s[1] == "bucket"}
        assert buckets == set(range(res[r]["buckets"])), (r, buckets)
        backward = sorted((s[2], s[3]) for s in ss if s[0] == "backward")
        comms = sorted(s[2] for s in ss if s[1] == "comm")
        assert len(backward) == 3
        for b0, b1 in backward:  # in every step a collective began before backward ended
            assert any(b0 <= c < b1 for c in comms), (r, b0, b1)
        assert any(s[0] == "forward" for s in ss)
        assert sum(1 for s in ss if s[1] == "step") == 3
    rep = OverlapReport.from_spans(spans, world=world)
    assert rep.ranks == 2 and len(rep.steps) >= 3 and rep.comm_ms > 0
    assert 0 < rep.overlap_ratio <= 1
    assert any(o["op"] == "all_reduce" for o in rep.ops)


def test_export_on_one_rank_only_says_the_export_is_collective(
    short_pool: RankPool, tmp_path: Path
) -> None:
    from tests.conftest import SHORT_TIMEOUT

    path = tmp_path / "trace.json"
    out = short_pool.run(
        trace_cases.export_on_rank_0_only, str(path), SHORT_TIMEOUT + 3, timeout=60
    )
    assert out[1] == "not called"
    assert out[0].startswith("CommError: Tracer.export_chrome on rank 0 failed"), out[0]
    assert "every rank of the job calls it" in out[0] and "if rank == 0" in out[0], out[0]
    assert not path.exists()


def test_a_path_rank_0_cannot_write_fails_the_export_on_every_rank(
    pools: Callable[[int], RankPool], tmp_path: Path
) -> None:
    r0, r1 = pools(2).run(
        trace_cases.export_to_a_path_rank_0_cannot_write, str(tmp_path), timeout=60
    )
    assert r0[0].startswith("FileNotFoundError: cannot write the trace to an empty path"), r0
    assert r0[1].startswith("IsADirectoryError: cannot write the trace to"), r0
    assert r0[2].startswith("FileNotFoundError: cannot write the trace to"), r0
    assert "no such directory" in r0[2], r0
    for got in r1[:3]:  # the other rank raises too, and says where to look
        assert got.startswith("OSError: Tracer.export_chrome: rank 0, which writes"), r1
        assert "cannot write to the path it was given; nothing was written" in got, r1
    good = str(tmp_path / "good.json")
    assert r0[3] == f"then: {good}" and r1[3] == "then: None", (r0, r1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.json"]
    spans, world = load_spans(good)
    assert world == 2 and {s[5]["rank"] for s in spans} == {0, 1}


def test_remove_detaches_the_tracer_the_scheduler_attached(
    pools: Callable[[int], RankPool],
) -> None:
    for got in pools(2).run(trace_cases.tracer_released_by_remove, timeout=120):
        for name in ("first", "second"):
            assert got[f"{name}_attached"] and got[f"{name}_detached"], got
            assert got[f"{name}_comm_spans"] > 0, got
        assert got["user_attached_kept"] and got["held_by_the_other"], got
        assert got["released_by_both"], got
        assert got["diloco_holds"] and got["diloco_released"], got
