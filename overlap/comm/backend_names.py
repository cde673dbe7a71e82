"""Which of overlap's backends runs a torch.distributed process group.

overlap runs a job on one backend ("gloo" or "nccl" over torch.distributed, or "mpi"), and
that name picks the tensors' device, the completion path (CUDA events for NCCL, waiter
threads for gloo's futureless ops) and gloo's dtype checks and fallbacks. torch names a
group's backend more freely: device maps ("cpu:gloo,cuda:nccl"), and groups of another
backend than the job's (``dist.new_group(backend="gloo")`` in an NCCL job). This module
reads torch's name as overlap's, refusing what overlap cannot run.
"""

from __future__ import annotations

__all__ = ["adopted_backend", "backend_name"]


def adopted_backend(spec: str) -> str:
    """overlap's backend for a torch.distributed group initialised by the caller: "gloo" or
    "nccl", from what ``dist.get_backend()`` says (``spec``).

    torch also takes device maps ("cpu:gloo", "cpu:gloo,cuda:nccl"); overlap runs a job on
    one backend, whose name picks the tensors' device, the completion path (CUDA events for
    NCCL, waiter threads for gloo's futureless ops) and gloo's dtype checks and fallbacks.
    A map was adopted under its raw name, which matched neither: "cpu:gloo" ran as a gloo
    job without gloo's dtype checks (an int16 all_reduce failed deep in torch), and
    "cpu:gloo,cuda:nccl" as a CPU job that refused CUDA tensors. So a map whose every entry
    is gloo is "gloo"; one that sends CUDA to NCCL (CPU to gloo or NCCL) is "nccl", whose
    ops take CUDA tensors; any other backend (ucc, a custom one) is refused, with the way
    out, since overlap knows no completion path for it."""
    s = spec.lower().replace(" ", "")
    per = dict(p.partition(":")[::2] for p in s.split(",")) if ":" in s else {"": s}
    kinds = set(per.values())
    if kinds == {"gloo"}:
        return "gloo"
    if kinds == {"nccl"} or (per.get("cuda") == "nccl" and kinds <= {"gloo", "nccl"}):
        return "nccl"
    raise ValueError(
        f"torch.distributed was initialised with backend {spec!r}, which overlap cannot "
        "adopt: its torch backends are gloo and nccl (a device map such as "
        "'cpu:gloo,cuda:nccl' is taken as nccl, for CUDA tensors). Initialise torch with one "
        "of those, or let overlap.comm.init_distributed('gloo' | 'nccl' | 'mpi') do it"
    )


def backend_name(spec: object) -> str:
    """``spec`` as overlap names a backend, for comparing with the job's: torch's names and
    device maps read as :func:`adopted_backend` reads them ("cpu:gloo" is gloo), anything
    else its own lower-case name (which then matches no torch job's). Used where a group's
    backend is checked against the job's: ``new_group(backend=...)`` and a torch-made
    group's first use."""
    try:
        return adopted_backend(str(spec))
    except ValueError:
        return str(spec).lower()
