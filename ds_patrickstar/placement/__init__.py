"""Placement: which chunks are on the accelerator at each moment, planned from the activation tide.

Owns the memory tracer and its trace (``tracer.py``), the policy (``policy.py``: Belady eviction,
prefetch, the static policy, which optimizer states fit), the runtime that carries the policy out
at every moment and at the optimizer step (``runtime.py``), the input shapes a trace covers and the
re-traces (``shapes.py``), the trace position of evaluation moments (``positions.py``), what the
chunks in use take at each moment, for the plans (``chunk_needs.py``), the tide plot
(``tide_plot.py``), and the interface the layers above hold with the placement of a run without an
accelerator (``interface.py``).
May import: ``memory``, ``chunks`` and the leaf modules. It talks to the layers above through
the small protocols in ``interface.py`` (activation offload, the reduce-scatters in flight, the
optimizer states' placement), which those layers implement.
"""
