"""The DeepSpeed glue: everything DeepSpeed, torch's module hooks and Hugging Face see.

Owns the one registration point (``registration.py``) with what it sets up for a run a user
started without a launcher (``launch_env.py``), the config model and split
(``config.py``), the engine subclass (``engine.py``), the ZeRO-optimizer adapter
(``zero_optimizer.py``), the planning of a run before the model changes (``planning.py``), the
assembly that builds and wires every part of a run (``assembly.py``), initialize as a transaction
(``transaction.py``), the hook registry and the hook target (``hooks.py``, ``hook_target.py``), the
wiring of DeepSpeed's activation checkpointing (``ds_checkpointing.py``), the share of host memory
each rank may use (``host_share.py``), the end of a backward pass from autograd
(``backward_end.py``), the ``optimizer`` block and reduction keys (``optimizer_keys.py``), the end of a
run (``teardown.py``), a run's process-wide effects (``process_effects.py``), the step's accounts
for the counters (``accounts.py``) and the Hugging Face adaptations (``hf_compat.py``: accelerate's
stage and process count; ``hf_eval.py``: evaluation without training; ``save_compat.py``: tied weights through
accelerate's copy of the state dict).
May import: every other sub-package (the top layer); nothing imports it but the package root
and the command-line modules.
"""
