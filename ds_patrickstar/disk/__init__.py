"""The disk tier: optimizer states and frozen chunks that host memory cannot hold, on disk.

Owns its configuration (``config.py``: ``offload_optimizer``/``offload_param`` with ``device:
nvme``), which chunks' states and which frozen chunks go to disk and the host bytes that saves
(``budget.py``), the file I/O (``io.py``: the interface, page-aligned buffers and the thread
backend; ``aio.py``: DeepSpeed's ``aio_handle``), the swap files and their folder
(``swap_files.py``), the folder's lock (``swap_lock.py``), their layout in pieces
(``swap_layout.py``), the spilled states with their read-ahead and step stream (``states.py``),
the frozen chunks on disk with their read-ahead in trace order (``frozen.py``) and the tier's
set-up at initialize (``tier.py``).
May import: ``memory``, ``chunks`` and the leaf modules: it is storage, below everything it serves (the
chunk store, the optimizer states, the assembly call it directly).
"""
