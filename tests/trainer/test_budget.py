"""trainer.budget: when the offline loop stops (tokens, seconds, steps: the first reached), what its cosine spans,
and when it evaluates and checkpoints; the recipe's defaults are what train-head always did."""

import pytest

from tests.trainer.test_train_loop import recipe
from trainer.budget import Budget, Cadence, Every, RunClock
from trainer.offline import RunState


def test_the_recipe_budget_is_its_tokens_and_minutes():
    assert Budget.of(recipe()) == Budget(tokens=12_000)
    assert Budget.of(recipe(time_budget_min=2.5), steps=7, decay_over="seconds") == Budget(
        tokens=12_000, seconds=150.0, steps=7, decay_over="seconds")


@pytest.mark.parametrize("state, seconds, reached", [
    (RunState(step=3, tokens=99), 9.9, False),
    (RunState(step=3, tokens=100), 0.0, True),  # tokens
    (RunState(step=3, tokens=0), 10.0, True),  # seconds of this call
    (RunState(step=5, tokens=0), 0.0, True),  # steps
])
def test_the_first_limit_reached_stops_the_loop(state, seconds, reached):
    assert Budget(tokens=100, seconds=10.0, steps=5).reached(state, seconds) is reached


@pytest.mark.parametrize("kw, message", [
    (dict(tokens=None), "needs a limit"),
    (dict(tokens=None, steps=3), "decay_over 'tokens' needs a budget of tokens"),
    (dict(tokens=10, decay_over="seconds"), "needs a budget of seconds"),
    (dict(tokens=0), "tokens 0 must be > 0"),
    (dict(tokens=10, seconds=-1.0), "seconds -1.0 must be > 0"),
])
def test_a_budget_without_a_usable_limit_is_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        Budget(**kw)


def test_the_recipe_cadence_is_steps_and_checkpoint_minutes():
    assert Cadence.of(recipe(eval_every=25, checkpoint_minutes=2)) == Cadence(eval_steps=25, checkpoint_seconds=120.0)
    with pytest.raises(ValueError, match="eval_steps 0"):
        Cadence(eval_steps=0)
    with pytest.raises(ValueError, match="checkpoint_seconds -1"):
        Cadence(checkpoint_seconds=-1)


def test_every_is_due_after_its_seconds_and_never_without_them():
    assert Every(0.0).due() and not Every(None).due() and not Every(3600.0).due()


def test_the_clock_counts_on_from_a_resumed_run():
    state = RunState(elapsed_s=100.0)
    clock = RunClock(state)
    clock.t_start -= 2.0  # two seconds into this call
    clock.tick()
    assert state.elapsed_s == pytest.approx(102.0, abs=0.5) and clock.seconds() == pytest.approx(2.0, abs=0.5)
