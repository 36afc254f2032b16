"""The one training loop (retrace.train.fit): the schedule it sets, clipping before the step, the EMA, the
finiteness check, the hooks' cadence, a resumed start, and the time budget (a fake clock: no wall time)."""

from __future__ import annotations

import pytest
import torch

from retrace.train.fit import Budget, fit, follow_budget


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def _steps(model, losses_seen: list, lrs: list, opt):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))

    def step_fn(st, backward):
        lrs.append(opt.param_groups[0]["lr"])
        loss = model(x).pow(2).mean() + st.step  # grows with the step: a visible EMA
        backward(loss)
        losses_seen.append(loss.item())
        return loss.item()

    return step_fn


def test_fit_sets_the_schedule_and_keeps_the_ema():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    losses, lrs = [], []
    st = fit(_steps(model, losses, lrs, opt), opt, list(model.parameters()), Budget(5), lambda s, _f: 0.1 * (s + 1),
             grad_clip=1e-3)
    assert (st.step, st.steps_run, st.timed_out) == (5, 5, False)
    assert lrs == [0.1 * (s + 1) for s in range(5)]
    ema = losses[0]
    for v in losses[1:]:
        ema = 0.95 * ema + 0.05 * v
    assert st.ema == ema and st.loss == losses[-1]


def test_the_gradient_is_clipped_before_the_step():
    model = _model()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    raw = torch.autograd.grad(model(x).pow(2).mean(), list(model.parameters()))
    assert torch.cat([g.flatten() for g in raw]).norm() > 0.1
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    fit(_steps(model, [], [], opt), opt, list(model.parameters()), Budget(1), lambda s, _f: 1.0, grad_clip=1e-3)
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before, strict=True)]).norm()
    assert float(moved) == pytest.approx(1e-3, rel=1e-4)  # SGD at lr 1 moves by the clipped gradient


def test_a_non_finite_loss_stops_before_its_backward():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    calls = []

    def step_fn(st, backward):
        calls.append(st.step)
        loss = model(torch.ones(1, 4)).sum() * (float("nan") if st.step == 2 else 1.0)
        backward(loss)
        return loss.item()

    with pytest.raises(FloatingPointError, match="probe: non-finite loss nan at step 2"):
        fit(step_fn, opt, list(model.parameters()), Budget(5), lambda s, _f: 0.1, 1.0, name="probe")
    assert calls == [0, 1, 2] and all(p.grad is None for p in model.parameters())  # zeroed, no NaN backward


def test_hooks_run_on_their_cadence_and_a_resumed_run_continues_the_count():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = {"eval": [], "save": [], "step": []}

    def run(start, stop_at):
        return fit(_steps(model, [], [], opt), opt, list(model.parameters()), Budget(10, stop_at=stop_at),
                   lambda s, _f: 0.1, 1.0, start=start, on_step=lambda st: seen["step"].append(st.step),
                   evaluate=lambda st: seen["eval"].append(st.step) or {"at": st.step}, eval_every=4,
                   checkpoint=seen["save"].append, save_every=3)

    first = run(0, 7)
    assert (first.step, first.steps_run, first.last_eval) == (7, 7, {"at": 4})
    second = run(first.step, None)
    assert (second.step, second.steps_run, second.last_eval) == (10, 3, {"at": 10})
    assert seen["step"] == list(range(1, 11))
    assert seen["eval"] == [4, 8, 10]  # every 4 steps and at the schedule's last step
    assert seen["save"] == [3, 6, 9]  # every 3 steps, never at the stop (the trainer saves there itself)


def test_the_time_budget_ends_the_loop_and_the_schedule_follows_it():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lrs, ticks = [], iter([0.0, 0.5, 0.9, 1.0, 2.0])
    sync_calls = []

    def sync(v):
        sync_calls.append(v)
        return v

    st = fit(_steps(model, [], lrs, opt), opt, list(model.parameters()), Budget(100, seconds=10.0),
             follow_budget(lambda s: float(s), 100), 1.0, clock=lambda: 10.0 * next(ticks), sync=sync)
    assert (st.step, st.timed_out) == (3, True)
    assert lrs == [0.0, 50.0, 90.0]  # the schedule runs at the spent fraction of the time, ahead of the step
    assert sync_calls == [0.0, 0.5, 0.9, 1.0]  # every rank takes the main rank's decision

    # min_steps: a call trains that many steps before it looks at the clock (the conditioner's phases)
    st = fit(_steps(model, [], [], opt), opt, list(model.parameters()), Budget(100, seconds=1.0, min_steps=1),
             lambda s, _f: 0.1, 1.0, clock=lambda: 5.0)
    assert (st.steps_run, st.timed_out) == (1, True)
