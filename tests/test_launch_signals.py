"""Ctrl-C of a launched run (`appo train --num_processes 2`): one line per rank, and nothing after.

A stand-in launcher plays `accelerate launch`: it starts two ranks in its process group, and on SIGINT waits for
them, then prints a traceback (torch's `SignalException` wall). Each rank writes to `appo`'s own stderr
(`attach_stderr`) and prints its one stop line.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import time

from appo_trl.configs.recipes import run_launcher

RANK = textwrap.dedent("""
    import os, signal, sys, time
    from appo_trl.stages.interrupts import attach_stderr, say
    assert attach_stderr()  # as `run_interruptible` does in a launched rank
    def stop(signum, frame):
        say(f"appo train: stopped by SIGINT; rank {sys.argv[1]} kept nothing.")
        os._exit(130)
    signal.signal(signal.SIGINT, stop)
    sys.stderr.write("rank log line before the signal\\n"); sys.stderr.flush()
    open(os.path.join(sys.argv[2], sys.argv[1]), "w").close()
    time.sleep(60)
""")
LAUNCHER = textwrap.dedent("""
    import subprocess, sys
    ranks = [subprocess.Popen([sys.executable, "-c", sys.argv[1], str(r), sys.argv[2]]) for r in range(2)]
    try:
        for p in ranks:
            p.wait()
    except KeyboardInterrupt:
        for p in ranks:
            p.wait()
        raise RuntimeError("torch.distributed.elastic.multiprocessing.api.SignalException: Process got signal: 2")
""")


def test_ctrl_c_of_a_launched_run_prints_one_line_per_rank_and_nothing_after(tmp_path, capfd):
    def interrupt_when_ready():
        deadline = time.monotonic() + 30
        while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_when_ready, daemon=True).start()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo}
    code = run_launcher([sys.executable, "-c", LAUNCHER, RANK, str(tmp_path)], env, grace=10)
    err = capfd.readouterr().err
    assert code == 130
    lines = err.splitlines()
    assert lines.count("rank log line before the signal") == 2  # before the signal everything passes
    stops = [line for line in lines if line.startswith("appo train: stopped by SIGINT")]
    assert sorted(stops) == [f"appo train: stopped by SIGINT; rank {r} kept nothing." for r in range(2)]
    assert "Traceback" not in err and "SignalException" not in err and len(lines) == 4, err
