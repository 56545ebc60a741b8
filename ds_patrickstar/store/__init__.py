"""The chunk store: where each chunk's values live (accelerator, host or disk record), and binding.

Owns the chunk store (``chunk_store.py``: creates, frees and moves chunk payloads between the accelerator,
the host pool and the disk tier's frozen records, the gathered groups' flat storages, the gradient
accumulators; :class:`~ds_patrickstar.chunks.chunk.Home` says where each chunk's values are, and only the
store changes it) and binding parameters to their chunks (``binding.py``).
May import: ``disk``, ``memory``, ``chunks`` and the leaf modules. It calls the disk tier directly: nothing
below it calls up.
"""
