"""A local Ray cluster in a network namespace of its own, for the corpus tests and benchmark.

Ray binds to the machine's network interface even when given ``--node-ip-address 127.0.0.1``, and its
token authentication is off by default, so anyone who can reach the port could run code. Here the head
node and every command run inside ``unshare --net`` (only loopback exists), in one process group of
their own, bounded in time; the head runs with ``--block`` and stops, with its workers, when the
script ends (SIGTERM to it) or when the group is killed on a timeout.
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

ADDRESS = "127.0.0.1:6379"

_SCRIPT = """
set -u
ip link set lo up
ray start --head --block --num-cpus {cpus} --node-ip-address 127.0.0.1 --port 6379 --include-dashboard=false \\
    --object-store-memory 200000000 --disable-usage-stats --temp-dir {temp} > {work}/ray-head.log 2>&1 &
head=$!
trap 'kill -TERM $head 2>/dev/null; wait $head' EXIT
for i in $(seq 90); do ray status --address {address} > /dev/null 2>&1 && break; sleep 1; done
cd {work}
{steps}
"""


def ray_session(work: Path, steps: list[tuple[str, list[str]]], timeout: float, cpus: int = 2) -> dict:
    """Start the cluster, run each ``(name, argv)`` in turn inside the namespace (its exit status,
    stdout and stderr in ``work/name.rc|.out|.err``), stop the cluster. Returns {name: (rc, stdout, stderr)}
    (rc None when the step did not run) and the session's own output under "session"."""
    temp = tempfile.mkdtemp(prefix="r", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    lines = [f"{shlex.join(argv)} > {name}.out 2> {name}.err; echo $? > {name}.rc" for name, argv in steps]
    script = work / "ray-session.sh"
    script.write_text(_SCRIPT.format(cpus=cpus, temp=shlex.quote(temp), work=shlex.quote(str(work)),
                                     address=ADDRESS, steps="\n".join(lines)))
    proc = subprocess.Popen(["unshare", "--net", "bash", str(script)], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        log += f"\n(the Ray session ran past {timeout:.0f} s and was killed)"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        shutil.rmtree(temp, ignore_errors=True)
    results = {"session": log}
    for name, _ in steps:
        rc = work / f"{name}.rc"
        results[name] = (int(rc.read_text()) if rc.exists() else None,
                         *((work / f"{name}.{k}").read_text() if (work / f"{name}.{k}").exists() else "" for k in ("out", "err")))
    return results
