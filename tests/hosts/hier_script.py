"""Hierarchical reduction on several hosts (run by tests/hosts under torchrun).

Checks, reported by rank 0 as ``RESULT {...}``:
* hierarchy="node" with NoCompression gives the flat average of every rank's gradients;
* hierarchy="auto" picks node here, and with OneBit (several buckets, pipelined) every rank
  ends with the same gradients;
* a NaN on one rank raises NonFiniteError on every rank of both hosts (with "skip": every
  rank's OneBit says last_skipped), and the next step trains on;
* hierarchy="flat" is not wrapped.
"""

from __future__ import annotations

import json

import torch
from torch import nn

import overlap
from overlap import comm


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))


def _nan_at_00(g: torch.Tensor) -> torch.Tensor:
    g = g.clone()
    g[0, 0] = float("nan")
    return g


def _grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _same(t: torch.Tensor) -> bool:
    lo, hi = t.clone(), t.clone()
    comm.all_reduce(lo, op="min")
    comm.all_reduce(hi, op="max")
    return bool(torch.equal(lo, hi))


def _onebit_buckets(
    model: nn.Module, hierarchy: str, onebit: overlap.OneBit | None = None
) -> overlap.BucketScheduler:
    """OneBit over several small buckets, so their reductions are pipelined."""
    return overlap.BucketScheduler(
        model,
        compression=onebit or overlap.OneBit(),
        hierarchy=hierarchy,
        bucket_cap_mb=0.002,
        first_bucket_mb=0.002,
    )


def main() -> None:
    overlap.init_distributed()
    rank = comm.get_rank()
    out: dict[str, object] = {}
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))

    model = _model()
    sched = overlap.BucketScheduler(
        model, hierarchy="node", bucket_cap_mb=0.002, first_bucket_mb=0.002
    )
    model(x).pow(2).mean().backward()
    sched.synchronize()
    ours = _grads(model)
    out["node_buckets"] = len(sched.buckets)
    sched.remove()
    plain = _model()
    plain(x).pow(2).mean().backward()
    ref = _grads(plain)
    comm.all_reduce(ref, op="avg")
    out["node_none_err"] = float((ours - ref).abs().max())
    out["node_none_same"] = _same(ours)

    model = _model()
    # several buckets: their reductions are pipelined, 1-bit phases between hosts included
    sched = _onebit_buckets(model, "auto")
    out["auto_wrapped"] = sched.hierarchical
    out["auto_stats"] = sched.statistics()["compression"]
    same = True
    for step in range(3):
        model.zero_grad()
        model(x * (step + 1)).pow(2).mean().backward()
        sched.synchronize()
        same &= _same(_grads(model))
    out["auto_onebit_same"] = same
    out["auto_buckets"] = len(sched.buckets)
    sched.remove()

    # a NaN on one rank reaches one chunk, reduced by one rank per host: every rank on both
    # hosts raises NonFiniteError together (or, with "skip", says last_skipped with every
    # gradient NaN), and the next step trains on
    for mode in ("raise", "skip"):
        model = _model()
        onebit = overlap.OneBit(on_nonfinite=mode)
        sched = _onebit_buckets(model, "node", onebit)
        nan: list[object] = []
        for step in range(3):
            model.zero_grad()
            hook = None
            if step == 1 and rank == comm.get_world_size() - 1:
                # in backward (a .grad written after it drops the step on every rank)
                hook = model[0].weight.register_hook(_nan_at_00)
            model(x * (step + 1)).pow(2).mean().backward()
            if hook is not None:
                hook.remove()
            try:
                sched.synchronize()
                flags = torch.tensor([float(onebit.last_skipped)])
                if not _same(flags):
                    nan.append("skipped on some ranks only")
                elif onebit.last_skipped:  # on every rank, every gradient NaN
                    nan_all = all(bool(p.grad.isnan().all()) for p in model.parameters())
                    nan.append("skipped" if nan_all else "skipped, some gradient not NaN")
                else:
                    nan.append("ok" if _same(_grads(model)) else "differ")
            except overlap.NonFiniteError:
                nan.append("NonFiniteError")
        out[f"node_nan_{mode}"] = nan
        sched.remove()

    sched = overlap.BucketScheduler(_model(), hierarchy="flat")
    out["flat_wrapped"] = sched.hierarchical
    sched.remove()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
