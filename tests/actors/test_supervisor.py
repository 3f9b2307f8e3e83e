import pytest

from sluice.actors.runtime import RestartPolicy, Supervisor


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_backoff_grows_and_too_many_crashes_in_the_window_escalate():
    clock = Clock()
    sup = Supervisor(
        RestartPolicy.restart(
            max_restarts=3, window=10, backoff=0.1, backoff_factor=2, max_backoff=0.3
        ),
        clock,
    )
    delays = []
    for _ in range(3):
        decision = sup.on_crash()
        assert decision.restart
        delays.append(decision.delay)
        clock.now += 1
    assert delays == pytest.approx([0.1, 0.2, 0.3])
    decision = sup.on_crash()
    assert not decision.restart and "exceed max_restarts=3" in decision.reason


def test_crashes_older_than_the_window_are_forgotten():
    clock = Clock()
    sup = Supervisor(RestartPolicy.restart(max_restarts=1, window=5, backoff=0.5), clock)
    assert sup.on_crash().restart
    clock.now += 6
    decision = sup.on_crash()
    assert decision.restart and decision.delay == pytest.approx(0.5)
    assert not sup.on_crash().restart


def test_escalate_policy_never_restarts():
    assert not Supervisor(RestartPolicy.escalate()).on_crash().restart
    assert not Supervisor(RestartPolicy.coerce("escalate")).on_crash().restart
    assert RestartPolicy.coerce("restart") == RestartPolicy()
    with pytest.raises(ValueError):
        RestartPolicy.coerce("retry")
