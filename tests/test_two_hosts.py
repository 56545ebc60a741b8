"""Two hosts on one machine: two Linux network namespaces joined by a veth pair, each with its own
address, hostname (a UTS namespace) and swap folder, and ``torchrun --nnodes 2`` with its c10d
rendezvous in each (one rank per host), running tests/scripts/hosts_train.py (disk tier on).

* Training equals the one-host run of the same world size (``torchrun --nproc-per-node 2``): the
  same losses on every rank and the same trained weights, bit for bit.
* A checkpoint saved across the two hosts resumes there exactly.
* The defaults that read the host decide per host: torchrun says each host has one rank
  (``LOCAL_WORLD_SIZE=1``), so a rank has the whole host's memory for its default host budget and
  kept groups, where on one host two ranks split it. The rank processes see a host of
  ``HOST_MEMORY`` (total, available): each host's rank keeps every group gathered and its host
  budget is the available memory less the margin, where the one-host ranks keep none and get
  half the budget; the disk tier spills in both.
* The disk tier uses each host's own folder: a rank's swap files are under its host's
  ``nvme_path`` and their manifest names its host.

Needs root for ``ip netns`` and ``unshare --uts`` (skipped otherwise, with the reason). The names
of the namespaces, veths and the subnet are drawn per run; the namespaces (and their veth pair)
and their ``/etc/netns`` hosts files are removed in every case. About 45 s here (three launches):
marked slow, and run by CI.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from multiproc import free_port
from test_launchers import DIST_ENV

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "hosts_train.py"
TIMEOUT = 150
STEPS, SAVE_STEP = 4, 2
GIB = 1 << 30
# What the rank processes' psutil reports (total, available): the default host budget is the
# available memory less a margin of 1 GiB (10% of 4 GiB is less), 12 KiB per host, less than the
# tiny model's optimizer states, so they spill; the kept-groups rule leaves a rank with the whole
# host room for every group and a rank sharing it none (0.5 GiB for non-model memory first).
HOST_MEMORY = (4 * GIB, GIB + 12 * 1024)
MARGIN = GIB


def _run(*cmd):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _skip_without_namespaces():
    if os.geteuid() != 0:
        pytest.skip("two hosts as network namespaces need root (ip netns, unshare --uts)")
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            pytest.skip(f"two hosts as network namespaces need {tool!r} on PATH")
    probe = f"psprobe{uuid.uuid4().hex[:6]}"
    made = _run("ip", "netns", "add", probe)
    _run("ip", "netns", "del", probe)
    if made.returncode != 0:
        pytest.skip(f"cannot make a network namespace (CAP_NET_ADMIN?): {made.stdout.strip()}")
    uts = _run("unshare", "--uts", "true")
    if uts.returncode != 0:
        pytest.skip(f"cannot make a UTS namespace for a host's own name (CAP_SYS_ADMIN?): {uts.stdout.strip()}")


class TwoHosts:
    """Two namespaces ``A`` and ``B`` joined by a veth pair, at 10.77.<n>.1 and 10.77.<n>.2."""

    def __init__(self, root: Path):
        tag = uuid.uuid4().hex[:6]
        self.tag, self.subnet = tag, int(tag[:2], 16)
        self.hosts = {h: {"ns": f"ps{h}{tag}", "veth": f"ps{h.lower()}{tag}", "addr": f"10.77.{self.subnet}.{i}",
                          "name": f"host{h.lower()}-{tag}", "swap": root / f"host{h}" / "swap"}
                      for i, h in ((1, "A"), (2, "B"))}

    def __enter__(self):
        try:
            self._make()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _make(self):
        a, b = self.hosts["A"], self.hosts["B"]
        lines = "127.0.0.1 localhost\n" + "".join(f"{h['addr']} {h['name']}\n" for h in (a, b))
        for h in (a, b):
            _check("ip", "netns", "add", h["ns"])
            etc = Path("/etc/netns") / h["ns"]  # `ip netns exec` mounts these over /etc: the hosts' names resolve
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(lines)
            h["swap"].mkdir(parents=True)
        _check("ip", "link", "add", a["veth"], "type", "veth", "peer", "name", b["veth"])
        for h in (a, b):
            _check("ip", "link", "set", h["veth"], "netns", h["ns"])
            _check("ip", "-n", h["ns"], "addr", "add", f"{h['addr']}/24", "dev", h["veth"])
            _check("ip", "-n", h["ns"], "link", "set", h["veth"], "up")
            _check("ip", "-n", h["ns"], "link", "set", "lo", "up")

    def __exit__(self, *exc):
        for h in self.hosts.values():
            _run("ip", "netns", "del", h["ns"])  # takes its end of the veth pair, and so the pair
            shutil.rmtree(Path("/etc/netns") / h["ns"], ignore_errors=True)
        for path in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_10.77.{self.subnet}.*"):
            path.unlink(missing_ok=True)

    def launch(self, out: Path, *args: str) -> dict[str, str]:
        """torchrun on both hosts; returns each host's output; fails the test unless both exit 0."""
        return _wait_all(self.start(out, *args))

    def start(self, out: Path, *args: str) -> dict[str, subprocess.Popen]:
        """torchrun started on both hosts (see :func:`_wait_all`)."""
        port = str(free_port())
        procs = {}
        for h in self.hosts.values():
            env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
            env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=h["veth"])
            cmd = ["ip", "netns", "exec", h["ns"], "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                   h["name"], sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.hosts['A']['addr']}:{port}",
                   "--rdzv-id", self.tag, "--local-addr", h["addr"], str(SCRIPT), "--out", str(out),
                   "--nvme-path", str(h["swap"]), *args]
            procs[h["name"]] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        return procs


def _check(*cmd):
    done = _run(*cmd)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stdout.strip()}")


def _wait_all(procs):
    """Wait for every process (their process groups killed after TIMEOUT); fails the test unless all
    exit 0, with their output."""
    outputs, late = {}, []
    deadline = time.monotonic() + TIMEOUT
    for name, proc in procs.items():
        try:
            outputs[name] = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
        except subprocess.TimeoutExpired:
            late.append(name)
            os.killpg(proc.pid, signal.SIGKILL)
            outputs[name] = proc.communicate()[0]
    report = "".join(f"\n---- {name} (exit {p.returncode}):\n{outputs[name][-3000:]}" for name, p in procs.items())
    assert not late, f"{late} did not finish within {TIMEOUT} s{report}"
    assert all(proc.returncode == 0 for proc in procs.values()), report
    return outputs


def _one_host(out: Path, swap: Path, *args: str) -> dict[str, subprocess.Popen]:
    """torchrun with both ranks on this host, started (see :func:`_wait_all`)."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env["OMP_NUM_THREADS"] = "1"
    swap.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), str(SCRIPT), "--out", str(out), "--nvme-path", str(swap), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    return {"one host": proc}


def _ranks(out: Path):
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_two_hosts_train_resume_and_decide_per_host(tmp_path):
    _skip_without_namespaces()
    memory = ["--host-memory", ",".join(map(str, HOST_MEMORY))]
    with TwoHosts(tmp_path) as hosts:
        # the one-host run side by side with the first two-host run: its own port, folders and swap
        _wait_all({**hosts.start(tmp_path / "two", *memory, "--save-step", str(SAVE_STEP), "--ckpt",
                                 str(tmp_path / "ckpt")),
                   **_one_host(tmp_path / "one", tmp_path / "onehost" / "swap", *memory)})
        hosts.launch(tmp_path / "resumed", *memory, "--load", str(tmp_path / "ckpt"))
    two, resumed, one = _ranks(tmp_path / "two"), _ranks(tmp_path / "resumed"), _ranks(tmp_path / "one")
    names = {h["name"]: h for h in hosts.hosts.values()}

    # training equals the one-host run at the same world size, and a resume repeats it
    assert [r["losses"] for r in two] == [r["losses"] for r in one]
    assert len({r["weights"] for r in two + one}) == 1
    assert [r["losses"] for r in resumed] == [r["losses"][SAVE_STEP:] for r in two]
    assert [r["weights"] for r in resumed] == [r["weights"] for r in two]

    available = HOST_MEMORY[1] - MARGIN
    for run in (two, resumed):
        assert sorted(r["host"] for r in run) == sorted(names)  # one rank on each host
        for r in run:
            host = names[r["host"]]
            # the defaults decided for a host of one rank
            assert r["local_world_size"] == 1 and r["keep_gathered"] is None and r["host_budget"] == available, r
            # the disk tier on the host's own folder, its manifest naming the host
            assert r["spilled"], r
            assert Path(r["swap_folder"]).parent.parent == host["swap"] and r["manifest_host"] == host["name"], r
    for r in one:
        assert r["local_world_size"] == 2 and r["keep_gathered"] == 0 and r["host_budget"] == available // 2, r
        assert r["spilled"], r
