"""The autoscaler's decision (isbflow.steps.autoscale): Numaflow's cases, pure (no Spark, no NATS)."""

from __future__ import annotations

from isbflow.spec.scale import Scale
from isbflow.steps.autoscale import (
    DOWN,
    NONE,
    UP,
    Lookback,
    VertexScaler,
    decide,
    desired_replicas,
    go_round,
)

FAST = Scale(min=1, max=4, scaleUpCooldownSeconds=10, scaleDownCooldownSeconds=30, replicasPerScaleUp=1,
             replicasPerScaleDown=1, targetProcessingSeconds=10, lookbackSeconds=60)


def test_a_source_asks_for_what_drains_its_backlog_in_target_seconds():
    s = Scale()
    assert desired_replicas(True, s, 10.0, [600]) == 3  # 600 / 10 rows/s / 20 s, one replica now
    assert desired_replicas(True, s, 10.0, [600], current=2) == 6  # the rate is what two replicas do
    assert desired_replicas(True, s, 10.0, [100, 600]) == 3  # the largest partition's answer
    assert desired_replicas(True, s, 0.0, [0]) == 0  # nothing pending, no rate: min
    assert desired_replicas(True, Scale(min=1), 5.0, [0]) == 1  # nothing pending: at least 1 (and min)
    assert desired_replicas(True, s, 1.0, [3]) == 1  # never more than pending... and at least 1
    assert desired_replicas(True, Scale(max=5), 1.0, [10_000]) == 5  # bounded by max


def test_a_udf_keeps_its_buffer_at_the_target_availability():
    s = Scale()  # replicasPerScaleUp 2
    # 80 frames before onFull, 50 to keep free: available / ((limit - pending) / current)
    assert desired_replicas(False, s, 5.0, [0, 55], limit=80, available=50) == 2
    assert desired_replicas(False, s, 5.0, [55], current=2, limit=80, available=50) == 4
    assert desired_replicas(False, s, 5.0, [80], current=3, limit=80, available=50) == 5  # full: current + 2
    assert desired_replicas(False, s, 5.0, [1], limit=80, available=50) == 1  # never more than pending


def test_go_rounds_halves_away_from_zero():
    assert (go_round(2.5), go_round(1.5), go_round(0.49)) == (3, 2, 0)


def test_backlog_scales_up_bounded_by_max_and_replicas_per_scale_up():
    d = decide("v", FAST, True, [10_000], 10.0, 1, since_change_s=100)
    assert (d.desired, d.target, d.direction, d.why) == (4, 2, UP, "backlog")  # +1 at most
    d = decide("v", FAST.model_copy(update={"replicasPerScaleUp": 5}), True, [10_000], 10.0, 1, 100)
    assert (d.desired, d.target) == (4, 4)  # at most max


def test_cooldowns_hold_changes_back():
    d = decide("v", FAST, True, [10_000], 10.0, 1, since_change_s=4)
    assert (d.target, d.direction, d.why, d.cooldown_left_s) == (1, NONE, "scale-up cooldown", 6.0)
    d = decide("v", FAST, True, [0], 0.0, 3, since_change_s=20)
    assert (d.desired, d.target, d.why, d.cooldown_left_s) == (1, 3, "scale-down cooldown", 10.0)


def test_idle_scales_down_by_replicas_per_scale_down_to_min():
    d = decide("v", FAST, True, [0], 0.0, 3, since_change_s=31)
    assert (d.desired, d.target, d.direction, d.why) == (1, 2, DOWN, "idle capacity")
    d = decide("v", FAST.model_copy(update={"replicasPerScaleDown": 5}), True, [0], 0.0, 3, 31)
    assert d.target == 1


def test_a_running_step_keeps_one_replica_with_min_zero():
    d = decide("v", Scale(min=0, max=3, scaleDownCooldownSeconds=0), True, [0], 0.0, 2, 100)
    assert (d.min, d.desired, d.target) == (1, 1, 1)


def test_outside_the_bounds_moves_at_once_and_disabled_never_moves():
    d = decide("v", FAST, True, [0], 0.0, 7, since_change_s=0)
    assert (d.target, d.why) == (1, "outside min..max")
    d = decide("v", FAST.model_copy(update={"disabled": True}), True, [10_000], 10.0, 1, 100)
    assert (d.target, d.direction, d.why) == (1, NONE, "scale.disabled")


def test_the_lookback_averages_rate_and_pending_over_its_window():
    w = Lookback(10)
    w.add(0, 0, [100])
    assert w.rate() == 0.0 and w.pending() == [100]
    w.add(5, 500, [50])
    w.add(10, 1000, [0])
    assert w.rate() == 100.0 and w.pending() == [50]
    w.add(20, 1000, [0])  # the samples before t=10 leave the window
    assert w.rate() == 0.0 and w.pending() == [0]


def test_a_batch_longer_than_the_lookback_is_not_taken_for_idle():
    sc = VertexScaler("in", FAST.model_copy(update={"lookbackSeconds": 3}), source=True, now=0)
    sc.look(0, 0, [100_000], last_batch_rate=0.0)
    d = sc.look(5, 0, [100_000], last_batch_rate=0.0)  # nothing measured yet: nothing to say
    assert (d.rate, d.desired, d.target) == (0.0, 1, 1)
    sc.look(10, 30_000, [70_000], last_batch_rate=4_000.0)  # a batch of 30,000 ended
    d = sc.look(20, 30_000, [70_000], last_batch_rate=4_000.0)  # the next runs 10 s: no batch in the window
    assert (d.rate, d.desired, d.target, d.why) == (4_000.0, 2, 2, "backlog")  # 70,000 / 4,000 / 10 s


def test_a_vertex_scaler_goes_up_on_a_backlog_and_down_after_the_cooldown():
    sc = VertexScaler("in", FAST, source=True, now=0)
    assert sc.current == 1
    sc.look(0, 0, [100_000])
    d = sc.look(11, 1_100, [98_900])  # 100 rows/s: 98,900 / 100 / 10 s -> far above max
    assert (d.direction, d.target, sc.current, sc.ups) == (UP, 2, 2, 1)
    d = sc.look(12, 1_300, [98_700])
    assert (d.why, sc.current) == ("scale-up cooldown", 2)
    sc.window = Lookback(1)  # idle from here on: a short window forgets the backlog
    d = sc.look(20, 100_000, [0])
    assert (d.why, sc.current) == ("scale-down cooldown", 2)  # 9 s after the scale-up
    d = sc.look(50, 100_000, [0])
    assert (d.direction, d.target, sc.current, sc.downs) == (DOWN, 1, 1, 1)
    assert "pending [0]" in d.log_line() and "1..4" in d.log_line()
