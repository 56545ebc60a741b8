"""Memory: where bytes live and who pays for them.

Owns the accelerator primitives (``accelerator.py``: allocate, free, copy, wait; the host
accelerator of a plain CPU run), the CUDA accelerator (``cuda.py``) and its strict CPU twin
(``emulated.py``), the device ledger that counts every accelerator byte under the budget
(``ledger.py``), the host pool that hands out every pinned host buffer of model data
(``host_pool.py``), the chunk store that creates and moves chunk buffers (``store.py``), binding
parameters to their chunks (``binding.py``), the pre-flight arithmetic (``preflight.py``) and the
disk tier's I/O (``disk_io.py``), swap files (``swap_files.py``) and their layout in pieces
(``swap_layout.py``).
May import: ``chunks`` and the leaf modules ``counters``/``autograd_state``.
"""
