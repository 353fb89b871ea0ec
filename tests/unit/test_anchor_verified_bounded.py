"""A delta directory's producer and consumer keep a bounded set of verified anchor epochs over a long run.

Each anchor marker carries a fresh random epoch; the producer (``write_anchor(own_engine=True)``) and a
consumer (``accept_anchor`` / fingerprint verification / ``load_full``) remember the epochs they verified.
A trainer anchoring every few versions for thousands of updates must not keep one entry per anchor ever
written: only markers still in the directory (pruning drops the old ones) can be asked about.
"""

from __future__ import annotations

from megatron_logra.sync import DirectoryTransport, SyncError

ANCHORS = 300


class _AtVersion:
    """A consumer engine that only reports its version (it cannot fingerprint: verification must come from
    the remembered epoch)."""

    def __init__(self, version: int) -> None:
        self.weight_version = version

    def fingerprint(self):
        return None


def test_verified_epochs_stay_bounded_while_anchors_are_pruned(tmp_path):
    producer = DirectoryTransport(tmp_path / "rank0")
    consumer = DirectoryTransport(tmp_path / "rank0")
    for version in range(ANCHORS):
        producer.write_anchor(version, None, own_engine=True)
        producer.prune(version + 1)  # keeps the newest anchor at or below the chain's end
        consumer.accept_anchor(version)
        consumer.verify_anchor(_AtVersion(version))  # the newest anchor stays verified
        producer.verify_anchor(_AtVersion(version))
    assert len(producer._verified) <= 64
    assert len(consumer._verified) <= 64
    assert len(producer.anchors()) <= 2


def test_a_dropped_epoch_is_never_one_still_in_the_directory(tmp_path):
    # keep every marker (nothing pruned): the set may grow with the directory, but never forgets one on disk
    producer = DirectoryTransport(tmp_path / "rank0")
    for version in range(100):
        producer.write_anchor(version, None, own_engine=True)
    on_disk = {a["epoch"] for a in producer.anchors()}
    assert on_disk <= producer._verified
    for version in range(100):
        producer.verify_anchor(_AtVersion(version))


def test_a_marker_rewritten_at_a_version_is_still_unverified(tmp_path):
    producer = DirectoryTransport(tmp_path / "rank0")
    consumer = DirectoryTransport(tmp_path / "rank0")
    for version in range(80):  # past the sweep limit
        producer.write_anchor(version, None)
        producer.prune(version + 1)
        consumer.accept_anchor(version)
    producer.write_anchor(79, None)  # a restarted trainer refits at the same version: a new epoch
    try:
        consumer.verify_anchor(_AtVersion(79))
    except SyncError as exc:
        assert exc.kind == "anchor"
    else:
        raise AssertionError("a rewritten marker must not count as verified")
