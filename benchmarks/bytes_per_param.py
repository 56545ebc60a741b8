"""Model data per parameter per rank, measured: 1 and W ranks, GA 1 and > 1, with and without placement.

    python benchmarks/bytes_per_param.py                        # small GPT, 1 and 2 ranks, GA 1 and 2
    python benchmarks/bytes_per_param.py --model tiny --world-sizes 1,2,3 --grad-accums 1,4

Each case trains ``--steps`` optimizer steps of a ``gpt_model`` preset in bf16 with stage
"patrickstar" (``configs/patrickstar_cpu.json``), every rank in its own process under
``torch.distributed.run``. Placement "off" is the plain CPU run (one memory); placement "on" is the
strict emulated accelerator with a device budget of ``--budget-bytes-per-param`` x parameters / W
(+ ``--activation-mib`` for activations), so chunks and optimizer states are split between the emulated
accelerator and the host and move between them.

Rank 0 reads ``engine.optimizer.model_data_bytes()`` (chunks, including other ranks' chunks while
their group is gathered, gradient accumulators, fp32 master / momentum / variance; on the
accelerator and on the host) at the end of every forward, every backward and every optimizer
step. The table shows, over the model's parameter count: the highest reading ("peak") and the
reading after the last step ("after step"), per rank; a rank owns 1/W of the model, so W ranks
summed hold W x these figures.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def case_config(args, world_size, grad_accum, placement, params):
    sys.path[:0] = [str(HERE)]
    import bench_utils as bu

    config = bu.load_config(bu.CONFIG_DIR / "patrickstar_cpu.json")
    config.pop("scheduler", None)
    config["train_micro_batch_size_per_gpu"] = args.batch
    config["gradient_accumulation_steps"] = grad_accum
    zero = config["zero_optimization"]
    zero["chunk_size"] = args.chunk_size
    if placement:
        zero["emulate_accelerator"] = True
        zero["device_budget"] = int(args.budget_bytes_per_param * params / world_size) + args.activation_mib * 2**20
    return config


def run_case(args):
    """One case, inside torch.distributed.run: train and read the model data at every moment."""
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    import deepspeed
    import gpt_model
    import torch

    import ds_patrickstar  # noqa: F401  (registers the stage)

    torch.manual_seed(0)
    model, cfg = gpt_model.build_model(args.model)
    params = gpt_model.count_params(model)
    config = case_config(args, int(os.environ["WORLD_SIZE"]), args.grad_accum, args.placement, params)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    readings = {"forward": 0, "backward": 0, "step": 0}

    def read(moment):
        readings[moment] = max(readings[moment], engine.optimizer.model_data_bytes())

    gen = torch.Generator().manual_seed(int(os.environ["RANK"]))
    for _ in range(args.steps * args.grad_accum):
        x = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=gen)
        logits = engine(x)
        read("forward")
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x.flatten())
        engine.backward(loss)
        read("backward")
        engine.step()
        read("step")
    if int(os.environ["RANK"]) == 0:
        after = engine.optimizer.model_data_bytes()
        moved = engine.get_patrickstar_counters()["bytes_to_host"]
        Path(args.result).write_text(json.dumps({"params": params, "readings": readings, "after_step": after,
                                                 "bytes_to_host_last_step": moved}))


def measure(args, world_size, grad_accum, placement):
    with tempfile.TemporaryDirectory(prefix="bytes_per_param_") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world_size),
               "--master_port", str(_free_port()), str(Path(__file__).resolve()), "--case",
               "--model", args.model, "--batch", str(args.batch), "--seq-len", str(args.seq_len),
               "--steps", str(args.steps), "--chunk-size", str(args.chunk_size),
               "--budget-bytes-per-param", str(args.budget_bytes_per_param),
               "--activation-mib", str(args.activation_mib),
               "--grad-accum", str(grad_accum), "--result", str(result)] + (["--placement"] if placement else [])
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world_size)))
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0 or not result.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return {"error": f"exit {done.returncode}: {' | '.join(tail)[:300]}"}
        return json.loads(result.read_text())


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--world-sizes", default="1,2")
    p.add_argument("--grad-accums", default="1,2")
    p.add_argument("--placements", default="off,on", help="off: plain CPU run; on: strict emulated accelerator")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per case")
    p.add_argument("--chunk-size", type=int, default=262144, help="elements per chunk")
    p.add_argument("--budget-bytes-per-param", type=float, default=8.0,
                   help="placement on: device budget per parameter of the rank's share (model data is ~14)")
    p.add_argument("--activation-mib", type=int, default=16, help="placement on: budget added for activations")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per case")
    p.add_argument("--json", default=None)
    # one case (internal)
    p.add_argument("--case", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--grad-accum", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--placement", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.case:
        run_case(args)
        return 0
    rows = ["| ranks | GA | placement | peak B/param per rank | after step B/param per rank | peak at | "
            "evicted MiB/step |", "|---|---|---|---|---|---|---|"]
    results, ok = [], True
    for world_size in [int(w) for w in args.world_sizes.split(",")]:
        for grad_accum in [int(g) for g in args.grad_accums.split(",")]:
            for placement in [p.strip() == "on" for p in args.placements.split(",")]:
                r = measure(args, world_size, grad_accum, placement)
                results.append({"world_size": world_size, "grad_accum": grad_accum, "placement": placement, **r})
                head = f"| {world_size} | {grad_accum} | {'on' if placement else 'off'} |"
                if "error" in r:
                    ok = False
                    rows.append(f"{head} FAILED: {r['error']} | | | |")
                else:
                    moment, peak = max(r["readings"].items(), key=lambda kv: kv[1])
                    rows.append(f"{head} {peak / r['params']:.2f} | {r['after_step'] / r['params']:.2f} | "
                                f"end of {moment} | {r['bytes_to_host_last_step'] / 2**20:.1f} |")
                print(rows[-1], flush=True)
    print(f"model {args.model}, bf16, batch {args.batch} x seq {args.seq_len}, chunk {args.chunk_size} elements, "
          f"{args.steps} steps; placement on: emulated accelerator, budget {args.budget_bytes_per_param} B/param of "
          f"the rank's share + {args.activation_mib} MiB")
    print("\n".join(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
