"""When a generation ending on the engine thread counts as alone (the store's rooms are then all
filled or given back, which its invariant check holds): not while another request's plan is
being made on the loop, whose admitted rooms reach the thread only with its run. A bench run
had the store actor fail its check when the compaction preparer's cancelled job ended while
the request that stopped it was being planned."""

from tandem.actors.engine_actor import EngineActor


def _actor() -> EngineActor:
    return EngineActor("engine", make_engine=lambda: None)


def test_a_run_alone_with_no_plan_in_the_making_is_alone():
    actor, job = _actor(), object()
    actor._runs = {"a": object()}
    actor._prefilling = None
    assert actor._alone(job)
    actor._prefilling = job  # its own prefill, not yet told over to the loop
    assert actor._alone(job)


def test_a_plan_being_made_for_another_request_means_not_alone():
    actor, job, other = _actor(), object(), object()
    actor._runs = {"a": object()}
    actor._prefilling = other
    assert not actor._alone(job)


def test_two_runs_are_not_alone():
    actor, job = _actor(), object()
    actor._runs = {"a": object(), "b": object()}
    actor._prefilling = None
    assert not actor._alone(job)
