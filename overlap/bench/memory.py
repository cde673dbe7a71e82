"""Whether this machine has the memory for a CPU ``overlap bench train`` (or ``overlap
demo``, ``overlap bench ops``) run, checked before any rank starts.

Every rank builds every variant's model, optimizer and buckets at once (the variants run
interleaved, step by step, so that noise hits them alike), so a rank's memory grows with
the variants and the model. Too many ranks on one machine (``--hosts 3``: six ranks) got
the kernel's out-of-memory killer, which killed a rank (or something else on the machine)
and left a wall of tracebacks from torchrun. The figures below are peak resident memory per
rank, measured with ``/usr/bin/time -v overlap bench train --variant V --steps 2 --warmup
1`` (2 ranks, the default 25.2M-parameter model) for each variant alone; the all-default
run's 4.6 GB per rank gives the per-rank base. The estimate is their sum, compared with
the kernel's MemAvailable.
"""

from __future__ import annotations

__all__ = [
    "available_bytes",
    "demo_shortfall",
    "ops_rank_bytes",
    "ops_shortfall",
    "shortfall",
    "train_rank_bytes",
    "train_shortfall",
]

# torch, gloo and the rank's runtime, before any model (the default run's peak minus the
# variants' own)
RANK_BASE_BYTES = 390 << 20
# each variant's own peak memory per model parameter (its model, gradients, buckets,
# compressor and optimizer state), rounded up; docs/benchmarks.md, "Memory"
BYTES_PER_PARAM = {
    "compute": 6,
    "ddp": 11,
    "ddp-fp16": 13,
    "ddp-powersgd": 22,
    "overlap-none": 19,
    "overlap-fp16": 20,
    "overlap-onebit": 29,
    "overlap-powersgd": 18,
    "overlap-auto": 37,
    "overlap-onebit-flat": 29,
    "ddp-adamw": 21,
    "overlap-onebitadam": 38,
    "onebitadam-serial": 40,
    "diloco": 22,
    "diloco-streaming": 39,
}
_UNKNOWN = max(BYTES_PER_PARAM.values())
# `overlap demo`: peak resident memory of a rank per --model-size (every variant built),
# measured with `/usr/bin/time -v overlap demo --model-size S --steps 2 --world-size 2
# --link none` (the largest child's maximum RSS)
DEMO_RANK_BYTES = {"small": 700_784 << 10, "medium": 1_583_952 << 10, "large": 3_493_860 << 10}
# `overlap bench ops`: a rank's buffers per byte of its largest size, per op (all_gather:
# its output list, their flat copy and the input, 2W + 1), and what a rank holds before any
# (torch, the backend). Measured with `/usr/bin/time -v overlap bench ops --op OP --sizes
# 256MiB --iters 2 --warmup 1` (2 ranks): all_reduce 504,356 KiB, sendrecv 760,768 KiB,
# all_gather 1,549,056 KiB, i.e. about 250 MiB + 1, 2 and 5 buffers.
OPS_BASE_BYTES = 300 << 20
OPS_BUFFERS = {
    "all_reduce": 1, "broadcast": 1, "sendrecv": 2, "isend-irecv": 2, "reduce_scatter": 2,
    "all_to_all": 2,
}  # fmt: skip


def ops_rank_bytes(ops: list[str], largest: int, ranks: int) -> int:
    """The estimated peak memory of one rank of ``overlap bench ops`` at its largest size."""
    per = max(2 * ranks + 1 if o == "all_gather" else OPS_BUFFERS.get(o, 2) for o in ops)
    return OPS_BASE_BYTES + largest * per


def train_rank_bytes(variants: list[str], params: int) -> int:
    """The estimated peak memory of one rank running ``variants`` on a ``params`` model."""
    return RANK_BASE_BYTES + params * sum(BYTES_PER_PARAM.get(v, _UNKNOWN) for v in variants)


def available_bytes() -> int | None:
    """The kernel's MemAvailable (memory a new process can get without swapping), or None
    where there is no /proc/meminfo."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def shortfall(ranks: int, each: int, what: str, fixes: str) -> str | None:
    """Why ``ranks`` ranks of ``each`` bytes would not fit in this machine's memory (``what``
    each holds, and ``fixes``); None when they fit (or the memory cannot be read)."""
    have = available_bytes()
    need = ranks * each
    if have is None or need <= have:
        return None
    gib = 1 << 30
    return (
        f"these {ranks} ranks would need about {need / gib:.1f} GiB ({each / gib:.1f} GiB "
        f"each: {what}) and this machine has {have / gib:.1f} GiB available; the "
        f"out-of-memory killer would stop the run. {fixes}"
    )


def train_shortfall(variants: list[str], params: int, ranks: int) -> str | None:
    """:func:`shortfall` for ``overlap bench train``."""
    return shortfall(
        ranks,
        train_rank_bytes(variants, params),
        f"{len(variants)} variants of a {params / 1e6:.1f}M-parameter model, every variant "
        "built in every rank",
        "Run fewer variants (--variant), a smaller --model-size, or fewer ranks "
        "(--world-size, --hosts, --procs-per-host)",
    )


def ops_shortfall(ops: list[str], largest: int, ranks: int) -> str | None:
    """:func:`shortfall` for ``overlap bench ops``."""
    return shortfall(
        ranks,
        ops_rank_bytes(ops, largest, ranks),
        f"the buffers of {', '.join(ops)} at {largest / (1 << 20):.0f} MiB",
        "Use smaller --sizes, fewer ranks, or leave all_gather out (--op)",
    )


def demo_shortfall(model_size: str, ranks: int) -> str | None:
    """:func:`shortfall` for ``overlap demo``."""
    return shortfall(
        ranks,
        DEMO_RANK_BYTES[model_size],
        f"every variant of the {model_size} model",
        "Use a smaller --model-size or fewer ranks (--world-size)",
    )
