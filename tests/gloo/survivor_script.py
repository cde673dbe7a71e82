"""Run as two processes (torchrun's environment): rank 1 is SIGKILLed inside backward; rank 0
must get CommError and then exit by itself with code 0, without calling
destroy_process_group() (issue hardening, item 8: it used to abort at interpreter exit).
It also leaves a twin group and its driver thread (an async compressed_allreduce) and a
subgroup behind, which interpreter exit must survive too."""

import os
import signal

import torch
from torch import nn

import overlap
from overlap import BucketScheduler, CommError
from overlap.compression import compressed_allreduce, padded_numel

overlap.init_distributed("gloo", timeout=10)
r = overlap.comm.get_rank()
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(6)])
sched = BucketScheduler(model, bucket_cap_mb=0.07, first_bucket_mb=0.07)
x = torch.ones(64)
we, se = torch.zeros(padded_numel(64, 2)), torch.zeros(padded_numel(64, 2) // 2)
compressed_allreduce(x, we, se, async_op=True).wait(timeout=30)
sub = overlap.comm.new_group([0, 1])
if r == 1:
    calls = [0]

    def hook(_: torch.Tensor) -> None:
        calls[0] += 1
        if calls[0] == 8:
            os.kill(os.getpid(), signal.SIGKILL)

    model[2].weight.register_post_accumulate_grad_hook(hook)
    model[3].weight.register_post_accumulate_grad_hook(hook)
try:
    for _ in range(10):
        model(torch.randn(32, 128)).sum().backward()
        sched.synchronize()
except CommError:
    print("rank", r, "CommError", flush=True)
