"""Memory: where bytes live and who pays for them.

Owns the accelerator primitives (``accelerator.py``: allocate, free, copy, wait; the host
accelerator of a plain CPU run), what an asynchronous operation hands back (``pending.py``), the
CUDA accelerator (``cuda.py``) and its strict CPU twin (``emulated.py``, with the model of CUDA's
caching allocator in ``caching_allocator.py``), the device ledger that counts every accelerator
byte under the budget (``ledger.py``), the host pool that hands out every pinned host buffer of
model data (``host_pool.py``), the fp32 states of one chunk as the optimizer and the disk tier see
them (``optimizer_chunk.py``), the C heap's mmap threshold (``host_heap.py``) and the pre-flight
arithmetic (``preflight.py``).
May import: ``chunks`` and the leaf modules ``counters``/``autograd_state``.
"""
