"""DeepSpeed's 1-bit Adam: uncompressed warm-up, then frozen variance and 1-bit momentum.

The algorithm (DeepSpeed's ``OnebitAdam``, arXiv 2102.02888), per step, for every parameter:

* **warm-up** (the first ``freeze_step`` steps): plain Adam on the gradient averaged across
  the ranks: m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2.
* **compression stage** (every later step): v is frozen. Each rank forms its momentum from
  its *local* gradient, m_r = b1 m + (1 - b1) g_r, and the ranks' momenta are averaged by the
  two-phase 1-bit :func:`~overlap.compression.compressed_allreduce`, with worker and server
  error feedback; every rank ends with the same m.
* update, in both stages: p -= lr (m / (sqrt(v) + eps) + weight_decay p). No bias
  correction, as in DeepSpeed (its ``bias_correction`` flag is stored and never read).

Where this differs from DeepSpeed, on purpose (docs/compression.md says why):

* DeepSpeed's first ``step()`` only allocates its buffers: it discards that step's gradient
  and does not move the parameters. Here every step is a real step, so ``freeze_step=N``
  means N real warm-up updates (DeepSpeed's N includes its empty first step).
* The momenta go through one compressed allreduce for all parameters (standalone) or one per
  bucket (with a BucketScheduler), each tensor with its own worker and server scales
  (``per_tensor_scales``), instead of one call per tensor. DeepSpeed under its FP16 optimizer
  flattens every parameter into one buffer with one scale; ``per_tensor_scales=False`` gives
  that.
* ``load_state_dict`` restores each rank's error buffers (``state_dict()`` is per rank), so
  a resume continues bit-identically; DeepSpeed resets them to zero.

Every parameter that requires grad takes part in every step; a parameter without a ``.grad``
counts as a zero gradient, as it does in DeepSpeed's flattened buffers. Ranks must agree on
the set of parameters (the reductions are collective).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import torch

from overlap import comm
from overlap.agreement import agree_on_load, compare, hyperparameters, param_signature
from overlap.comm.steps import Steps, run
from overlap.compression.base import Compressor
from overlap.compression.codec import write_outputs
from overlap.compression.nonfinite import check_mode
from overlap.compression.onebit import OneBit, compressed_bytes
from overlap.errors import NonFiniteError
from overlap.rankstate import check_rank, group_rank

__all__ = ["OneBitAdam"]

log = logging.getLogger(__name__)

_STANDALONE_KEY = "params"  # the error-feedback key of the standalone (all-parameter) buffer


def _nonfinite(what: str) -> NonFiniteError:
    return NonFiniteError(
        f"OneBitAdam: {what} holds NaN or Inf; the momentum, the variance and the error "
        "feedback were left unchanged on every rank. Skip this step (on_nonfinite='skip') "
        "or find the source of the non-finite gradient"
    )


class OneBitAdam(torch.optim.Optimizer):
    """1-bit Adam (DeepSpeed's ``OnebitAdam``) as a ``torch.optim.Optimizer``.

    Two ways to use it:

    * **standalone**: ``loss.backward(); opt.step()``. ``step()`` communicates on the active
      overlap backend (gloo, NCCL or MPI) over ``group`` (default: the world): a plain
      averaging allreduce of the gradients during warm-up, the compressed momentum after.
      An optimizer takes the weights as they are (as Horovod's ``DistributedOptimizer``
      does): start every rank from the same ones, by one seed or with
      ``comm.broadcast(p, src=0)`` over the parameters (and buffers) before training.
    * **overlapped**: ``sched = BucketScheduler(model, optimizer=opt)``; then
      ``loss.backward(); sched.synchronize(); opt.step()``. After ``freeze_step`` each
      bucket's momentum is formed as soon as the bucket's gradients are ready and is reduced,
      compressed, while backward goes on; ``step()`` then only applies the update. Before it,
      buckets are plain averaging allreduces. The scheduler starts every rank from rank
      0's weights (``init_sync``).

    Args:
        params: parameters or parameter groups (floating point; the group keys are
            ``lr``, ``betas``, ``eps``, ``weight_decay`` and DeepSpeed's ``exp_avg_mask``).
        lr: as DeepSpeed's.
        betas: as DeepSpeed's.
        eps: as DeepSpeed's.
        weight_decay: as DeepSpeed's (added to the update, so it is decoupled from the
            momentum, as in AdamW).
        freeze_step: uncompressed warm-up steps (>= 1: the frozen variance must have been
            estimated at least once). DeepSpeed suggests 15-25% of training.
        on_nonfinite: a NaN/Inf gradient on any rank makes every rank ``"raise"``
            :class:`~overlap.errors.NonFiniteError` (the default) or ``"skip"`` the update
            (``skipped_steps`` counts them, ``last_skipped`` says so). Either way the NaN
            never reaches the momentum, the variance or the error buffers. Under a
            ``torch.amp.GradScaler`` such a step is always skipped (see :meth:`step`).
        bias_correction: False (the default) is DeepSpeed's algorithm, which never corrects
            (its ``bias_correction`` flag is stored and ignored). True applies Adam's
            correction as ``torch.optim.AdamW`` does, with the variance's correction frozen
            with it: step lr / (1 - b1^t) on m / (sqrt(v / (1 - b2^F)) + eps), F the warm-up
            steps, and decoupled weight decay p *= 1 - lr wd. It matters in short runs,
            where the uncorrected v stays small for about 1 / (1 - b2) steps.
        per_tensor_scales: each tensor gets its own 1-bit scales (default True).
        group: the ranks to average over in standalone use (default: the world).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        bias_correction: bool = False,
        on_nonfinite: str = "raise",
        per_tensor_scales: bool = True,
        group: Any = None,
    ) -> None:
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int):
            raise TypeError(f"freeze_step must be an int, got {freeze_step!r}")
        if freeze_step < 1:
            raise ValueError(
                f"freeze_step must be >= 1, got {freeze_step}: 1-bit Adam freezes the "
                "variance after the warm-up, so it needs at least one uncompressed step to "
                "estimate it (DeepSpeed suggests 15-25% of the training steps)"
            )
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")
        if not eps > 0.0:
            raise ValueError(f"eps must be > 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        check_mode(on_nonfinite)
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bool(bias_correction),
        }
        super().__init__(params, defaults)
        self.freeze_step = freeze_step
        self.on_nonfinite = on_nonfinite
        self.group = group
        self.skipped_steps = 0
        self.last_skipped = False
        self._done = 0  # completed (not skipped) steps
        self._codec = OneBit(per_tensor_scales=per_tensor_scales)  # the error feedback
        self._denoms: dict[int, tuple[Any, torch.Tensor]] = {}  # frozen sqrt(v) + eps
        self._sched: Any = None  # the BucketScheduler reducing for us, if any
        self._momentum = _MomentumReduction(self)
        self._synced: int | None = None  # the step whose buckets the scheduler finished
        self._sched_frozen = False  # the stage the scheduler's buckets ran in
        self._sig: tuple[Any, ...] | None = None
        self._agreed = False  # the ranks compared their settings (the first standalone step)

    # torch.amp.GradScaler calls step() on every rank, with its scale in ``grad_scale``
    # and its (local) verdict in ``found_inf``, instead of skipping step() on the ranks
    # whose own gradient overflowed: a step skipped on one rank only would leave its peers'
    # collectives with no partner (they hung until the timeout). See step().
    _step_supports_amp_scaling = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, refusing what 1-bit Adam cannot update (with the fix in the message)."""
        if "non_freeze" in param_group:
            raise ValueError(
                "OneBitAdam does not support DeepSpeed's 'non_freeze' parameter groups: give "
                "those parameters a torch.optim.AdamW of their own, reduced by a plain "
                "BucketScheduler"
            )
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for i, p in enumerate(params):
            if isinstance(p, torch.Tensor) and (not p.is_floating_point() or p.is_complex()):
                raise TypeError(
                    f"OneBitAdam updates real floating-point parameters; parameter {i} of "
                    f"this group is {p.dtype}: leave it out of the optimizer (or make it "
                    "a buffer)"
                )
        param_group["params"] = params
        super().add_param_group(param_group)
        if getattr(self, "_sched", None) is not None:
            raise ValueError(
                "a parameter group was added while a BucketScheduler reduces for this "
                "OneBitAdam; remove() the scheduler and build a new one over the new params"
            )

    # ------------------------------------------------------------------ the stages
    @property
    def frozen(self) -> bool:
        """True once the warm-up is over: the variance is frozen, the momentum compressed."""
        return self._done >= self.freeze_step

    @property
    def step_count(self) -> int:
        """Completed steps (skipped steps are not counted)."""
        return self._done

    def _params(self) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        return [(p, g) for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        st: dict[str, Any] = self.state[p]
        if not st:
            st["step"] = 0
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return st

    @staticmethod
    def _grad(p: torch.Tensor) -> torch.Tensor:
        g = p.grad
        if g is None:
            return torch.zeros_like(p)
        if g.is_sparse:
            raise TypeError(
                "OneBitAdam does not support sparse gradients (as DeepSpeed's): use "
                "nn.Embedding(sparse=False), or leave that parameter to a sparse optimizer"
            )
        return g

    # ------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step (see the class docstring for what it communicates).

        Under ``torch.amp.GradScaler`` (``scaler.step(opt)``), standalone: the scaler calls
        this on every rank, with the gradients still scaled (or unscaled by the caller's
        ``scaler.unscale_(opt)``); they are unscaled here on the way in (``.grad`` is left
        as it is), and a step with NaN or Inf on any rank is skipped on every rank,
        whatever ``on_nonfinite`` says: overflow is how a scaler finds its scale. Attached
        to a BucketScheduler it is refused (RuntimeError, nothing updated): there the
        momentum is formed during backward, from gradients the scaler has not unscaled."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scaled = hasattr(self, "found_inf")  # set by torch.amp.GradScaler for this call
        if self._sched is not None:
            if scaled:
                raise RuntimeError(
                    "OneBitAdam attached to a BucketScheduler cannot run under "
                    "torch.amp.GradScaler: it forms the momentum during backward, from "
                    "gradients the scaler has not unscaled yet. Use the OneBitAdam "
                    "standalone under the scaler (no BucketScheduler(optimizer=...)), or "
                    "bfloat16 autocast, which needs no scaler; nothing was updated"
                )
            self._step_after_scheduler()
        else:
            scale = getattr(self, "grad_scale", None) if scaled else None
            self._step_standalone(scale, scaled)
        return loss

    def _step_standalone(self, scale: torch.Tensor | None = None, scaled: bool = False) -> None:
        """``scale``: the loss scale the gradients still carry (a GradScaler's);
        ``scaled``: a GradScaler drives this step (a non-finite one is skipped)."""
        ps = self._params()
        if not self._agreed:
            self._agree(ps)
        if not ps:
            return
        self._check_layout(ps)
        grads = [self._grad(p) for p, _ in ps]
        if scale is not None:  # as GradScaler.unscale_ computes its factor
            inv = scale.double().reciprocal().float()
            grads = [g * inv.to(g.device) for g in grads]
        self.last_skipped = False
        if not self.frozen:
            flat = torch.cat([g.reshape(-1).float() for g in grads])
            comm.all_reduce(flat, op="avg", group=self.group)
            if not bool(torch.isfinite(flat.sum())):
                return self._nonfinite("the averaged gradient", scaled)
            a, avg = 0, []
            for (p, _), g in zip(ps, grads, strict=True):
                avg.append(flat[a : a + g.numel()].view_as(p))
                a += g.numel()
            if self._done + 1 == self.freeze_step:
                self._codec.prepare(_STANDALONE_KEY, flat, self.group, [p.shape for p, _ in ps])
            self._adam(ps, avg)
            return None
        flat = torch.empty(
            sum(p.numel() for p, _ in ps), dtype=torch.float32, device=ps[0][0].device
        )
        outputs, a = [], 0
        for (p, grp), g in zip(ps, grads, strict=True):
            m = self._state(p)["exp_avg"]
            seg = flat[a : a + p.numel()]
            torch.lerp(g.reshape(-1).float(), m.reshape(-1).float(), grp["betas"][0], out=seg)
            outputs.append((a, m))
            a += p.numel()
        try:
            self._momentum.reduce_formed(
                _STANDALONE_KEY, flat, [p.shape for p, _ in ps], outputs, self.group
            )
        except NonFiniteError:
            if self.on_nonfinite == "raise" and not scaled:
                raise
            return self._skip()
        self._frozen_update(ps)
        return None

    def _agree(self, ps: list[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        """The first standalone step's check that the group's ranks have the same
        parameters (shapes, dtypes) and settings (the hyperparameters of each group,
        ``freeze_step``, ``per_tensor_scales``, ``on_nonfinite``): one all-gather of a few
        integers, once. Raises ValueError on every rank, with nothing updated. Why: an
        optimizer is built on each rank alone, and another ``lr`` on one rank moved the
        ranks' weights apart with no error, another ``freeze_step`` hung the job at the
        freeze, and another ``per_tensor_scales`` ended it from gloo's thread (forty-fifth
        session). A BucketScheduler compares its optimizer when it is built."""
        self._agreed = True
        if not comm.is_initialized() or comm.get_world_size(self.group) == 1:
            return
        params = [p for p, _ in ps]
        mine = [len(params), param_signature(params)]
        device = self._ctrl_device()
        what = "OneBitAdam's"
        settings = {
            "hyperparameters (lr, betas, eps, weight_decay, bias_correction)": hyperparameters(
                self
            ),
            "freeze_step": self.freeze_step,
            "per_tensor_scales": self._codec.per_tensor_scales,
            "on_nonfinite": self.on_nonfinite,
            "step count (a state loaded on some ranks only)": self._done,
        }
        ranks, refusal = compare(what, mine, settings, self.group, device)
        if refusal is not None:
            raise refusal
        if ranks:
            raise ValueError(
                f"OneBitAdam: ranks {ranks} step other parameters (shapes or dtypes, or how "
                f"many have requires_grad) than rank {comm.get_global_rank(self.group, 0)}; "
                "build the same model and optimizer on every rank; nothing was updated"
            )

    def _step_after_scheduler(self) -> None:
        if self._synced != self._done:
            raise RuntimeError(
                "OneBitAdam.step() with a BucketScheduler: the scheduler has not finished this "
                "step's reductions; call sched.synchronize() (or await sched.wait()) after "
                "backward and before opt.step()"
            )
        self._synced = None
        ps = self._params()
        if self.last_skipped:  # a bucket's momentum was not finite: the codec kept it out
            self._skip()
            return
        if not self._sched_frozen:
            grads = [self._grad(p) for p, _ in ps]
            if not bool(torch.isfinite(torch.stack([g.sum() for g in grads]).sum())):
                self._nonfinite("the averaged gradient")
                return
            self._adam(ps, grads)
            return
        self._frozen_update(ps)

    def _nonfinite(self, what: str, scaled: bool = False) -> None:
        if self.on_nonfinite == "raise" and not scaled:
            raise _nonfinite(what)
        self._skip()

    def _skip(self) -> None:
        self.skipped_steps += 1
        self.last_skipped = True
        log.info("OneBitAdam: skipped a step with a non-finite gradient")

    def _adam(
        self, ps: list[tuple[torch.Tensor, dict[str, Any]]], grads: list[torch.Tensor]
    ) -> None:
        """A warm-up step: plain Adam (no bias correction) on the averaged gradients. The
        last one keeps its denominators sqrt(v) + eps: v is frozen from then on."""
        last = self._done + 1 == self.freeze_step
        self._denoms.clear()
        for (p, grp), g in zip(ps, grads, strict=True):
            st = self._state(p)
            b1, b2 = grp["betas"]
            m, v = st["exp_avg"], st["exp_avg_sq"]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = self._denom(grp, v, st["step"] + 1)
            self._apply(p, grp, m, denom, st["step"] + 1)
            if last:
                self._denoms[id(p)] = ((grp["eps"], grp["bias_correction"]), denom)
            st["step"] += 1
        self._finish()

    def _frozen_update(self, ps: list[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        """A compression-stage step: the momentum is reduced already; v is frozen, so its
        denominator sqrt(v) + eps is computed once and kept (two passes saved per step)."""
        for p, grp in ps:
            st = self._state(p)
            m = st["exp_avg"]
            mask = grp.get("exp_avg_mask")
            if mask is not None:
                m.mul_(mask.to(m.device))
            key = (grp["eps"], grp["bias_correction"])
            cached = self._denoms.get(id(p))
            if cached is None or cached[0] != key:
                t_v = min(st["step"] + 1, self.freeze_step)  # v's last update
                cached = self._denoms[id(p)] = (key, self._denom(grp, st["exp_avg_sq"], t_v))
            self._apply(p, grp, m, cached[1], st["step"] + 1)
            st["step"] += 1
        self._finish()

    @staticmethod
    def _denom(grp: dict[str, Any], v: torch.Tensor, t_v: int) -> torch.Tensor:
        """sqrt(v) + eps, or sqrt(v / (1 - b2^t_v)) + eps with bias correction."""
        if grp["bias_correction"]:
            return (v.sqrt() / math.sqrt(1.0 - grp["betas"][1] ** t_v)).add_(grp["eps"])
        return v.sqrt().add_(grp["eps"])

    @staticmethod
    def _apply(
        p: torch.Tensor, grp: dict[str, Any], m: torch.Tensor, denom: torch.Tensor, t: int
    ) -> None:
        """DeepSpeed's p -= lr (m / denom + wd p) (one fused pass without weight decay), or
        with bias correction AdamW's p *= 1 - lr wd; p -= lr / (1 - b1^t) m / denom."""
        lr, wd = grp["lr"], grp["weight_decay"]
        if grp["bias_correction"]:
            if wd > 0.0:
                p.mul_(1.0 - lr * wd)
            p.addcdiv_(m, denom, value=-lr / (1.0 - grp["betas"][0] ** t))
        elif wd > 0.0:
            update = m / denom
            update.add_(p, alpha=wd)
            p.add_(update, alpha=-lr)
        else:
            p.addcdiv_(m, denom, value=-lr)

    def _finish(self) -> None:
        self._done += 1
        if self._done == self.freeze_step:
            log.info(
                "OneBitAdam: warm-up done after %d steps; the variance is frozen and the "
                "momentum goes 1-bit compressed from the next step",
                self._done,
            )

    def _check_layout(self, ps: list[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        sig = tuple((tuple(p.shape), p.dtype) for p, _ in ps)
        if self._sig is not None and sig != self._sig:
            log.warning("OneBitAdam: the parameters changed; the 1-bit error feedback restarts")
            self._codec.reset()
        self._sig = sig

    # ------------------------------------------------------------ the scheduler's side
    def _attach(self, sched: Any) -> Compressor:
        """Called by ``BucketScheduler(optimizer=self)``: returns the bucket reduction."""
        if self._sched is not None:
            raise ValueError(
                "this OneBitAdam is already reduced by another BucketScheduler; one optimizer "
                "takes one scheduler: call remove() on the first one (overlap.holder_of("
                "optimizer) returns it), or make a second optimizer"
            )
        mine = {id(p) for p, _ in self._params()}
        theirs = {id(p) for p in sched.params}
        if mine != theirs:
            raise ValueError(
                f"the BucketScheduler reduces {len(theirs)} parameters and this OneBitAdam "
                f"updates {len(mine)}, {len(mine - theirs)} of them not covered by the "
                f"scheduler and {len(theirs - mine)} unknown to the optimizer: build both over "
                "the same parameters (every parameter group's parameters that require grad)"
            )
        self._sched = sched
        return self._momentum

    def _detach(self, sched: Any) -> None:
        if self._sched is sched:
            self._sched = None
            self._synced = None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state (per parameter: step, exp_avg, exp_avg_sq) plus this
        rank's 1-bit error feedback, the step counters and the world size. Save it per rank:
        the error buffers differ between ranks."""
        out = super().state_dict()
        out["onebit_adam"] = {
            "step": self._done,
            "freeze_step": self.freeze_step,
            "skipped_steps": self.skipped_steps,
            "world_size": self._world(),
            "rank": group_rank(self.group),
            "codec": self._codec.state_dict(),
        }
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Refused, with nothing changed, when it was saved on
        another number of ranks or for other parameters.

        In a job, a collective over the optimizer's group, as its steps are: every rank
        calls it with its own state, and a state refused on one rank, or states of
        different saves (other step counts: one rank frozen and another still warming up
        would issue collectives that do not pair), are refused on every rank
        (:func:`overlap.agreement.agree_on_load`)."""
        if not comm.is_initialized():
            self._check_state(state_dict)
        else:

            def check() -> list[float]:
                self._check_state(state_dict)
                return [int(state_dict["onebit_adam"]["step"])]

            device = self._ctrl_device()
            agree_on_load("OneBitAdam.load_state_dict", check, ["step"], self.group, device)
        extra = state_dict["onebit_adam"]
        codec = OneBit(per_tensor_scales=self._codec.per_tensor_scales)
        codec.load_state_dict(extra["codec"])  # checked by _check_state
        body = {k: v for k, v in state_dict.items() if k != "onebit_adam"}
        super().load_state_dict(body)
        self._codec = codec
        self._done = int(extra["step"])
        self.skipped_steps = int(extra["skipped_steps"])
        self.last_skipped = False
        self._denoms.clear()
        self._sig = None

    def _ctrl_device(self) -> torch.device:
        """Where the backend reduces a control vote: CUDA on NCCL, else the CPU."""
        first = next(p for g in self.param_groups for p in g["params"])
        return first.device if comm.get_backend() == "nccl" else torch.device("cpu")

    def _check_state(self, state_dict: dict[str, Any]) -> None:
        """:meth:`load_state_dict`'s checks of this rank's own state; raises ValueError."""
        extra = state_dict.get("onebit_adam")
        if extra is None:
            raise ValueError(
                "this is not a OneBitAdam state (no 'onebit_adam' entry); load the state "
                "saved by OneBitAdam.state_dict()"
            )
        w = self._world()
        if extra["world_size"] is not None and w is not None and extra["world_size"] != w:
            raise ValueError(
                f"this OneBitAdam state was saved on {extra['world_size']} ranks but this job "
                f"has {w}: the 1-bit error buffers are laid out per rank; resume on "
                f"{extra['world_size']} ranks"
            )
        check_rank("OneBitAdam", extra.get("rank"), group_rank(self.group), extra["codec"])
        theirs = [len(g["params"]) for g in state_dict["param_groups"]]
        mine = [len(g["params"]) for g in self.param_groups]
        if sum(theirs) == sum(mine) and theirs != mine:
            raise ValueError(
                f"this OneBitAdam state has parameter groups of {theirs} parameters but the "
                f"optimizer's are of {mine}: build the optimizer's groups as they were saved"
            )
        params = [p for g in self.param_groups for p in g["params"]]
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        if len(saved) != len(params):
            raise ValueError(
                f"this OneBitAdam state holds {len(saved)} parameters but the optimizer has "
                f"{len(params)}: it belongs to another model"
            )
        for i, p in zip(saved, params, strict=True):
            st = state_dict["state"].get(i, {})
            for k in ("exp_avg", "exp_avg_sq"):
                t = st.get(k)
                if t is not None and tuple(t.shape) != tuple(p.shape):
                    raise ValueError(
                        f"parameter {i}: the saved {k} has shape {tuple(t.shape)} but the "
                        f"parameter has {tuple(p.shape)}: this state belongs to another model"
                    )
        OneBit(per_tensor_scales=self._codec.per_tensor_scales).check_state(extra["codec"])

    def _world(self) -> int | None:
        return comm.get_world_size(self.group) if comm.is_initialized() else None

    def __repr__(self) -> str:
        return (
            f"OneBitAdam(freeze_step={self.freeze_step}, steps={self._done}, "
            f"frozen={self.frozen}, groups={len(self.param_groups)}, "
            f"per_tensor_scales={self._codec.per_tensor_scales}, "
            f"on_nonfinite={self.on_nonfinite!r})"
        )


class _MomentumReduction(Compressor):
    """The bucket reduction a BucketScheduler runs for a :class:`OneBitAdam`.

    Warm-up: a plain averaging allreduce of the bucket's gradients (the scheduler copies them
    back into ``.grad`` for ``step()``). Compression stage: the bucket's momentum is formed
    from its gradients in the bucket buffer, m_r = b1 m + (1 - b1) g_r, then averaged by the
    1-bit reduction and rebuilt straight into the optimizer's ``exp_avg`` tensors; ``.grad``
    keeps the local gradient, as in DeepSpeed (whose backward allreduce is off by then).
    A non-finite momentum leaves ``exp_avg`` and the error feedback untouched.
    """

    name = "onebit-adam"
    summable = False
    writes_outputs = True

    def __init__(self, opt: OneBitAdam) -> None:
        self.opt = opt
        self._params: dict[Hashable, list[torch.Tensor]] = {}
        self._frozen = False
        self._formed: dict[int, int] = {}  # id(param) -> the step its momentum was formed in
        self._groups: dict[int, dict[str, Any]] | None = None

    def _beta1(self, p: torch.Tensor) -> float:
        if self._groups is None:
            self._groups = {id(q): g for g in self.opt.param_groups for q in g["params"]}
        b1: float = self._groups[id(p)]["betas"][0]
        return b1

    def fill(self, param: torch.Tensor, view: torch.Tensor, grad: torch.Tensor) -> bool:
        """After the warm-up, form the momentum straight into the bucket as the gradient
        arrives: view = b1 m + (1 - b1) g, one pass instead of a copy and a momentum pass."""
        if not self.opt.frozen:
            return False
        m = self.opt._state(param)["exp_avg"]
        if m.dtype != view.dtype or grad.dtype != view.dtype or grad.layout != torch.strided:
            return False  # the general path: copy now, form on the worker
        torch.lerp(grad, m, self._beta1(param), out=view)
        self._formed[id(param)] = self.opt._done
        return True

    def begin_step(self) -> None:
        self._frozen = self.opt.frozen
        self.opt._sched_frozen = self._frozen
        self.opt.last_skipped = False

    def end_step(self) -> None:
        self.opt._synced = self.opt._done

    def direct_targets(
        self, key: Hashable, params: Sequence[torch.Tensor]
    ) -> list[torch.Tensor] | None:
        if not self._frozen:
            return None
        self._params[key] = list(params)
        return [self.opt._state(p)["exp_avg"] for p in params]

    def reduce_steps(
        self,
        key: Hashable,
        flat: torch.Tensor,
        *,
        group: Any = None,
        shapes: Sequence[torch.Size] | None = None,
        outputs: Sequence[tuple[int, torch.Tensor]] = (),
    ) -> Steps:
        if not self._frozen:
            if self.opt._done + 1 == self.opt.freeze_step:  # the last warm-up step
                self.opt._codec.prepare(key, flat, group, shapes)
            yield [comm.all_reduce(flat, op="avg", group=group, async_op=True)]
            write_outputs(flat, outputs)
            return flat
        step = self.opt._done
        for (a, m), p in zip(outputs, self._params[key], strict=True):
            if self._formed.get(id(p)) == step:
                continue  # formed in the gradient hook (fill)
            seg = flat[a : a + m.numel()]
            torch.lerp(seg, m.reshape(-1).to(seg.dtype), self._beta1(p), out=seg)
        try:
            yield from self.steps_formed(key, flat, shapes, outputs, group)
        except NonFiniteError:
            if self.opt.on_nonfinite == "raise":
                raise
            self.opt.last_skipped = True
        return flat

    def steps_formed(
        self,
        key: Hashable,
        flat: torch.Tensor,
        shapes: Sequence[torch.Size] | None,
        outputs: Sequence[tuple[int, torch.Tensor]],
        group: Any,
    ) -> Steps:
        """The 1-bit reduction of an already formed momentum buffer, rebuilt into the
        ``outputs`` (float32 contiguous ones directly, others copied after)."""
        direct = [(a, t) for a, t in outputs if t.dtype == torch.float32 and t.is_contiguous()]
        yield from self.opt._codec.reduce_steps(
            key, flat, group=group, shapes=shapes, outputs=direct
        )
        if len(direct) != len(outputs):
            for a, t in outputs:
                if t.dtype != torch.float32 or not t.is_contiguous():
                    t.copy_(flat[a : a + t.numel()].view_as(t))
        return flat

    def reduce_formed(
        self,
        key: Hashable,
        flat: torch.Tensor,
        shapes: Sequence[torch.Size],
        outputs: Sequence[tuple[int, torch.Tensor]],
        group: Any,
    ) -> None:
        """Blocking form, for the standalone ``step()``."""
        run(self.steps_formed(key, flat, shapes, outputs, group))

    def wire_bytes(
        self, flat: torch.Tensor, group: Any = None, shapes: Sequence[torch.Size] | None = None
    ) -> int:
        w = comm.get_world_size(group)
        if self._frozen:
            return compressed_bytes(flat.numel(), w)
        return 2 * (w - 1) * flat.numel() * flat.element_size() // w

    def reset(self) -> None:
        self.opt._codec.reset()  # the bucket layout changed: the error feedback restarts
        self._params.clear()

    def state_dict(self) -> dict[str, Any]:
        """Nothing: the optimizer's ``state_dict()`` carries the error feedback."""
        return {"name": self.name}
