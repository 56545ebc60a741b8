"""Placement: which chunks are on the accelerator at each moment, planned from the activation tide.

Owns the memory tracer and its trace (``tracer.py``), the pure planner (``planner.py``: where optimizer
states live, headroom, prefetch, Belady, the room for gathered groups, see [Note: placement planner]), the
eviction order kept online and the static policy (``policy.py``), the per-moment driver (``runtime.py``)
with its moves (``moves.py``), the step's decisions (``step_plan.py``), the model of the driver's moves
that predicts the bytes an iteration moves (``move_model.py``), the remedies a budget error names
(``remedies.py``), the input shapes a trace covers and the re-traces (``shapes.py``), the trace position
of evaluation moments (``positions.py``), what the chunks in use take at each moment, for the plans
(``chunk_needs.py``), the tide plot (``tide_plot.py``), and the interface the layers above hold with the
placement of a run without an accelerator (``interface.py``).
May import: ``store``, ``disk``, ``memory``, ``chunks`` and the leaf modules. Nothing calls up: the one
interface a layer above implements is the activation offload that placement drives (``interface.py``).
"""
