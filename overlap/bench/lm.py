"""``overlap bench lm``: does a compressed optimizer train a language model as well as DDP?

A small GPT-style byte-level transformer trained on real English text that ships with
Python (the ``pydoc_data.topics`` help texts, about 465 KB: 90% train, 10% held out), on W
gloo ranks, each rank drawing its own batches. Every variant starts from the same weights
and sees the same batches, one variant after the other:

* ``ddp-adamw``: DDP with torch's AdamW (fp32 allreduce every step), the baseline;
* ``overlap-onebitadam``: :class:`overlap.OneBitAdam` overlapped by a BucketScheduler;
* ``overlap-onebitadam-bc``: the same with ``bias_correction=True`` (AdamW's correction);
* ``onebitadam-serial``: OneBitAdam standalone (``step()`` communicates, as DeepSpeed);
* ``overlap-onebit-adamw``: raw-gradient 1-bit (``OneBit``) under AdamW, for comparison;
* ``onebitadam-nofreeze``: OneBitAdam that never freezes: the same Adam (no bias correction)
  with an fp32 allreduce every step, so the compression's own effect shows apart from the
  optimizer's;
* ``diloco[-stream][-int8|-bf16|-fp8][-hH][-fF][-dD][-olrX][-omY][-aA]``: :class:`overlap.DiLoCo`
  over AdamW (inner), e.g. ``diloco-h8`` (sync every 8 steps, the default outer optimizer),
  ``diloco-stream-int8-h8`` (4 fragments, delay 1, Int8 pseudo-gradients),
  ``diloco-h8-olr0.7-om0.9`` (the outer Nesterov SGD's lr and momentum; ``-om0`` is plain
  SGD, ``-olr1-om0`` plain averaging; ``-aA`` the merge's alpha).

Reported per variant: the training loss per step (averaged over ranks), the held-out loss
at the end, the wall time, and the bytes issued per step before and after the freeze as the
comm observer sees them (each op's payload; DDP's are counted as its fp32 allreduce).
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

import torch
from torch import nn

from overlap.bench.stopping import interrupt_once

__all__ = [
    "LM_VARIANTS",
    "TinyGPT",
    "bench_lm_rank",
    "corpus",
    "diloco_spec",
    "known_variant",
    "time_to_loss",
]

LM_VARIANTS = [
    "ddp-adamw",
    "onebitadam-nofreeze",
    "overlap-onebitadam",
    "overlap-onebitadam-bc",
    "onebitadam-serial",
    "overlap-onebit-adamw",
]


_DILOCO = re.compile(
    r"^diloco(?P<stream>-stream)?(?:-(?P<comp>int8|bf16|fp8))?(?:-h(?P<h>\d+))?"
    r"(?:-f(?P<f>\d+))?(?:-d(?P<d>\d+))?(?:-olr(?P<olr>[\d.]+))?(?:-om(?P<om>[\d.]+))?(?:-a(?P<a>[\d.]+))?$"
)


def diloco_spec(name: str) -> dict[str, Any] | None:
    """The DiLoCo settings a variant name spells, or None if it is not a DiLoCo variant."""
    m = _DILOCO.match(name)
    if m is None:
        return None
    stream = m["stream"] is not None
    return {
        "compression": m["comp"],
        "sync_every": int(m["h"] or 8),
        "fragments": int(m["f"] or (4 if stream else 1)),
        "delay": int(m["d"] or (1 if stream else 0)),
        "outer_lr": None if m["olr"] is None else float(m["olr"]),
        "outer_momentum": None if m["om"] is None else float(m["om"]),
        "alpha": None if m["a"] is None else float(m["a"]),
    }


def known_variant(name: str) -> bool:
    """A fixed variant, or a DiLoCo spelling :func:`diloco_spec` reads."""
    return name in LM_VARIANTS or diloco_spec(name) is not None


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) byte tensors of the pydoc topics text, split 90/10."""
    import pydoc_data.topics as topics

    text = "\n".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    cut = int(len(data) * 0.9)
    return data[:cut], data[cut:]


class TinyGPT(nn.Module):
    """A pre-norm GPT: byte embeddings, learned positions, causal self-attention blocks."""

    mask: torch.Tensor

    def __init__(self, layers: int = 4, width: int = 256, heads: int = 4, seq: int = 128) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, width)
        self.pos = nn.Parameter(torch.zeros(seq, width))
        block = nn.TransformerEncoderLayer(
            width,
            heads,
            4 * width,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        out: torch.Tensor = self.head(self.norm(h))
        return out


def _batch(data: torch.Tensor, gen: torch.Generator, batch: int, seq: int) -> torch.Tensor:
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
    return torch.stack([data[s : s + seq + 1] for s in starts.tolist()])


def _loss(model: nn.Module, xy: torch.Tensor) -> torch.Tensor:
    logits = model(xy[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, 256), xy[:, 1:].reshape(-1))


def _setup(name: str, model: nn.Module, lr: float, freeze: int) -> tuple[Any, Any, Any]:
    """(forward module, optimizer, scheduler or DiLoCo) for one variant."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import overlap
    from overlap import BucketScheduler, DiLoCo, OneBit, OneBitAdam
    from overlap.optim import diloco as dl

    spec = diloco_spec(name)
    if spec is not None:
        inner = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        outer = None
        if spec["outer_lr"] is not None or spec["outer_momentum"] is not None:
            olr = dl.OUTER_LR if spec["outer_lr"] is None else spec["outer_lr"]
            om = dl.OUTER_MOMENTUM if spec["outer_momentum"] is None else spec["outer_momentum"]
            outer = torch.optim.SGD(model.parameters(), lr=olr, momentum=om, nesterov=om > 0)
        comp = {None: None, "int8": overlap.Int8, "bf16": overlap.BF16, "fp8": overlap.FP8}[
            spec["compression"]
        ]
        d = DiLoCo(
            model,
            inner,
            outer,
            sync_every=spec["sync_every"],
            fragments=spec["fragments"],
            delay=spec["delay"],
            compression=comp() if comp is not None else None,
            alpha=0.0 if spec["alpha"] is None else spec["alpha"],
        )
        return model, inner, d

    if name == "ddp-adamw":
        return DDP(model), torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0), None
    if name == "overlap-onebit-adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        return model, opt, BucketScheduler(model, compression=OneBit(warmup_steps=freeze))
    if name == "onebitadam-nofreeze":
        return model, OneBitAdam(model.parameters(), lr=lr, freeze_step=1 << 30), None
    bc = name.endswith("-bc")
    adam = OneBitAdam(model.parameters(), lr=lr, freeze_step=freeze, bias_correction=bc)
    if name.startswith("overlap-onebitadam"):
        return model, adam, BucketScheduler(model, optimizer=adam)
    return model, adam, None


def _held_out(model: nn.Module, evals: torch.Tensor, batch: int, n: int) -> float:
    """The mean loss over the ``n`` held-out batches."""
    with torch.no_grad():
        return sum(float(_loss(model, evals[i * batch : (i + 1) * batch])) for i in range(n)) / n


@interrupt_once  # a rank stopped by Ctrl-C says nothing more
def bench_lm_rank(
    variants: list[str],
    steps: int,
    freeze: int,
    lr: float = 1e-3,
    batch: int = 16,
    seq: int = 64,
    layers: int = 2,
    width: int = 128,
    eval_batches: int = 8,
    diloco_steps: int | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Train each variant for ``steps`` steps (DiLoCo variants ``diloco_steps``, default the
    same) on this rank; rank 0's rows are the result. ``seed`` sets the model's
    initialisation and each rank's batch order (0: the figures in docs/diloco.md); the
    held-out batches are the same for every seed."""
    from overlap import comm
    from overlap.comm import hooks

    torch.set_num_threads(1)
    rank, w = comm.get_rank(), comm.get_world_size()
    train, held = corpus()
    evals = _batch(held, torch.Generator().manual_seed(12345), eval_batches * batch, seq)
    rows = []
    for name in variants:
        is_diloco = diloco_spec(name) is not None
        n_steps = diloco_steps if is_diloco and diloco_steps else steps
        torch.manual_seed(seed)
        model = TinyGPT(layers, width, seq=seq)
        nparams = sum(p.numel() for p in model.parameters())
        fwd, opt, sched = _setup(name, model, lr, freeze)
        sent = [0]

        def observe(
            op: str, t0: int, t1: int, nbytes: int, *rest: Any, box: list[int] = sent
        ) -> None:
            if not op.startswith("bucket"):  # a scheduler bucket: its ops are counted
                box[0] += nbytes

        hooks.set_observer(observe)
        gen = torch.Generator().manual_seed(1000 + rank + 7919 * seed)
        losses, per_step, clock = [], [], []
        stats: dict[str, Any] = {}
        comm.barrier()
        t0 = time.perf_counter()
        try:
            for _ in range(n_steps):
                xy = _batch(train, gen, batch, seq)
                start = sent[0]
                opt.zero_grad()
                loss = _loss(fwd, xy)
                loss.backward()  # type: ignore[no-untyped-call]
                if sched is not None and not is_diloco:
                    sched.synchronize()
                opt.step()
                if is_diloco:
                    sched.step()
                per_step.append(sent[0] - start)
                losses.append(float(loss.detach()))
                clock.append(round(time.perf_counter() - t0, 4))
            if is_diloco:
                sched.flush()  # the last fragments in flight land before the evaluation
            wall = time.perf_counter() - t0
            held_loss = _held_out(model, evals, batch, eval_batches)
            # DiLoCo's global weights too (the outer optimizer's result, the same on every
            # rank): with fragments, the local weights also hold up to H - 1 steps of this
            # rank's own training since each fragment last landed.
            held_global = held_final = held_loss
            if is_diloco:
                with sched.global_weights():
                    held_global = _held_out(model, evals, batch, eval_batches)
                # and the model DiLoCo.finish() ends on: one more sync of every fragment
                # the ranks hold apart, the same weights on every rank (none synced, as
                # for plain DiLoCo ending on a sync: the weights evaluated above)
                syncs = sched.syncs
                sched.finish()
                if sched.syncs != syncs:
                    held_final = _held_out(model, evals, batch, eval_batches)
        finally:
            hooks.set_observer(None)
            if sched is not None:
                stats = sched.statistics() if is_diloco else {}
                sched.remove()
        mean = torch.tensor([*losses, held_loss, held_global, held_final], dtype=torch.float64)
        comm.all_reduce(mean, op="avg")  # DiLoCo's local weights differ: every rank's loss
        held_loss, held_global, held_final = (float(x) for x in mean[-3:])
        mean = mean[:-3]
        fp32 = nparams * 4
        ring = 2 * (w - 1) * fp32 // w  # what a rank sends in an fp32 ring allreduce
        if name == "ddp-adamw":
            per_step = [fp32] * n_steps  # DDP's own allreduce: the observer does not see it
        warm = per_step[:freeze]
        late = per_step[freeze + 1 :] or per_step[-1:]
        rows.append(
            {
                "variant": name,
                "params": nparams,
                "world": w,
                "steps": n_steps,
                "freeze_step": freeze,
                "lr": lr,
                "batch": batch,
                "seq": seq,
                "train_loss": [round(x, 4) for x in mean.tolist()],
                "final_train_loss": float(mean[-20:].mean()),
                "held_out_loss": held_loss,
                "held_out_loss_global": held_global,
                "held_out_loss_final": held_final,
                "wall_s": wall,
                "bytes_warmup_step": sum(warm) / max(1, len(warm)),
                "bytes_after_freeze_step": sum(late) / max(1, len(late)),
                "fp32_bytes": fp32,
                "clock_s": clock,
                # bytes this rank put on the wire per step: DDP's fp32 ring, DiLoCo's syncs
                "wire_bytes_step": (
                    stats["steady_bytes_per_step"]
                    if is_diloco
                    else ring
                    if name == "ddp-adamw"
                    else None
                ),
            }
        )
    return rows


def smoothed(xs: list[float], k: int = 20) -> list[float]:
    """The trailing ``k``-step mean of ``xs`` at each step."""
    return [
        sum(xs[max(0, i - k + 1) : i + 1]) / len(xs[max(0, i - k + 1) : i + 1])
        for i in range(len(xs))
    ]


def time_to_loss(row: dict[str, Any], target: float) -> float | None:
    """Seconds until ``row``'s 20-step mean training loss first reaches ``target`` (None:
    never)."""
    for loss, t in zip(smoothed(row["train_loss"]), row["clock_s"], strict=True):
        if loss <= target:
            return float(t)
    return None


def plot_lm(rows: list[dict[str, Any]], out: str, x: str = "step") -> str:
    """Training-loss curves (20-step moving average) of ``rows`` to a PNG, against the step
    (``x="step"``) or the wall time (``x="time"``)."""
    from overlap.pictures import pyplot, save

    fig, ax = pyplot().subplots(figsize=(8, 4.5))
    for r in rows:
        xs = r["train_loss"]
        smooth = smoothed(xs)
        # the model a run ends on: DiLoCo's after finish() (the same on every rank)
        held = r.get("held_out_loss_final", r["held_out_loss"])
        ax.plot(
            range(1, len(xs) + 1) if x == "step" else r["clock_s"],
            smooth,
            label=f"{r['variant']} (held-out {held:.3f})",
        )
    f = rows[0]["freeze_step"]
    if x == "step" and any("onebit" in r["variant"] for r in rows):
        ax.axvline(f, color="grey", linestyle=":", label=f"freeze_step {f}")
    ddp = next((r for r in rows if r["variant"] == "ddp-adamw"), None)
    if x == "time" and ddp is not None:
        ax.axhline(ddp["final_train_loss"], color="grey", linestyle=":", label="DDP's final loss")
    ax.set_xlabel("step" if x == "step" else "wall time (s)")
    ax.set_ylabel("training loss (20-step mean, nats/byte)")
    ax.set_title(
        f"TinyGPT {rows[0]['params'] / 1e6:.1f}M params, {rows[0]['world']} ranks, "
        f"batch {rows[0]['batch']}x{rows[0]['seq']} bytes per rank"
    )
    ax.set_ylim(
        bottom=max(0.0, min(min(r["train_loss"]) for r in rows) - 0.2), top=math.log(256) * 0.75
    )
    ax.legend()
    fig.tight_layout()
    return save(fig, out)


def main_lm(argv: list[str] | None = None) -> None:
    """``python -m overlap.bench.lm VARIANTS STEPS FREEZE WORLD LR LAYERS WIDTH
    [DILOCO_STEPS [SEED]]``: prints RESULT."""
    import json
    import sys

    from overlap.testing import RankPool

    a = sys.argv[1:] if argv is None else argv
    diloco_steps = int(a[7]) if len(a) > 7 else None
    with RankPool(int(a[3]), timeout=7200) as pool:
        rows = pool.run(
            bench_lm_rank,
            a[0].split(","),
            int(a[1]),
            int(a[2]),
            float(a[4]),
            16,
            64,
            int(a[5]),
            int(a[6]),
            8,
            diloco_steps,
            int(a[8]) if len(a) > 8 else 0,
            timeout=7200,
        )[0]
    sys.stdout.write("RESULT " + json.dumps(rows) + "\n")


if __name__ == "__main__":  # run by the CLI as stopping.python_module(__name__, ...)
    from overlap.bench.stopping import terminate_as_exit

    with terminate_as_exit():  # kill: its ranks and folders are cleaned up
        main_lm()
