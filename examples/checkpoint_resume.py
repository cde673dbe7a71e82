"""Checkpoint and resume with the compressor's error feedback: the resumed run continues
bit-identically (DeepSpeed drops this state on load).

    torchrun --nproc-per-node 2 examples/checkpoint_resume.py --dir /tmp/ckpt
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
from torch import nn

import overlap
from overlap import comm


def build() -> tuple[nn.Module, Any, overlap.BucketScheduler]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    sched = overlap.BucketScheduler(model, compression=overlap.OneBit(warmup_steps=2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2), sched


def step(model: nn.Module, opt: Any, sched: overlap.BucketScheduler, i: int) -> None:
    g = torch.Generator().manual_seed(1000 * i + comm.get_rank())
    opt.zero_grad()
    model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
    sched.synchronize()
    opt.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="checkpoints")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    overlap.init_distributed()
    rank = comm.get_rank()
    path = os.path.join(args.dir, f"rank{rank}.pt")  # error feedback is per rank
    os.makedirs(args.dir, exist_ok=True)
    half = args.steps // 2

    model, opt, sched = build()  # the uninterrupted run
    for i in range(args.steps):
        if i == half:
            torch.save(
                {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()},
                path,
            )
        step(model, opt, sched, i)
    straight = [p.detach().clone() for p in model.parameters()]
    sched.remove()

    model, opt, sched = build()  # a fresh process would start here
    ckpt = torch.load(path, weights_only=False)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    sched.load_state_dict(ckpt["sched"])
    for i in range(half, args.steps):
        step(model, opt, sched, i)
    same = all(torch.equal(a, b) for a, b in zip(straight, model.parameters(), strict=True))
    sched.remove()
    sys.stdout.write(f"rank {rank}: resumed from step {half}, bit-identical: {same}\n")
    comm.destroy_process_group()
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
