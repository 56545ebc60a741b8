"""Command line: run an unmodified training script with stage "patrickstar" registered.

    python -m ds_patrickstar SCRIPT.py [ARGS ...]
    python -m ds_patrickstar -m MODULE [ARGS ...]
    torchrun --nproc_per_node 2 -m ds_patrickstar SCRIPT.py [ARGS ...]
    deepspeed --num_gpus 2 --module ds_patrickstar SCRIPT.py [ARGS ...]
    accelerate launch -m ds_patrickstar SCRIPT.py [ARGS ...]

[Note: running a script]
Importing ``ds_patrickstar`` registers the stage (see [Note: registration]); the script then
runs as ``__main__`` through :mod:`runpy`, as ``python SCRIPT.py ARGS`` would run it:
``sys.argv`` is ``[SCRIPT.py, ARGS ...]``, ``__file__`` is the script's path, the script's
folder is ``sys.path[0]`` (instead of this package's), and its exit status (``sys.exit(n)``,
an exception) is the process's. A ``--local_rank=N`` that ``deepspeed --module`` puts before
the script is passed on as the script's first argument. With ``-m MODULE`` the module runs as ``python -m MODULE``
would run it (``sys.argv[0]`` is the module's file).
"""

from __future__ import annotations

import builtins
import io
import os
import runpy
import sys
import types

USAGE = "usage: python -m ds_patrickstar SCRIPT.py [ARGS ...]  |  python -m ds_patrickstar -m MODULE [ARGS ...]"


def main(argv: list[str] | None = None) -> None:
    launcher_args, args = _launcher_args(list(sys.argv[1:] if argv is None else argv))
    if not args or args[0] in ("-h", "--help") or (args[0] == "-m" and len(args) < 2):
        print(__doc__.split("[Note")[0].rstrip() + "\n\n" + USAGE, file=sys.stderr if not args else sys.stdout)
        raise SystemExit(2 if not args or args[0] == "-m" else 0)
    import ds_patrickstar  # noqa: F401  (registers stage "patrickstar"; see [Note: registration])

    if args[0] == "-m":
        module, rest = args[1], launcher_args + args[2:]
        sys.argv = [module, *rest]  # runpy puts the module's file here, as python -m does
        sys.path[0] = os.getcwd()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    _run_script(args[0], launcher_args + args[1:])


def _launcher_args(args: list[str]) -> tuple[list[str], list[str]]:
    """``deepspeed --module`` puts ``--local_rank=N`` before the script; the script gets it first in
    its own arguments, where ``deepspeed SCRIPT.py`` would have put it."""
    n = 0
    while n < len(args) and args[n].startswith(("--local_rank", "--local-rank")):
        n += 1
    return args[:n], args[n:]


def _run_script(script: str, rest: list[str]) -> None:
    """``script`` as ``__main__``, as ``python SCRIPT ARGS`` runs it; see [Note: running a script]."""
    path = os.path.abspath(script)
    if not os.path.exists(path):
        raise SystemExit(f"python -m ds_patrickstar: can't open file {path!r}: [Errno 2] No such file or directory")
    sys.argv = [script, *rest]
    sys.path[0] = os.path.dirname(path)
    if not os.path.isfile(path):  # a folder or zip file with a __main__.py
        runpy.run_path(script, run_name="__main__")
        return
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None)
    sys.modules["__main__"] = module  # pickle and multiprocessing's spawn find the script's objects here
    exec(code, module.__dict__)


if __name__ == "__main__":
    main()
