"""The ledger file layout is a protocol between processes: pin it.

If this test fails you moved, resized, added or removed a field, or changed
the record counts or the lock bytes. Processes of the old and the new layout
would then read each other's bytes wrongly, so bump ``LAYOUT_VERSION`` in
kvcached/ledger/layout.py and update PINNED below (version and fingerprint
together) and the offset table.
"""

from __future__ import annotations

from kvcached.ledger import layout

PINNED = (3, "7190ac508c08154e")

OFFSETS = {
    "Header.magic": (0, 8),
    "Header.layout_version": (8, 4),
    "Header.header_size": (12, 4),
    "Header.pool_record_size": (16, 4),
    "Header.pool_slots": (20, 4),
    "Header.instance_record_size": (24, 4),
    "Header.instance_slots": (28, 4),
    "Header.file_size": (32, 8),
    "Header.created_ns": (40, 8),
    "Header.device_id": (48, 64),
    "Header.total_bytes": (112, 8),
    "Header.safety_margin": (120, 8),
    "Header.budget": (128, 8),
    "Header.calibration_seq": (136, 8),
    "Header.calibration_time_ns": (144, 8),
    "Header.calibration_free": (152, 8),
    "Header.pool_high_water": (160, 4),
    "Header.retire_instance": (164, 4),
    "Header.retire_budget": (168, 8),
    "Header.retire_slot": (176, 4),
    "Header.publish_pending": (180, 4),
    "Header.publish_budget": (184, 8),
    "Header.publish_free": (192, 8),
    "Header.publish_time_ns": (200, 8),
    "Header.publish_seq": (208, 8),
    "Header.window_granted": (216, 8),
    "Header.window_open": (224, 4),
    "Header._reserved0": (228, 4),
    "Header._reserved": (232, 24),
    "PoolRecord.token": (0, 8),
    "PoolRecord.charged": (8, 8),
    "PoolRecord.pid": (16, 4),
    "PoolRecord.instance": (20, 4),
    "PoolRecord.start_time": (24, 8),
    "PoolRecord.registered_ns": (32, 8),
    "PoolRecord.released": (40, 8),
    "PoolRecord.wanted": (48, 8),
    "PoolRecord.wanted_seq": (56, 8),
    "InstanceRecord.token": (0, 8),
    "InstanceRecord.limit": (8, 8),
    "InstanceRecord.revision": (16, 8),
    "InstanceRecord.pid": (24, 4),
    "InstanceRecord._reserved0": (28, 4),
    "InstanceRecord.start_time": (32, 8),
    "InstanceRecord.created_ns": (40, 8),
    "InstanceRecord.limit_set_ns": (48, 8),
    "InstanceRecord._reserved": (56, 8),
    "InstanceRecord.name": (64, 64),
}


def test_every_field_offset_and_size_is_pinned():
    assert layout.field_table() == OFFSETS


def test_version_goes_with_the_layout_fingerprint():
    assert (layout.LAYOUT_VERSION, layout.fingerprint()) == PINNED


def test_sizes_and_regions():
    assert layout.MAGIC == b"KVCLEDGR"
    assert (layout.HEADER_SIZE, layout.POOL_RECORD_SIZE, layout.INSTANCE_RECORD_SIZE) == (
        256,
        64,
        128,
    )
    assert (layout.POOL_SLOTS, layout.INSTANCE_SLOTS) == (256, 64)
    assert layout.POOLS_OFFSET == 256
    assert layout.INSTANCES_OFFSET == 256 + 256 * 64
    assert layout.FILE_SIZE == 24832
    assert (layout.DATA_LOCK, layout.CALIBRATOR_LEASE_BYTE) == ("flock", 1)
    # every record starts on a cache line, and lease bytes never meet the header's locks
    assert all(layout.pool_offset(s) % 64 == 0 for s in range(layout.POOL_SLOTS))
    assert all(layout.instance_offset(s) % 64 == 0 for s in range(layout.INSTANCE_SLOTS))
    assert layout.pool_offset(0) > layout.CALIBRATOR_LEASE_BYTE


def test_identity_fields_come_first_in_records():
    # A record's token is its "in use" mark: at offset 0, one aligned 8-byte word,
    # so it is written and cleared by one store.
    assert OFFSETS["PoolRecord.token"] == (0, 8)
    assert OFFSETS["InstanceRecord.token"] == (0, 8)
