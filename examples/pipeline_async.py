"""Pipeline parallelism with awaited send/recv: a GPipe schedule of concurrent micro-batches.

Each rank owns one stage (a Linear + Tanh block). The batch is split into micro-batches and
every micro-batch is an asyncio task: it awaits its input activation from the previous stage
(``await comm.irecv``), computes, and sends its output on (``await comm.isend``); then the
backward tasks do the same with gradients in the other direction. Messages are tagged by
micro-batch, so tasks can finish in any order.

Run it either way (2 to 4 stages, CPU, gloo):

    torchrun --nproc-per-node 3 examples/pipeline_async.py
    python examples/pipeline_async.py --stages 3        # starts the ranks itself

It prints the loss, which equals that of the same model run in one process (the test in
tests/gloo/test_examples.py checks the loss and every gradient).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import torch

import overlap
from overlap import comm

DIM, BATCH, MICRO = 16, 32, 4


def make_blocks(stages: int) -> list[torch.nn.Module]:
    torch.manual_seed(0)
    return [torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Tanh()) for _ in range(stages)]


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)


async def run_stage(stage: int, stages: int, block: torch.nn.Module) -> float | None:
    """One training step of this stage; returns the loss on the last stage."""
    x, y = make_batch()
    xs, ys = x.chunk(MICRO), y.chunk(MICRO)
    shape = (BATCH // MICRO, DIM)
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    losses: dict[int, torch.Tensor] = {}
    last = stage == stages - 1

    async def forward(m: int) -> None:
        if stage == 0:
            inp = xs[m]
        else:
            inp = torch.empty(shape)
            await comm.irecv(inp, src=stage - 1, tag=m)
            inp.requires_grad_(True)
        out = block(inp)
        inputs[m], outputs[m] = inp, out
        if last:
            losses[m] = torch.nn.functional.mse_loss(out, ys[m]) / MICRO
        else:
            await comm.isend(out.detach().contiguous(), dst=stage + 1, tag=m)

    async def backward(m: int) -> None:
        if last:
            losses[m].backward()
        else:
            grad = torch.empty(shape)
            await comm.irecv(grad, src=stage + 1, tag=MICRO + m)
            outputs[m].backward(grad)
        if stage > 0:
            g = inputs[m].grad
            assert g is not None
            await comm.isend(g.contiguous(), dst=stage - 1, tag=MICRO + m)

    await asyncio.gather(*(forward(m) for m in range(MICRO)))  # GPipe: all forwards first
    await asyncio.gather(*(backward(m) for m in reversed(range(MICRO))))
    return float(sum(v.item() for v in losses.values())) if last else None


def stage_main() -> dict[str, Any]:
    """Runs on every rank of an initialised job: one step; returns the loss and grads."""
    stage, stages = comm.get_rank(), comm.get_world_size()
    block = make_blocks(stages)[stage]
    loss = overlap.run(run_stage(stage, stages, block))
    return {"stage": stage, "loss": loss, "grads": [p.grad.clone() for p in block.parameters()]}  # type: ignore[union-attr]


def reference(stages: int) -> dict[str, Any]:
    """The same model, batch and loss in one process."""
    blocks = make_blocks(stages)
    model = torch.nn.Sequential(*blocks)
    x, y = make_batch()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return {
        "loss": loss.item(),
        "grads": [[p.grad.clone() for p in b.parameters()] for b in blocks],
    }  # type: ignore[union-attr]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stages", type=int, default=3, help="ranks to start (2 to 4)")
    args = parser.parse_args()
    import os

    if "RANK" in os.environ:  # started by torchrun
        overlap.init_distributed()
        out = stage_main()
        comm.destroy_process_group()
        results = [out]
    else:
        from overlap.testing import spawn_ranks

        results = spawn_ranks(stage_main, args.stages)
    for r in results:
        if r["loss"] is not None:
            sys.stdout.write(
                f"pipeline of {len(make_blocks(1)) and r['stage'] + 1} stages: "
                f"loss {r['loss']:.6f}\n"
            )


if __name__ == "__main__":
    main()
