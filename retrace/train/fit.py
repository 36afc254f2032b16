"""The one training loop of retrace's trainers (DFlash drafter, ReTrace conditioner, zoo target, AR draft).

`fit` runs optimizer steps until the budget ends: each step sets the learning rate from the schedule, calls
the trainer's `step_fn` (which computes its loss on a batch and passes it to `backward`: the finiteness
check, then `loss.backward()`), clips the gradient norm, steps and zeroes the optimizer, keeps an EMA of the
loss (0.95), then calls the trainer's hooks: `on_step` every step (logging, loss curves), `evaluate` every
`eval_every` steps and at the schedule's last step, `checkpoint` every `save_every` steps. A resumed run
passes the step it resumed at as `start`.

The budget (`Budget`) is steps, or wall-clock seconds on top: out of time, the loop ends as if at `steps`
(the trainer then evaluates and saves as at the end). Under torchrun `sync` makes the time decision one for
all ranks (rank 0's). The schedule is the trainer's: `lr(step, spent)` with `spent` the fraction of the time
budget used (None without one); `follow_budget` makes a step schedule follow the time budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

EMA_DECAY, EMA_NEW = 0.95, 0.05  # the loss shown and logged: 0.95 * previous + 0.05 * this step's


@dataclass(frozen=True)
class Budget:
    """How long `fit` trains."""

    steps: int  # the schedule's length: the run is done at this step
    seconds: float | None = None  # wall-time budget: when spent, end as if at `steps` (None: none)
    stop_at: int | None = None  # end this call at this step (< steps: a checkpointed stop; --resume continues)
    min_steps: int = 0  # steps this call runs before it looks at the clock


@dataclass
class FitState:
    """Where the loop is; `fit` returns it."""

    step: int = 0  # optimizer steps done (a resumed run's included)
    steps_run: int = 0  # of them, by this call
    loss: float | None = None  # the last step's loss
    ema: float | None = None  # its EMA (EMA_DECAY)
    last_eval: dict | None = None  # what `evaluate` returned last
    timed_out: bool = False  # the time budget ended the loop
    seconds: float = 0.0  # wall time of the loop


Schedule = Callable[[int, "float | None"], float]  # (step, spent fraction of the time budget or None) -> lr


def follow_budget(curve: Callable[[int], float], total: int) -> Schedule:
    """A schedule over `total` steps that, under a time budget, runs at whichever is further: the step or
    the spent fraction of the time (so a time-bounded run still warms up and decays fully)."""

    def at(step: int, spent: float | None) -> float:
        return curve(step if spent is None else max(step, min(total - 1, int(total * spent))))

    return at


def fit(step_fn: Callable[[FitState, Callable[[torch.Tensor], None]], float], opt: torch.optim.Optimizer,
        params: list[torch.Tensor], budget: Budget, lr: Schedule, grad_clip: float, *, start: int = 0,
        lr_scale: list[float] | None = None, on_step: Callable[[FitState], None] | None = None,
        evaluate: Callable[[FitState], dict] | None = None, eval_every: int = 0,
        checkpoint: Callable[[int], None] | None = None, save_every: int = 0, bar=None,
        postfix: Callable[[FitState], dict] | None = None, clock: Callable[[], float] | None = None,
        sync: Callable[[float], float] | None = None, name: str = "") -> FitState:
    """Train from step `start` until `budget` ends (see the module docstring).

    step_fn(state, backward) -> the step's loss (a float, for the EMA): it calls backward(loss) once per
    micro-batch. lr_scale: a factor per parameter group (default 1). bar: a tqdm bar (or None) that advances
    per step with `postfix(state)` (default: the loss EMA). clock() -> seconds spent of the time budget
    (default: since this call). sync: the time decision of all ranks (default: this process's).
    """
    st = FitState(step=start)
    t0 = time.perf_counter()
    clock = clock or (lambda: time.perf_counter() - t0)
    stop = budget.steps if budget.stop_at is None else min(budget.steps, budget.stop_at)
    scales = lr_scale or [1.0] * len(opt.param_groups)

    def backward(loss: torch.Tensor) -> None:
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{name + ': ' if name else ''}non-finite loss {float(loss.detach())} at step "
                                     f"{st.step}")
        loss.backward()

    while st.step < stop:
        spent = None
        if budget.seconds is not None and st.steps_run >= budget.min_steps:
            spent = clock() / budget.seconds
            spent = sync(spent) if sync is not None else spent
            if spent >= 1.0:
                st.timed_out = True
                break
        rate = lr(st.step, spent)
        for g, sc in zip(opt.param_groups, scales, strict=True):
            g["lr"] = rate * sc
        lv = step_fn(st, backward)
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        st.step += 1
        st.steps_run += 1
        st.loss = lv
        st.ema = lv if st.ema is None else EMA_DECAY * st.ema + EMA_NEW * lv
        if on_step is not None:
            on_step(st)
        if evaluate is not None and ((eval_every and st.step % eval_every == 0) or st.step == budget.steps):
            st.last_eval = evaluate(st)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(postfix(st) if postfix is not None else {"loss": f"{st.ema:.3f}"})
        if checkpoint is not None and save_every and st.step % save_every == 0 and st.step < stop:
            checkpoint(st.step)
    st.seconds = time.perf_counter() - t0
    return st


__all__ = ["Budget", "FitState", "fit", "follow_budget"]
