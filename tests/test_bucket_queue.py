"""The batch-forming policy, driven by a fake clock."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batching import BatchPolicy, BucketQueue, DrainRate, Pending, QueueFull


def pending(bucket, at: float, timeout: float = 10.0, name: str = "") -> Pending:
    return Pending(payload=name, bucket=bucket, cost=1.0, enqueued_at=at, deadline=at + timeout)


def test_a_bucket_waits_until_it_is_full_or_its_oldest_request_has_waited_long_enough():
    queue = BucketQueue(BatchPolicy(max_batch_size=3, max_wait_s=0.5, max_queue=10))
    queue.push(pending(64, at=0.0))
    queue.push(pending(64, at=0.1))
    assert queue.next_batch(now=0.2) is None
    plan = queue.next_batch(now=0.5)
    assert plan is not None and len(plan) == 2


def test_a_full_bucket_launches_at_once():
    queue = BucketQueue(BatchPolicy(max_batch_size=2, max_wait_s=60, max_queue=10))
    queue.push(pending(64, at=0.0))
    queue.push(pending(64, at=0.0))
    plan = queue.next_batch(now=0.0)
    assert plan is not None and plan.bucket == 64 and len(plan) == 2


def test_a_batch_never_exceeds_max_batch_size_and_keeps_arrival_order():
    queue = BucketQueue(BatchPolicy(max_batch_size=3, max_wait_s=0, max_queue=10))
    for i in range(5):
        queue.push(pending(64, at=0.0, name=str(i)))
    first = queue.next_batch(now=1.0)
    second = queue.next_batch(now=1.0)
    assert [p.payload for p in first.items] == ["0", "1", "2"]
    assert [p.payload for p in second.items] == ["3", "4"]
    assert queue.next_batch(now=1.0) is None


def test_requests_of_different_buckets_never_share_a_batch():
    queue = BucketQueue(BatchPolicy(max_batch_size=8, max_wait_s=0, max_queue=10))
    queue.push(pending(64, at=0.0))
    queue.push(pending(128, at=0.0))
    plans = [queue.next_batch(now=1.0), queue.next_batch(now=1.0)]
    assert sorted(p.bucket for p in plans) == [64, 128]
    assert all(len(p) == 1 for p in plans)


def test_merged_buckets_top_a_batch_up_from_the_nearest_widths():
    policy = BatchPolicy(max_batch_size=4, max_wait_s=0, max_queue=10, merge_buckets=True)
    queue = BucketQueue(policy)
    queue.push(pending(128, at=0.0, timeout=1, name="first"))
    for width in (512, 64, 192, 1024):
        queue.push(pending(width, at=0.5, name=str(width)))
    plan = queue.next_batch(now=1.0)
    assert [p.payload for p in plan.items] == ["first", "64", "192", "512"]
    assert plan.bucket == 512  # the batch pads to its widest member
    assert [p.payload for p in queue.next_batch(now=1.0).items] == ["1024"]


def test_merged_buckets_are_full_together():
    policy = BatchPolicy(max_batch_size=3, max_wait_s=60, max_queue=10, merge_buckets=True)
    queue = BucketQueue(policy)
    queue.push(pending(64, at=0.0))
    queue.push(pending(128, at=0.0))
    assert queue.next_batch(now=0.0) is None
    queue.push(pending(192, at=0.0))
    assert len(queue.next_batch(now=0.0)) == 3


def test_the_oldest_request_waits_max_wait_only_however_many_keep_arriving():
    queue = BucketQueue(BatchPolicy(max_batch_size=8, max_wait_s=0.01, max_queue=10))
    for at in (0.0, 0.003, 0.006, 0.009):
        queue.push(pending(64, at=at))
    assert queue.next_wakeup() == pytest.approx(0.01)
    assert len(queue.next_batch(now=0.01)) == 4


def test_among_ready_buckets_the_earliest_deadline_goes_first():
    queue = BucketQueue(BatchPolicy(max_batch_size=8, max_wait_s=0, max_queue=10))
    queue.push(pending("busy", at=1.0, timeout=10))
    queue.push(pending("rare", at=0.0, timeout=5))
    queue.push(pending("busy", at=1.0, timeout=10))
    assert queue.next_batch(now=2.0).bucket == "rare"


def test_the_queue_refuses_requests_beyond_its_capacity_with_a_retry_hint():
    queue = BucketQueue(BatchPolicy(max_batch_size=8, max_wait_s=1, max_queue=2))
    queue.push(pending(64, at=0.0))
    queue.push(pending(128, at=0.0))
    with pytest.raises(QueueFull) as refused:
        queue.push(pending(64, at=0.0), retry_after_s=7)
    assert refused.value.retry_after_s == 7
    assert len(queue) == 2


def test_requests_past_their_deadline_are_dropped_from_the_queue():
    queue = BucketQueue(BatchPolicy(max_batch_size=8, max_wait_s=100, max_queue=10))
    late = pending(64, at=0.0, timeout=1.0)
    queue.push(late)
    queue.push(pending(64, at=0.5, timeout=5.0))
    assert queue.expire(now=0.9) == []
    assert queue.expire(now=1.0) == [late]
    assert len(queue) == 1


def test_a_removed_request_frees_its_slot():
    queue = BucketQueue(BatchPolicy(max_batch_size=8, max_wait_s=1, max_queue=1))
    gone = pending(64, at=0.0)
    queue.push(gone)
    assert queue.remove(gone)
    assert not queue.remove(gone)
    queue.push(pending(64, at=0.0))
    assert len(queue) == 1


def test_flush_makes_every_bucket_ready_for_draining():
    queue = BucketQueue(BatchPolicy(max_batch_size=8, max_wait_s=100, max_queue=10))
    queue.push(pending(64, at=0.0))
    assert queue.next_batch(now=0.0) is None
    assert len(queue.next_batch(now=0.0, flush=True)) == 1


def test_next_wakeup_is_the_earliest_wait_expiry_or_deadline():
    queue = BucketQueue(BatchPolicy(max_batch_size=8, max_wait_s=0.25, max_queue=10))
    assert queue.next_wakeup() is None
    queue.push(pending(64, at=1.0, timeout=10))
    queue.push(pending(128, at=2.0, timeout=0.1))
    assert queue.next_wakeup() == pytest.approx(1.25)


def test_queued_cost_tracks_waiting_work():
    queue = BucketQueue(BatchPolicy(max_batch_size=2, max_wait_s=0, max_queue=10))
    for cost in (1.0, 2.0, 4.0):
        queue.push(Pending(payload=None, bucket=0, cost=cost, enqueued_at=0, deadline=9))
    assert queue.queued_cost == 7.0
    queue.next_batch(now=1.0)
    assert queue.queued_cost == 4.0


def test_retry_after_follows_the_observed_drain_rate():
    rate = DrainRate(window_s=30)
    assert rate.retry_after(waiting=100) == 1.0  # nothing observed yet
    for t in range(10):
        rate.record(now=t + 1.0, count=10, started=float(t))  # 10 requests per second
    assert rate.retry_after(waiting=100) == pytest.approx(10, abs=1)


def test_retry_after_counts_the_seconds_of_work_not_the_idle_ones_between():
    rate = DrainRate(window_s=30)
    rate.record(now=1.0, count=20, started=0.0)  # a batch of 20 in a second
    rate.record(now=25.0, count=20, started=24.0)  # another after 23 s of quiet
    assert rate.retry_after(waiting=200) == pytest.approx(10, abs=1)
    rate.record(now=40.0, count=20, started=39.0)  # the first has left the window
    assert rate.per_second() == pytest.approx(20)


def test_retry_after_keeps_the_last_rate_through_a_quiet_spell_longer_than_the_window():
    rate = DrainRate(window_s=30)
    rate.record(now=1.0, count=50, started=0.0)  # 50 requests per second of work
    rate.record(now=2.0, count=10, started=1.0)  # then 10: 30 a second over the window
    # Ten minutes later nothing has completed since; the model's rate is still 30/s.
    assert rate.retry_after(waiting=300) == pytest.approx(10, abs=1)
    rate.record(now=700.0, count=5, started=699.0)  # the next completion starts a window
    assert rate.per_second() == pytest.approx(5)


def test_retry_after_counts_overlapping_work_once():
    rate = DrainRate(window_s=30)
    rate.record(now=2.0, count=10, started=0.0)  # two workers, side by side
    rate.record(now=2.5, count=10, started=0.5)
    assert rate.per_second() == pytest.approx(20 / 2.5)


@settings(max_examples=200, deadline=None)
@given(
    arrivals=st.lists(
        st.tuples(st.sampled_from([32, 64, 96]), st.floats(0, 5), st.floats(0.1, 3)),
        max_size=40,
    ),
    max_batch=st.integers(1, 6),
    max_wait=st.floats(0, 1),
    capacity=st.integers(1, 30),
    merge=st.booleans(),
)
def test_every_accepted_request_leaves_exactly_once_in_a_valid_batch(
    arrivals, max_batch, max_wait, capacity, merge
):
    """Property: nothing is lost or duplicated; batches respect size and bucket."""
    policy = BatchPolicy(max_batch, max_wait, capacity, merge_buckets=merge)
    queue = BucketQueue(policy)
    accepted = []
    for i, (bucket, at, timeout) in enumerate(sorted(arrivals, key=lambda a: a[1])):
        item = Pending(payload=i, bucket=bucket, cost=1, enqueued_at=at, deadline=at + timeout)
        try:
            queue.push(item)
            accepted.append(item)
        except QueueFull:
            assert len(queue) == capacity
    out = []
    now = 0.0
    while len(queue):
        now += 0.05
        expired = queue.expire(now)
        out.extend(expired)
        while (plan := queue.next_batch(now)) is not None:
            assert 1 <= len(plan) <= max_batch
            if merge:
                assert plan.bucket == max(p.bucket for p in plan.items)
            else:
                assert {p.bucket for p in plan.items} == {plan.bucket}
            out.extend(plan.items)
    assert sorted(p.payload for p in out) == sorted(p.payload for p in accepted)
    assert queue.queued_cost == 0


def test_next_wakeup_without_an_idle_worker_counts_only_deadlines():
    queue = BucketQueue(BatchPolicy(max_batch_size=8, max_wait_s=0.25, max_queue=10))
    queue.push(pending(64, at=1.0, timeout=10))
    assert queue.next_wakeup(include_wait=False) == pytest.approx(11.0)


@settings(max_examples=200, deadline=None)
@given(
    arrivals=st.lists(
        st.tuples(st.sampled_from([32, 64, 96]), st.floats(0, 2)), min_size=1, max_size=20
    ),
    max_batch=st.integers(2, 30),
    max_wait=st.floats(0, 0.5),
    merge=st.booleans(),
)
def test_a_scheduler_woken_at_next_wakeup_finds_a_batch_or_an_expired_request(
    arrivals, max_batch, max_wait, merge
):
    """Property: readiness and wake-up times agree, so a scheduler that sleeps until
    next_wakeup() neither stalls nor spins."""
    policy = BatchPolicy(max_batch, max_wait, 100, merge_buckets=merge)
    queue = BucketQueue(policy)
    for i, (bucket, at) in enumerate(sorted(arrivals, key=lambda a: a[1])):
        queue.push(Pending(payload=i, bucket=bucket, cost=1, enqueued_at=at, deadline=at + 60))
    now = max(at for _, at in arrivals)
    if queue.next_batch(now) is not None:
        return  # something was ready at once
    wakeup = queue.next_wakeup()
    assert wakeup is not None and wakeup > now
    expired = any(item.deadline <= wakeup for item in queue)
    assert expired or queue.next_batch(wakeup) is not None
