"""PowerSGD (Vogels et al.), as in PyTorch's ``powerSGD_hook``, for any backend.

Per bucket: tensors of two or more dimensions are viewed as n x m matrices M (first dim x
the rest) and compressed to rank r when that saves at least ``min_compression_rate`` x:

1. M <- M + error (error feedback)
2. P = M Q  (Q: m x r, warm-started from the previous step; the first one is drawn from a
   generator seeded identically on every rank)
3. allreduce all P's at once (average), orthogonalize each P (QR)
4. Q = M^T P; allreduce all Q's at once (average)
5. approx = P Q^T; error <- M - approx; the tensor becomes approx

1-D tensors (biases, norms) and tensors that would not shrink enough are averaged
uncompressed, in the first phase's allreduce. For the first ``start_iter`` steps of a bucket
everything is averaged uncompressed, without error feedback (PowerSGD's start iteration).

A non-finite input (or an average that overflows) shows in step 3's averages on every rank
alike (a NaN flag rides along for the case a matrix would hide it: a zero column of Q times
an Inf may be skipped by the matrix product). Step 4 is still issued (with zeros: the
collectives never depend on the values), the error and the Q's are left as they were, the
buffer is NaN, and ``on_nonfinite`` says whether NonFiniteError is raised
(:mod:`overlap.compression.nonfinite`). torch's ``powerSGD_hook`` keeps the NaN in its
warm-start Q: under a loss scaler every later step is NaN and skipped. (During the
``start_iter`` steps there is no state to protect: a NaN goes through the plain average to
every rank, as under DDP, and nothing is raised.)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from overlap import comm
from overlap.argcheck import count, positive_real
from overlap.comm.steps import Steps
from overlap.compression.base import Compressor
from overlap.compression.nonfinite import SkipsNonFinite, nan_result
from overlap.errors import NonFiniteError

__all__ = ["PowerSGD"]


class PowerSGD(SkipsNonFinite, Compressor):
    """Rank-``rank`` PowerSGD with error feedback and warm start (summable: allreduce-based).

    ``on_nonfinite``: ``"raise"`` (default) or ``"skip"`` a step whose input holds NaN or
    Inf; either way the buffer is NaN and the state untouched (see the module doc)."""

    name = "powersgd"
    summable = True

    def __init__(
        self,
        rank: int = 1,
        start_iter: int = 10,
        min_compression_rate: float = 2.0,
        warm_start: bool = True,
        seed: int = 0,
        on_nonfinite: str = "raise",
    ) -> None:
        self._init_nonfinite(on_nonfinite)
        self.rank = count("rank", rank, 1)
        self.start_iter = count("start_iter", start_iter, 0)
        self.min_compression_rate = positive_real(
            "min_compression_rate", min_compression_rate, zero=True
        )
        self.warm_start = warm_start
        self.seed = seed
        self.state: dict[Any, dict[str, Any]] = {}

    def __repr__(self) -> str:
        return (
            f"PowerSGD(rank={self.rank}, start_iter={self.start_iter}, "
            f"on_nonfinite={self.on_nonfinite!r})"
        )

    def _plan(self, shapes: Sequence[torch.Size]) -> list[tuple[int, int, int, int, bool]]:
        """(offset, numel, n, m, compress) per tensor of the bucket."""
        plan, off = [], 0
        for shape in shapes:
            numel = 1
            for d in shape:
                numel *= int(d)
            n = int(shape[0]) if len(shape) >= 2 else numel
            m = numel // n if len(shape) >= 2 and n else 1
            r = min(self.rank, n, m)
            compress = (
                len(shape) >= 2 and r >= 1 and n * m >= self.min_compression_rate * r * (n + m)
            )
            plan.append((off, numel, n, m, compress))
            off += numel
        return plan

    def reduce_steps(
        self,
        key: Hashable,
        flat: torch.Tensor,
        *,
        group: Any = None,
        shapes: Sequence[torch.Size] | None = None,
        outputs: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> Steps:
        shapes = list(shapes) if shapes is not None else [flat.shape]
        if sum(int(torch.Size(s).numel()) for s in shapes) != flat.numel():
            raise ValueError(
                f"shapes {shapes} do not add up to the bucket's {flat.numel()} elements"
            )
        st = self.state.setdefault(key, {"step": 0, "numel": flat.numel(), "error": None, "qs": {}})
        if st["numel"] != flat.numel():
            raise ValueError(
                f"bucket {key!r} had {st['numel']} elements in the state but "
                f"has {flat.numel()} now; the model or bucket layout changed"
            )
        plan = self._plan(shapes)
        if st["step"] < self.start_iter or not any(p[4] for p in plan):
            yield [comm.all_reduce(flat, op="avg", group=group, async_op=True)]
            st["step"] += 1
            return flat

        # float32 (a half-precision bucket computed wider), float64 kept: a float64 model's
        # uncompressed tensors are averaged exactly as DDP's would be, not rounded to
        # float32 (torch's powerSGD_hook keeps the bucket's dtype too)
        wide = flat.dtype in (torch.float32, torch.float64)
        data = flat if wide else flat.float()
        if st["error"] is None:
            st["error"] = torch.zeros_like(data)
        data.add_(st["error"])  # error feedback on the whole bucket (exact parts stay exact)

        dense = [(o, k) for o, k, _, _, c in plan if not c]
        mats = [(i, o, k, n, m) for i, (o, k, n, m, c) in enumerate(plan) if c]
        Ms = [data[o : o + k].view(n, m) for _, o, k, n, m in mats]
        Qs = []
        for (i, _, _, n, m), M in zip(mats, Ms, strict=True):
            r = min(self.rank, n, m)
            q = st["qs"].get(i) if self.warm_start else None
            if q is None or q.shape != (m, r):
                gen = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
                q = torch.randn(m, r, generator=gen).to(M.device)
            Qs.append(q.to(M.dtype))  # a float32 draw (the same values for every dtype)
        Ps = [M @ q for M, q in zip(Ms, Qs, strict=True)]
        # the P's, then a flag: NaN where this rank's input is not finite. Defensive: an
        # Inf times an exact zero of Q (a matrix that was all zeros last step) is NaN in
        # torch's products here (measured), but a BLAS may skip zero factors, and the
        # averages would then hide it. A sum is one pass with no allocation; it overflows
        # only where the values near float32's largest, and a P would too.
        p_flat = torch.cat(
            [*(p.reshape(-1) for p in Ps), torch.zeros(1, dtype=data.dtype, device=data.device)]
        )
        if not bool(torch.isfinite(data.sum())):
            p_flat[-1] = float("nan")
        dense_flat = torch.cat([data[o : o + k] for o, k in dense]) if dense else None

        hs = [comm.all_reduce(p_flat, op="avg", group=group, async_op=True)]
        if dense_flat is not None:
            hs.append(comm.all_reduce(dense_flat, op="avg", group=group, async_op=True))
        yield hs

        # every rank holds the same averages: every rank decides alike
        if not (
            bool(torch.isfinite(p_flat).all())
            and (dense_flat is None or bool(torch.isfinite(dense_flat).all()))
        ):
            q_len = sum(m * min(self.rank, n, m) for _, _, _, n, m in mats)
            zeros = torch.zeros(q_len, dtype=data.dtype, device=data.device)
            yield [comm.all_reduce(zeros, op="avg", group=group, async_op=True)]
            nan_result(flat)
            self._nonfinite(
                NonFiniteError(
                    "PowerSGD: a rank's input (or the average) holds NaN or Inf; the error and "
                    "warm-start state were left unchanged on every rank and the buffer is NaN",
                    ranks=[],
                )
            )
            return flat

        off = 0
        for j, p in enumerate(Ps):
            p.copy_(p_flat[off : off + p.numel()].view_as(p))
            off += p.numel()
            Ps[j] = torch.linalg.qr(p).Q  # orthogonalize (reduced QR)
        Qn = [M.T @ p for M, p in zip(Ms, Ps, strict=True)]
        q_flat = torch.cat([q.reshape(-1) for q in Qn])
        yield [comm.all_reduce(q_flat, op="avg", group=group, async_op=True)]

        off = 0
        for j, ((i, o, k, _, _), M, p) in enumerate(zip(mats, Ms, Ps, strict=True)):
            q = q_flat[off : off + Qn[j].numel()].view_as(Qn[j])
            off += q.numel()
            approx = p @ q.T
            st["error"][o : o + k].copy_((M - approx).reshape(-1))
            data[o : o + k].copy_(approx.reshape(-1))
            st["qs"][i] = q.clone()
        off = 0
        for o, k in dense:
            assert dense_flat is not None
            data[o : o + k].copy_(dense_flat[off : off + k])
            st["error"][o : o + k].zero_()
            off += k
        if data is not flat:
            flat.copy_(data)
        st["step"] += 1
        return flat

    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rank": self.rank,
            "start_iter": self.start_iter,
            "state": {
                k: {
                    "step": v["step"],
                    "numel": v["numel"],
                    "error": None if v["error"] is None else v["error"].clone(),
                    "qs": {i: q.clone() for i, q in v["qs"].items()},
                }
                for k, v in self.state.items()
            },
        }

    def check_state(self, state: dict[str, Any]) -> None:
        super().check_state(state)
        if state.get("rank") != self.rank:
            raise ValueError(
                f"this state was made with rank {state.get('rank')}, this "
                f"PowerSGD has rank {self.rank}"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.start_iter = int(state.get("start_iter", self.start_iter))
        self.state = {
            k: {
                "step": v["step"],
                "numel": v["numel"],
                "error": None if v["error"] is None else v["error"].clone(),
                "qs": {i: q.clone() for i, q in v["qs"].items()},
            }
            for k, v in state["state"].items()
        }
