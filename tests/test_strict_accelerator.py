"""The strict emulated accelerator: asynchronous copies with poison, hazards, every byte counted.

These pin down the primitives the placement code runs on (see [Note: strict emulated
accelerator]); the training-level consequences are in test_gpu_path_defects.py.
"""
import math

import pytest
import torch

from ds_patrickstar.chunks.chunk import Chunk
from ds_patrickstar.counters import StepCounters
from ds_patrickstar.memory.emulated import EmulatedAccelerator
from ds_patrickstar.memory.ledger import DeviceBudgetExceeded, DeviceLedger
from ds_patrickstar.memory.pending import CopyHazard
from ds_patrickstar.store.chunk_store import ChunkStore


def test_copy_is_poison_until_waited_on():
    accel = EmulatedAccelerator(1 << 20)
    src = torch.arange(8, dtype=torch.float32)
    dst = accel.empty(8, torch.float32, "chunk", "test buffer")
    pending = accel.copy(dst, src)
    assert torch.isnan(dst).all()  # a consumer that does not wait reads NaN
    pending.wait()
    assert torch.equal(dst, src)


def test_waiting_completes_earlier_copies_in_stream_order():
    accel = EmulatedAccelerator(1 << 20)
    a = torch.arange(4, dtype=torch.float32)
    b = torch.empty(4)
    c = torch.empty(4)
    first = accel.copy(b, a)
    second = accel.copy(c, b)  # reads what the first one writes
    second.wait()
    assert first.done() and torch.equal(c, a)


def test_freeing_a_source_before_its_copy_completes_raises():
    accel = EmulatedAccelerator(1 << 20)
    src = accel.empty(16, torch.float32, "chunk", "source")
    src.fill_(1.0)
    pending = accel.copy(torch.empty(16), src)
    src.untyped_storage().resize_(0)  # freed behind the copy's back
    with pytest.raises(CopyHazard, match="freed"):
        pending.wait()


def test_free_after_a_copy_waits_for_it():
    accel = EmulatedAccelerator(1 << 20)
    src = accel.empty(16, torch.float32, "chunk", "source")
    src.fill_(2.0)
    dst = torch.empty(16)
    pending = accel.copy(dst, src)
    accel.free(src, "chunk", after=pending)
    accel.reclaim()
    assert src.untyped_storage().nbytes() > 0  # still read by the copy: still allocated and charged
    assert accel.ledger.total == 64 and accel.in_flight_bytes() == 64
    accel.reclaim(need_below=0)  # room needed: wait on the copy, then free
    assert torch.equal(dst, torch.full((16,), 2.0)) and src.untyped_storage().nbytes() == 0
    assert accel.ledger.total == 0


def test_freeing_a_buffer_before_its_collective_is_waited_on_raises():
    """[Note: collective buffers]: a collective holds its buffers until its wait; the twin raises on an
    early free (on a GPU the allocator would hand the block on while the collective's stream used it)."""
    accel = EmulatedAccelerator(1 << 20)
    buf = accel.empty(8, torch.float32, "chunk", "a group's storage")
    with accel.collective_stream("reduce_scatter", buf) as issue:
        pass
    with pytest.raises(CopyHazard, match="collective"):
        accel.free(buf, "chunk")
    issue.complete()
    accel.free(buf, "chunk")
    assert accel.ledger.total == 0
    with pytest.raises(ValueError, match="'broadcast'"):
        with accel.collective_stream("broadcast", buf):
            pass


def test_overwriting_a_source_before_its_copy_completes_raises():
    accel = EmulatedAccelerator(1 << 20)
    src = torch.ones(4)
    pending = accel.copy(torch.empty(4), src)
    src.add_(1.0)
    with pytest.raises(CopyHazard, match="overwritten"):
        pending.wait()


def test_allocation_past_the_budget_names_what():
    ledger = DeviceLedger(1000)
    ledger.charge(600, "chunk", "chunk 0")
    ledger.non_model = 200
    with pytest.raises(DeviceBudgetExceeded, match="gathered copy.*1,000 B"):
        ledger.charge(300, "gather", "gathered copy of group 3")
    ledger.release(600, "chunk")
    assert ledger.total == 0 and ledger.peak == 600


def test_an_owned_chunk_lives_in_one_place_at_a_time():
    accel = EmulatedAccelerator(1 << 20)
    store = ChunkStore(accel, StepCounters(), movable=True)
    chunk = Chunk(0, 256, torch.bfloat16, 0)
    store.create(chunk, owned=True)
    chunk.ready().copy_(torch.arange(256, dtype=torch.bfloat16))
    store.settle(chunk)
    assert accel.ledger.total == 0 and store.host_bytes == 512
    store.to_device(chunk)
    assert chunk.host is None and store.host_bytes == 0 and accel.ledger.total == 512
    assert torch.isnan(chunk.payload.float()).all()  # the copy is in flight
    assert torch.equal(chunk.ready(), torch.arange(256, dtype=torch.bfloat16))
    chunk.prefetched = True
    store.to_host(chunk)
    assert not chunk.prefetched  # a prefetch evicted before use is not a hit
    assert accel.ledger.total == 512 and store.host_bytes == 512  # the payload is freed once copied out
    assert math.isnan(float(chunk.host[0]))  # the eviction is asynchronous too
    assert torch.equal(chunk.ready(), torch.arange(256, dtype=torch.bfloat16))
    accel.reclaim()
    assert chunk.payload.untyped_storage().nbytes() == 0 and accel.ledger.total == 0
