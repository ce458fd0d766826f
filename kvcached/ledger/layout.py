"""The byte layout of a ledger file: one header, then pool records, then instance records.

Every process that shares a GPU maps the same file and reads these structures
in place, so the layout is a protocol. Rules it keeps (after LMDB's lock file):

* the magic and the layout version come first, followed by the sizes of every
  part, so a reader can tell *which* thing differs before it touches anything;
* records are fixed-size and aligned to 64-byte cache lines, so two processes
  that update their own records never share a line;
* a record's owner identity (``token``, non-zero while the slot is in use) is
  written last when a slot is taken and cleared first when it is given back, so
  a record half-written by a process that died never looks live;
* a slot that is not in use has ``charged == released == 0``, so a sum over
  every slot is a sum over the slots in use;
* nothing in the file is an aggregate: totals are sums over records.

``test_layout.py`` pins every field's offset and size together with
:data:`LAYOUT_VERSION`: moving a field without bumping the version fails it.

Locks are fcntl OFD byte-range locks on bytes of this file (see
:mod:`kvcached.ledger.locks`); which byte means what is fixed here too, and
so are the word indices (``H_*``, ``p_*``, ``i_*``) by which the ledger and
its pools read and write the fields in place.
"""

from __future__ import annotations

import ctypes
import hashlib

MAGIC = b"KVCLEDGR"
LAYOUT_VERSION = 3

POOL_SLOTS = 256
INSTANCE_SLOTS = 64
NAME_BYTES = 64  # an instance name is at most 48 characters; the rest stays NUL
DEVICE_ID_BYTES = 64
CACHE_LINE = 64


class Header(ctypes.Structure):
    """The file's first 256 bytes.

    The first 128 bytes are written once, when the file is created, and only
    read afterwards. The second half changes, all of it under the data lock:

    * ``budget`` and the calibration fields;
    * ``pool_high_water``, a structural hint: no slot at or above it has ever
      been used, so sums may stop there;
    * two journals that make a multi-word change atomic against a crash: the
      retirement of a record (``retire_*``, see
      :class:`kvcached.ledger.journal.HeaderJournal`) and the
      publication of a calibration (``publish_*``: budget, free, time and
      sequence land together or not at all). ``retire_slot`` and
      ``publish_pending`` share one 8-byte word, so one test tells a lock
      holder whether a journal is pending;
    * the calibration window: ``window_open`` while a calibrator samples the
      driver, and ``window_granted``, the bytes granted since it opened, which
      its publication subtracts (growth inside the window is in the charges
      and possibly not yet out of the sampled free memory).

    Who holds the data lock is not stored: the kernel lists a flock lock's
    holder in ``/proc/locks`` (see :func:`kvcached.ledger.locks.flock_holder`).
    """

    _fields_ = [
        ("magic", ctypes.c_char * 8),
        ("layout_version", ctypes.c_uint32),
        ("header_size", ctypes.c_uint32),
        ("pool_record_size", ctypes.c_uint32),
        ("pool_slots", ctypes.c_uint32),
        ("instance_record_size", ctypes.c_uint32),
        ("instance_slots", ctypes.c_uint32),
        ("file_size", ctypes.c_uint64),
        ("created_ns", ctypes.c_uint64),
        ("device_id", ctypes.c_char * DEVICE_ID_BYTES),
        ("total_bytes", ctypes.c_int64),
        ("safety_margin", ctypes.c_int64),
        # -- mutable part, from byte 128 -------------------------------------------
        ("budget", ctypes.c_int64),
        ("calibration_seq", ctypes.c_uint64),
        ("calibration_time_ns", ctypes.c_uint64),
        ("calibration_free", ctypes.c_int64),
        ("pool_high_water", ctypes.c_uint32),
        ("retire_instance", ctypes.c_uint32),
        ("retire_budget", ctypes.c_int64),
        ("retire_slot", ctypes.c_uint32),
        ("publish_pending", ctypes.c_uint32),
        ("publish_budget", ctypes.c_int64),
        ("publish_free", ctypes.c_int64),
        ("publish_time_ns", ctypes.c_uint64),
        ("publish_seq", ctypes.c_uint64),
        ("window_granted", ctypes.c_int64),
        ("window_open", ctypes.c_uint32),
        ("_reserved0", ctypes.c_uint32),
        ("_reserved", ctypes.c_uint8 * 24),
    ]


class PoolRecord(ctypes.Structure):
    """One pool: the physical bytes charged to it and who owns it.

    ``charged`` is what the budget is checked against. ``released`` is the part
    of it whose release is confirmed but whose refund is still batched in the
    owner process (always ``<= charged``); its owner writes it without the data
    lock (one aligned word, one writer), and calibration subtracts it, because
    that memory is already counted in the driver's free figure.

    ``wanted`` and ``wanted_seq`` are the pool's call for memory from its
    neighbours: the bytes it lacked when its allocations last missed for want of
    the device's budget, and a count its owner bumps with every such call (one
    writer, no lock, like ``released``; the count is written last). Other
    instances on the device that hold idle memory release some when the count
    moves (:mod:`kvcached.control.yielding`).

    ``instance`` is the instance slot + 1 (0: none). ``start_time`` is the
    owner's process start time in clock ticks since boot (``/proc/PID/stat``
    field 22), shown by ``kvctl`` beside the pid. Liveness is never read from
    these fields: it is the owner lease (a lock on this record's first byte).
    """

    _fields_ = [
        ("token", ctypes.c_uint64),
        ("charged", ctypes.c_int64),
        ("pid", ctypes.c_int32),
        ("instance", ctypes.c_uint32),
        ("start_time", ctypes.c_uint64),
        ("registered_ns", ctypes.c_uint64),
        ("released", ctypes.c_int64),
        ("wanted", ctypes.c_int64),
        ("wanted_seq", ctypes.c_uint64),
    ]


class InstanceRecord(ctypes.Structure):
    """One instance (``KVCACHED_IPC_NAME``): its limit on this GPU and the limit's revision.

    ``limit`` 0 means unlimited. ``pid``/``start_time`` name the process that
    created the record (its first pool on this GPU); the pids of every worker
    are in the pool records. The record lives while any pool record refers to it.
    """

    _fields_ = [
        ("token", ctypes.c_uint64),
        ("limit", ctypes.c_int64),
        ("revision", ctypes.c_uint64),
        ("pid", ctypes.c_int32),
        ("_reserved0", ctypes.c_uint32),
        ("start_time", ctypes.c_uint64),
        ("created_ns", ctypes.c_uint64),
        ("limit_set_ns", ctypes.c_uint64),
        ("_reserved", ctypes.c_uint8 * 8),
        ("name", ctypes.c_char * NAME_BYTES),
    ]


HEADER_SIZE = ctypes.sizeof(Header)
POOL_RECORD_SIZE = ctypes.sizeof(PoolRecord)
INSTANCE_RECORD_SIZE = ctypes.sizeof(InstanceRecord)
POOLS_OFFSET = HEADER_SIZE
INSTANCES_OFFSET = POOLS_OFFSET + POOL_SLOTS * POOL_RECORD_SIZE
FILE_SIZE = INSTANCES_OFFSET + INSTANCE_SLOTS * INSTANCE_RECORD_SIZE

# Locks. The data lock (the short lock around every read-modify-write of
# records) is a whole-file flock(2) lock: of the two, it is the cheaper system
# call (measured in benchmarks/ledger.py). Leases are OFD byte-range locks,
# which on Linux never conflict with flock locks; OFD locks cover byte ranges
# and never touch the data under them.
DATA_LOCK = "flock"
CALIBRATOR_LEASE_BYTE = 1  # held (non-blocking) by the one process calibrating


def pool_offset(slot: int) -> int:
    """Byte offset of pool record ``slot``; its first byte is also its owner lease."""
    return POOLS_OFFSET + slot * POOL_RECORD_SIZE


def instance_offset(slot: int) -> int:
    """Byte offset of instance record ``slot``."""
    return INSTANCES_OFFSET + slot * INSTANCE_RECORD_SIZE


# Word indices into the file's typed views (``LedgerFile.i64``/``u64`` in 8-byte
# words, ``u32``/``i32`` in 4-byte ones): the ledger and its pools read and
# write fields in place by these, so they belong with the layout that fixes them.
H_TOTAL = Header.total_bytes.offset // 8
H_MARGIN = Header.safety_margin.offset // 8
H_BUDGET = Header.budget.offset // 8
H_SEQ = Header.calibration_seq.offset // 8
H_CAL_TIME = Header.calibration_time_ns.offset // 8
H_CAL_FREE = Header.calibration_free.offset // 8
H_HIGH_WATER = Header.pool_high_water.offset // 4
H_RETIRE_INSTANCE = Header.retire_instance.offset // 4
H_RETIRE_BUDGET = Header.retire_budget.offset // 8
H_RETIRE_SLOT = Header.retire_slot.offset // 4
H_JOURNAL = Header.retire_slot.offset // 8  # retire_slot and publish_pending: one word
H_PUB_PENDING = Header.publish_pending.offset // 4
H_PUB_BUDGET = Header.publish_budget.offset // 8
H_PUB_FREE = Header.publish_free.offset // 8
H_PUB_TIME = Header.publish_time_ns.offset // 8
H_PUB_SEQ = Header.publish_seq.offset // 8
H_WINDOW = Header.window_open.offset // 4
H_WINDOW_GRANTED = Header.window_granted.offset // 8
#: Words between two records of a kind (the strided views over every slot).
POOL_WORDS = POOL_RECORD_SIZE // 8
INSTANCE_WORDS = INSTANCE_RECORD_SIZE // 8


def p_token(slot: int) -> int:
    return (pool_offset(slot) + PoolRecord.token.offset) // 8


def p_charged(slot: int) -> int:
    return (pool_offset(slot) + PoolRecord.charged.offset) // 8


def p_released(slot: int) -> int:
    return (pool_offset(slot) + PoolRecord.released.offset) // 8


def p_wanted(slot: int) -> int:
    return (pool_offset(slot) + PoolRecord.wanted.offset) // 8


def p_wanted_seq(slot: int) -> int:
    return (pool_offset(slot) + PoolRecord.wanted_seq.offset) // 8


def p_pid(slot: int) -> int:
    return (pool_offset(slot) + PoolRecord.pid.offset) // 4


def p_instance(slot: int) -> int:
    return (pool_offset(slot) + PoolRecord.instance.offset) // 4


def p_start_time(slot: int) -> int:
    return (pool_offset(slot) + PoolRecord.start_time.offset) // 8


def p_registered(slot: int) -> int:
    return (pool_offset(slot) + PoolRecord.registered_ns.offset) // 8


def i_token(slot: int) -> int:
    return (instance_offset(slot) + InstanceRecord.token.offset) // 8


def i_limit(slot: int) -> int:
    return (instance_offset(slot) + InstanceRecord.limit.offset) // 8


def i_revision(slot: int) -> int:
    return (instance_offset(slot) + InstanceRecord.revision.offset) // 8


def i_name(slot: int) -> slice:
    """The byte range of instance record ``slot``'s name (in the raw view)."""
    start = instance_offset(slot) + InstanceRecord.name.offset
    return slice(start, start + NAME_BYTES)


def field_table() -> dict[str, tuple[int, int]]:
    """``"Struct.field" -> (offset, size)`` for every field of every structure."""
    table: dict[str, tuple[int, int]] = {}
    for struct in (Header, PoolRecord, InstanceRecord):
        for name, _ in struct._fields_:
            desc = getattr(struct, name)
            table[f"{struct.__name__}.{name}"] = (desc.offset, desc.size)
    return table


def fingerprint() -> str:
    """A short hash of the whole layout (fields, record counts, sizes, lock bytes)."""
    parts = sorted(f"{k}={v}" for k, v in field_table().items())
    parts += [
        f"pools={POOL_SLOTS}x{POOL_RECORD_SIZE}",
        f"instances={INSTANCE_SLOTS}x{INSTANCE_RECORD_SIZE}",
        f"file={FILE_SIZE}",
        f"locks={DATA_LOCK},{CALIBRATOR_LEASE_BYTE},pool-first-byte",
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _check() -> None:
    assert HEADER_SIZE == 256, "invariant: the header is 256 bytes"
    assert POOL_RECORD_SIZE == CACHE_LINE, "invariant: a pool record is one cache line"
    assert INSTANCE_RECORD_SIZE == 2 * CACHE_LINE, "invariant: an instance record is two lines"
    assert Header.budget.offset == 128, "invariant: the mutable header starts on line 2"
    assert FILE_SIZE % 8 == 0, "invariant: the file is viewable as 64-bit words"
    assert (
        Header.publish_pending.offset == Header.retire_slot.offset + 4
        and Header.retire_slot.offset % 8 == 0
    ), "invariant: both journal markers are one u64 word"


_check()
