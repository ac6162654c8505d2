"""The python tool's fork server ("zygote"): a pre-warmed interpreter that forks one isolated child per call.

Run as a file, `python -I /appo/_zygote.py CONFIG`, *inside* the bubblewrap sandbox that
`appo_trl.tools.isolation` builds for `appo_trl.tools.python_sandbox.PythonSandbox`; so it is stdlib only (plus
`pyseccomp` once, to compile the children's filter) and imports nothing but `_jail.py` beside it. Its processes
(dispatcher, per-slot workers, the third-party preload template) and its line protocol: docs/architecture.md,
"The python sandbox's zygote".
"""

import ctypes
import json
import os
import re
import selectors
import signal
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _jail  # noqa: E402

_ID = re.compile(r"[0-9a-f]{32}")
_CONTROL = {c: None for c in range(32) if c not in (9, 10, 13)}
_CONTROL[0x7F] = None
MAX_WORKERS = 512


def write_all(fd, data):
    while data:
        data = data[os.write(fd, data) :]


def reaped():
    """(pid, status) of every child that has exited, without blocking."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, status


def send(fd, obj):
    write_all(fd, (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8", "replace"))


class Worker:
    """Runs the calls of one slot, one at a time: reads requests on fd 0, replies on `reply_fd`."""

    def __init__(self, zygote, slot, reply_fd):
        self.z, self.slot, self.reply_fd = zygote, slot, reply_fd
        self.sel = selectors.DefaultSelector()
        self.call = None
        self.fds = {}
        self.stdin_buf = bytearray()

    def oom_kills(self):
        total = 0
        for cg in self.z.cgroups:
            if cg.get("oom"):
                try:
                    with open(os.path.join(cg["dir"], str(self.slot), cg["oom"])) as fh:
                        total += sum(int(line.split()[1]) for line in fh if line.startswith("oom_kill "))
                except (OSError, ValueError, IndexError):
                    pass
        return total

    def spawn(self, req):
        z = self.z
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        if z.unisolated:
            import tempfile

            req["workdir"] = tempfile.mkdtemp(prefix="appo-unisolated-")
        if z.unisolated or "pidns" in z.skip:
            pid = os.fork()
        else:
            _jail.unshare(_jail.CLONE_NEWPID)  # the next child is pid 1 of a new pid namespace
            pid = -1
            try:
                pid = os.fork()
            finally:
                if pid != 0:  # back to ours, so that the next unshare is allowed
                    _jail.setns(z.pidns, _jail.CLONE_NEWPID)
        if pid == 0:
            self.child(req, out_w, err_w)
        os.close(out_w)
        os.close(err_w)
        now = time.monotonic()
        self.call = {"req": req, "pid": pid, "start": now, "deadline": now + req["timeout_s"], "status": None,
                     "timed_out": False, "oom0": self.oom_kills(), "stdout": bytearray(), "stderr": bytearray(),
                     "stdout_cut": False, "stderr_cut": False}  # fmt: skip
        for fd, name in ((out_r, "stdout"), (err_r, "stderr")):
            os.set_blocking(fd, False)
            self.fds[fd] = name
            self.sel.register(fd, selectors.EVENT_READ, "out")

    def child(self, req, out_w, err_w):
        """Runs in the forked child (pid 1 of its pid namespace); never returns."""
        z = self.z
        try:
            os.setsid()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.closerange(3, 1 << 16)  # the zygote's pipes and namespace fds never reach the code
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
                signal.signal(sig, signal.SIG_DFL)
            if z.unisolated:
                _jail.set_rlimits(z.limits)
                os.chdir(req["workdir"])
            else:
                _jail.enter(z.limits, self.slot, bool(z.cgroups), z.distinct_ids, z.cap_last, z.bpf, z.skip, z.rebind)
            workdir = req.get("workdir", _jail.WORKDIR)
            os.environ.clear()
            os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8",
                               "TMPDIR": req.get("workdir", "/tmp"), "OPENBLAS_NUM_THREADS": "1",
                               "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - a set-up failure is reported, never run unisolated
            os.write(2, f"appo-sandbox: set-up failed: {exc}\n".encode())
            os._exit(_jail.SETUP_FAILED)
        os._exit(_jail.run_code(req["code"], z.max_output, z.hide))

    def read_fd(self, fd):
        name, call, cap = self.fds[fd], self.call, self.z.max_output
        buf = call[name]
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.sel.unregister(fd)
                os.close(fd)
                del self.fds[fd]
                return
            if name == "stdout":  # keep the head
                room = cap - len(buf)
                buf += chunk[: max(room, 0)]
                call["stdout_cut"] |= len(chunk) > room
            else:  # keep the tail (tracebacks end there)
                buf += chunk
                if len(buf) > 2 * cap:
                    del buf[: len(buf) - cap]
                    call["stderr_cut"] = True

    def finish(self):
        call, cap = self.call, self.z.max_output
        for fd in list(self.fds):
            self.read_fd(fd)
            if fd in self.fds:
                self.sel.unregister(fd)
                os.close(fd)
                del self.fds[fd]
        if self.z.unisolated:
            import shutil

            try:
                os.killpg(call["pid"], signal.SIGKILL)
            except OSError:
                pass
            shutil.rmtree(call["req"]["workdir"], ignore_errors=True)
        status = call["status"]
        exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        if len(call["stderr"]) > cap:
            del call["stderr"][: len(call["stderr"]) - cap]
            call["stderr_cut"] = True
        reply = {"id": call["req"]["id"], "exit_code": exit_code, "timed_out": call["timed_out"],
                 "killed": "memory_limit" if self.oom_kills() > call["oom0"] else None,
                 "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                 "duration_s": time.monotonic() - call["start"], "setup_failed": exit_code == _jail.SETUP_FAILED}  # fmt: skip
        for name in ("stdout", "stderr"):
            reply[name] = call[name].decode("utf-8", "replace").translate(_CONTROL)
            reply[name + "_truncated"] = call[name + "_cut"]
        self.call = None
        send(self.reply_fd, reply)

    def serve(self):
        wake_r, wake_w = os.pipe()
        for fd in (wake_r, wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.sel.register(0, selectors.EVENT_READ, "stdin")
        self.sel.register(wake_r, selectors.EVENT_READ, "wake")
        running = True
        while running or self.call:
            call = self.call
            timeout = None
            if call is not None and not call["timed_out"]:
                timeout = max(0.0, call["deadline"] - time.monotonic())
            for key, _ in self.sel.select(timeout):
                if key.data == "stdin":
                    chunk = os.read(0, 1 << 20)
                    if not chunk:
                        running = False
                        self.sel.unregister(0)
                        if self.call:
                            self.call["deadline"] = 0.0
                        continue
                    self.stdin_buf += chunk
                    end = self.stdin_buf.find(b"\n")
                    if end >= 0 and self.call is None:  # the dispatcher sends one request at a time
                        req = json.loads(bytes(self.stdin_buf[:end]))
                        del self.stdin_buf[: end + 1]
                        self.spawn(req)
                elif key.data == "wake":
                    try:
                        while os.read(wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                else:
                    self.read_fd(key.fd)
            call = self.call
            if call is None:
                continue
            for pid, status in reaped():
                if pid == call["pid"]:
                    call["status"] = status
            if call["status"] is None and not call["timed_out"] and time.monotonic() >= call["deadline"]:
                call["timed_out"] = True
                try:  # isolated: the init of the call's pid namespace, and all of the call dies with it
                    (os.killpg if self.z.unisolated else os.kill)(call["pid"], signal.SIGKILL)
                except OSError:
                    pass
            if call["status"] is not None:
                self.finish()
        os._exit(0)


class Zygote:
    """Dispatcher: validates the trainer's requests and hands each to an idle worker (forking one if needed)."""

    def __init__(self, reply_fd, config):
        self.reply_fd = reply_fd
        self.limits = config["limits"]
        self.max_output = int(self.limits["max_output_bytes"])
        self.max_request = int(config["max_request_bytes"])
        self.distinct_ids = bool(config["distinct_ids"])
        self.cgroups = config.get("cgroups") or []  # [{"dir": "/cg/memory", "files": [[name, value]], "oom": file}]
        self.hide = [tuple(pair) for pair in config.get("hide_paths", [])]
        self.unisolated = bool(config.get("unisolated"))
        self.skip = tuple(config.get("skip", ()))  # benchmarks only: layers left out (see _jail.enter)
        self.rebind = [tuple(pair) for pair in config.get("rebind", [])]  # interpreter dirs under /tmp or /dev/shm
        if not self.unisolated:
            _jail.loopback_down()
            self.pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
            self.cap_last = _jail.cap_last_cap()
            self.bpf = _jail.compile_seccomp()
        self.sel = selectors.DefaultSelector()
        self.workers = {}  # reply fd -> {"pid", "slot", "req_fd", "busy": id | None, "buf"}
        self.queue = []
        self.stdin_buf, self.discarding = bytearray(), False
        self.template = None  # socket to the template process that forks heavy workers (`start_template`)
        self.heavy = None

    def new_worker(self, kind):
        """Fork a worker for the lowest free slot; a "heavy" one is forked by the template (see `start_template`)."""
        used = {w["slot"] for w in self.workers.values()}
        slot = min(set(range(len(used) + 1)) - used)
        for cg in self.cgroups:
            path = os.path.join(cg["dir"], str(slot))
            os.makedirs(path, exist_ok=True)
            for name, value in cg["files"]:
                with open(os.path.join(path, name), "w") as fh:
                    fh.write(str(value))
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        pid = None
        try:
            if kind == "heavy":
                socket.send_fds(self.template, [str(slot).encode()], [req_r, rep_w])
            else:
                pid = os.fork()
                if pid == 0:
                    self.worker_main(slot, req_r, rep_w)
        except OSError:
            for fd in (req_r, req_w, rep_r, rep_w):
                os.close(fd)
            raise
        os.close(req_r)
        os.close(rep_w)
        os.set_blocking(rep_r, False)
        worker = {"pid": pid, "slot": slot, "kind": kind, "req_fd": req_w, "busy": None, "buf": bytearray()}
        self.workers[rep_r] = worker
        self.sel.register(rep_r, selectors.EVENT_READ, "worker")
        return worker

    def worker_main(self, slot, req_r, rep_w):
        """In a freshly forked worker: keep only its pipes, join the slot's cgroups, serve; never returns."""
        try:
            os.dup2(req_r, 0)
            keep = {0, 1, 2, rep_w} | ({self.pidns} if not self.unisolated else set())
            for fd in range(3, 1024):
                if fd not in keep:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            for cg in self.cgroups:  # join the slot's cgroups once: the calls are born in them
                with open(os.path.join(cg["dir"], str(slot), "cgroup.procs"), "w") as fh:
                    fh.write("0")
            Worker(self, slot, rep_w).serve()
        finally:
            os._exit(1)

    def start_template(self, modules):
        """Fork the *template*: a process that imports the third-party preload (numpy, sympy, ...) and forks the
        "heavy" workers, on request over a socketpair that carries the worker's two pipe ends (SCM_RIGHTS).

        Why: fork copies the parent's page tables and every page a child then writes faults a copy. sympy and
        numpy quadruple the zygote's memory, and forking from it cost `print(1+1)` a third of its throughput
        (docs/benchmarks.md). So the zygote keeps the stdlib preload only and forks the "light" workers; code
        that names a heavy module goes to a heavy worker, whose calls find it imported."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:
            try:
                ours.close()
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)  # the trainer's request pipe is the zygote's alone
                os.close(null)
                os.close(self.reply_fd)
                signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
                preload(modules)
                theirs.send(b"ready")
                while True:
                    msg, fds, _, _ = socket.recv_fds(theirs, 64, 2)
                    if not msg or len(fds) != 2:
                        os._exit(0)  # the zygote is gone
                    if os.fork() == 0:
                        theirs.close()
                        self.worker_main(int(msg), *fds)
                    for fd in fds:
                        os.close(fd)
            finally:
                os._exit(1)
        theirs.close()
        if ours.recv(16) == b"ready":  # the tool is ready once everything is imported, as before the split
            self.template = ours
        else:  # the template died importing: calls import what they need themselves
            ours.close()

    def dispatch(self, req):
        """Run `req` on an idle worker of its kind (heavy if the code names a heavy preloaded module), forking
        one if needed; else on any idle worker (the import then happens in the call); else queue it."""
        kind = "heavy" if self.template is not None and self.heavy.search(req["code"]) else "light"
        idle = [w for w in self.workers.values() if w["busy"] is None]
        worker = next((w for w in idle if w["kind"] == kind), None)
        if worker is None and len(self.workers) < MAX_WORKERS:
            try:
                worker = self.new_worker(kind)
            except OSError as exc:
                if kind == "heavy":  # the template died: the call still runs, importing what it needs itself
                    self.template = None
                    return self.dispatch(req)
                send(self.reply_fd, {"id": req["id"], "error": f"no worker: {exc.strerror or exc}"})
                return
        worker = worker or (idle[0] if idle else None)
        if worker is None:
            self.queue.append(req)
            return
        worker["busy"] = req["id"]
        write_all(worker["req_fd"], (json.dumps(req) + "\n").encode())

    def worker_output(self, fd):
        worker = self.workers[fd]
        try:
            chunk = os.read(fd, 1 << 20)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:  # the worker died: its call fails, its slot is free again
            self.sel.unregister(fd)
            os.close(fd)
            os.close(worker["req_fd"])
            del self.workers[fd]
            if worker["busy"] is not None:
                send(self.reply_fd, {"id": worker["busy"], "error": "worker died"})
            return
        worker["buf"] += chunk
        while True:
            end = worker["buf"].find(b"\n")
            if end < 0:
                return
            write_all(self.reply_fd, bytes(worker["buf"][: end + 1]))
            del worker["buf"][: end + 1]
            worker["busy"] = None
            if self.queue:
                self.dispatch(self.queue.pop(0))

    def handle_line(self, line):
        try:
            req = json.loads(line)
        except ValueError:
            return
        if not isinstance(req, dict) or not isinstance(req.get("id"), str) or not _ID.fullmatch(req["id"]):
            return
        code, timeout = req.get("code"), req.get("timeout_s")
        if not isinstance(code, str) or type(timeout) not in (int, float) or not 0 < timeout <= 86400:
            send(self.reply_fd, {"id": req["id"], "error": "bad_request"})
            return
        self.dispatch({"id": req["id"], "code": code, "timeout_s": float(timeout)})

    def handle_stdin(self):
        chunk = os.read(0, 1 << 20)
        if not chunk:
            return False
        self.stdin_buf += chunk
        while True:
            end = self.stdin_buf.find(b"\n")
            if end < 0:
                if len(self.stdin_buf) > self.max_request:  # an over-long line is dropped whole
                    self.stdin_buf.clear()
                    self.discarding = True
                return True
            line = bytes(self.stdin_buf[:end])
            del self.stdin_buf[: end + 1]
            if self.discarding:
                self.discarding = False
            elif len(line) <= self.max_request:
                self.handle_line(line)

    def serve(self):
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.sel.register(0, selectors.EVENT_READ, "stdin")
        send(self.reply_fd, {"ready": True, "distinct_ids": self.distinct_ids, "cgroups": len(self.cgroups)})
        while True:
            for key, _ in self.sel.select(1.0):
                if key.data == "stdin":
                    if not self.handle_stdin():
                        for worker in self.workers.values():
                            if worker["pid"] is not None:
                                os.kill(worker["pid"], signal.SIGKILL)
                        return
                else:
                    self.worker_output(key.fd)
            for _ in reaped():  # dead workers (their reply pipes report the death)
                pass


def preload(modules):
    """Import `modules` (a missing one is not an error), then freeze the heap so that forks share it."""
    import gc

    for name in modules:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a missing optional module is not an error
            pass
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(0)  # run numpy's lazy seeding imports once, here (20 ms per child otherwise)
    gc.collect()
    gc.freeze()  # keep the pre-imported heap shared copy-on-write with the children


def main():
    config = json.loads(sys.argv[1])
    reply_fd = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctypes.CDLL(None, use_errno=True).prctl(_jail.PR_SET_DUMPABLE, 0, 0, 0, 0)
    zygote = Zygote(reply_fd, config)
    names = config.get("preload", [])
    light = [m for m in names if m.split(".")[0] in sys.stdlib_module_names or "template" in zygote.skip]
    heavy = [m for m in names if m not in light]
    preload(light)
    if heavy:  # imported by the template only (`Zygote.start_template`)
        tops = sorted({m.split(".")[0] for m in heavy})
        zygote.heavy = re.compile(r"\b(?:" + "|".join(map(re.escape, tops)) + r")\b")
        zygote.start_template(heavy)
    zygote.serve()


if __name__ == "__main__":
    main()
