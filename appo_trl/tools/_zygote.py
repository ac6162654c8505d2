"""The python tool's fork server ("zygote"): a pre-warmed interpreter that forks one isolated child per call.

Started by `appo_trl.tools.python_sandbox.PythonSandbox` as `python -I /appo/_zygote.py CONFIG` *inside* the
bubblewrap sandbox built by `appo_trl.tools.isolation` (own user, pid, network, ipc, uts and mount namespaces,
read-only allow-listed filesystem, no home). Stdlib only, plus `pyseccomp` once at start to compile the
children's seccomp filter.

The zygote itself is not dumpable (`PR_SET_DUMPABLE=0`: no `/proc/<zygote>/mem|fd|environ` for anyone but
root of its user namespace) and ignores SIGINT. Each call's child is pid 1 of a *new* pid namespace (the zygote
is invisible to it and its `/proc` lists only the call's own processes), joins the call's cgroups, gets private
tmpfs mounts and ipc namespace, drops to its own user namespace without capabilities and loads the seccomp
filter (`_jail.enter`). When the child exits or its deadline passes, killing it kills every process of the call
(the kernel tears down a pid namespace with its init) and its mounts and shared memory vanish with it.

Protocol (one JSON object per line, both ways, validated and size-capped): request
`{"id": 32 hex chars, "code": str, "timeout_s": number}`; reply `{"id", "exit_code", "signal", "timed_out",
"killed", "duration_s", "stdout", "stderr", "stdout_truncated", "stderr_truncated"}` or `{"id", "error"}`.
Exits when stdin closes.
"""

import ast
import ctypes
import io
import json
import linecache
import os
import random
import re
import selectors
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _jail  # noqa: E402

FILENAME = "<python>"
SETUP_FAILED = 111
_ID = re.compile(r"[0-9a-f]{32}")
_CONTROL = {c: None for c in range(32) if c not in (9, 10, 13)}
_CONTROL[0x7F] = None


def _rewrite(code):
    """ARPO's rule: a bare final expression that is not a `print(...)` call is wrapped in `print(...)`."""
    tree = ast.parse(code, FILENAME)
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        value = tree.body[-1].value
        is_print = isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "print"
        if not is_print:
            call = ast.Call(func=ast.Name(id="print", ctx=ast.Load()), args=[value], keywords=[])
            tree.body[-1] = ast.copy_location(ast.Expr(value=call), tree.body[-1])
            ast.fix_missing_locations(tree)
    return compile(tree, FILENAME, "exec")


class _Capped(io.RawIOBase):
    """A raw writer that passes at most `budget` bytes to `fd` and silently drops the rest."""

    def __init__(self, fd, budget):
        self.fd, self.budget = fd, budget

    def writable(self):
        return True

    def write(self, data):
        n = len(data)
        if self.budget > 0:
            chunk = bytes(data[: self.budget])
            self.budget -= len(chunk)
            while chunk:
                chunk = chunk[os.write(self.fd, chunk) :]
        return n


class Zygote:
    def __init__(self, reply_fd, config):
        self.reply_fd = reply_fd
        self.limits = config["limits"]
        self.max_output = int(self.limits["max_output_bytes"])
        self.max_request = int(config["max_request_bytes"])
        self.distinct_ids = bool(config["distinct_ids"])
        self.cgroups = config.get("cgroups") or []  # [{"dir": "/cg/memory", "files": {name: value}, "oom": file}]
        self.hide = [(p, r) for p, r in config.get("hide_paths", [])]
        self.sel = selectors.DefaultSelector()
        self.calls = {}  # pid -> call dict
        self.fds = {}  # read fd -> (call, stream name)
        self.free_slots, self.slots = [], 0
        self.stdin_buf, self.discarding = bytearray(), False
        self.unisolated = bool(config.get("unisolated"))
        if not self.unisolated:
            self.pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
            self.cap_last = _jail.cap_last_cap()
            self.bpf = _jail.compile_seccomp()

    def send(self, obj):
        data = (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8", "replace")
        while data:
            data = data[os.write(self.reply_fd, data) :]

    # ---- cgroup slots ---------------------------------------------------------------------------------
    def take_slot(self):
        if self.free_slots:
            return self.free_slots.pop()
        slot, self.slots = self.slots, self.slots + 1
        for cg in self.cgroups:
            path = os.path.join(cg["dir"], str(slot))
            os.makedirs(path, exist_ok=True)
            for name, value in cg["files"]:
                with open(os.path.join(path, name), "w") as fh:
                    fh.write(str(value))
        return slot

    def oom_kills(self, slot):
        total = 0
        for cg in self.cgroups:
            if cg.get("oom"):
                try:
                    with open(os.path.join(cg["dir"], str(slot), cg["oom"])) as fh:
                        total += sum(int(line.split()[1]) for line in fh if line.startswith("oom_kill "))
                except (OSError, ValueError, IndexError):
                    pass
        return total

    # ---- calls ----------------------------------------------------------------------------------------
    def spawn(self, req):
        slot = self.take_slot()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        if self.unisolated:
            import tempfile

            req["workdir"] = tempfile.mkdtemp(prefix="appo-unisolated-")
            pid = os.fork()
            if pid == 0:
                self.child(req, slot, out_w, err_w)
        else:
            _jail.unshare(_jail.CLONE_NEWPID)  # the next child is pid 1 of a new pid namespace
            try:
                pid = os.fork()
            except BaseException:
                _jail.setns(self.pidns, _jail.CLONE_NEWPID)
                raise
            if pid == 0:
                self.child(req, slot, out_w, err_w)
            _jail.setns(self.pidns, _jail.CLONE_NEWPID)  # back to ours, so that the next unshare is allowed
        os.close(out_w)
        os.close(err_w)
        call = {"req": req, "pid": pid, "slot": slot, "start": time.monotonic(), "status": None,
                "deadline": time.monotonic() + float(req["timeout_s"]), "timed_out": False,
                "oom0": self.oom_kills(slot), "open": 2,
                "stdout": bytearray(), "stderr": bytearray(), "stdout_cut": False, "stderr_cut": False}  # fmt: skip
        self.calls[pid] = call
        for fd, name in ((out_r, "stdout"), (err_r, "stderr")):
            os.set_blocking(fd, False)
            self.fds[fd] = (call, name)
            self.sel.register(fd, selectors.EVENT_READ, "out")

    def child(self, req, slot, out_w, err_w):
        """Runs in the forked child (pid 1 of its pid namespace); never returns."""
        code = SETUP_FAILED
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
            if self.unisolated:
                _jail.set_rlimits(self.limits)
                os.chdir(req["workdir"])
            else:
                dirs = [os.path.join(cg["dir"], str(slot)) for cg in self.cgroups]
                _jail.enter(self.limits, slot, dirs, self.distinct_ids, self.cap_last, self.bpf)
            os.environ.clear()
            os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": req.get("workdir", _jail.WORKDIR), "LANG": "C.UTF-8",
                               "TMPDIR": req.get("workdir", "/tmp"), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
                               "MKL_NUM_THREADS": "1"})  # fmt: skip
            import tempfile

            tempfile.tempdir = None
        except BaseException as exc:  # noqa: BLE001 - a set-up failure is reported, never run unisolated
            os.write(2, f"appo-sandbox: set-up failed: {exc}\n".encode())
            os._exit(SETUP_FAILED)
        try:
            out = _Capped(1, self.max_output + 1)  # one byte over the cap marks the output as truncated
            sys.stdout = io.TextIOWrapper(io.BufferedWriter(out), encoding="utf-8", errors="backslashreplace")
            sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                          errors="backslashreplace", write_through=True)  # fmt: skip
            sys.argv = [FILENAME]
            random.seed(os.urandom(16))  # children must not share the zygote's random state
            if "numpy" in sys.modules:
                sys.modules["numpy"].random.seed(int.from_bytes(os.urandom(4), "little"))
            source = req["code"]
            linecache.cache[FILENAME] = (len(source), None, source.splitlines(True), FILENAME)
            try:
                exec(_rewrite(source), {"__name__": "__main__", "__builtins__": __builtins__})
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if not isinstance(exc.code, (int, type(None))):
                    print(exc.code, file=sys.stderr)
            except BaseException as exc:  # noqa: BLE001 - the user's error is the result
                tb = exc.__traceback__
                while tb is not None and tb.tb_frame.f_code.co_filename != FILENAME:
                    tb = tb.tb_next
                text = "".join(traceback.format_exception(type(exc), exc, tb))
                for path, repl in self.hide:  # host paths never reach the model
                    text = text.replace(path, repl)
                sys.stderr.write(text)
                code = 1
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            except BaseException:  # noqa: BLE001
                pass
            os._exit(code if isinstance(code, int) and 0 <= code < 256 and code != SETUP_FAILED else 1)

    def read_fd(self, fd):
        call, name = self.fds[fd]
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
                call["open"] -= 1
                return
            if name == "stdout":  # keep the head
                room = self.max_output - len(buf)
                buf += chunk[: max(room, 0)]
                call["stdout_cut"] |= len(chunk) > room
            else:  # keep the tail (tracebacks end there)
                buf += chunk
                if len(buf) > 2 * self.max_output:
                    del buf[: len(buf) - self.max_output]
                    call["stderr_cut"] = True

    def finish(self, call):
        for fd in [fd for fd, (c, _) in self.fds.items() if c is call]:
            self.read_fd(fd)
        del self.calls[call["pid"]]
        if self.unisolated:
            import shutil

            for _ in range(3):
                try:
                    os.killpg(call["pid"], signal.SIGKILL)
                except OSError:
                    break
                self.reap()
            shutil.rmtree(call["req"]["workdir"], ignore_errors=True)
        status = call["status"]
        exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        killed = "memory_limit" if self.oom_kills(call["slot"]) > call["oom0"] else None
        self.free_slots.append(call["slot"])  # every process of the call died with its pid namespace
        stderr = call["stderr"]
        if len(stderr) > self.max_output:
            del stderr[: len(stderr) - self.max_output]
            call["stderr_cut"] = True
        reply = {"id": call["req"]["id"], "exit_code": exit_code, "timed_out": call["timed_out"], "killed": killed,
                 "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                 "duration_s": time.monotonic() - call["start"], "setup_failed": exit_code == SETUP_FAILED}  # fmt: skip
        for name in ("stdout", "stderr"):
            reply[name] = call[name].decode("utf-8", "replace").translate(_CONTROL)
            reply[name + "_truncated"] = call[name + "_cut"]
        self.send(reply)

    # ---- requests -------------------------------------------------------------------------------------
    def handle_line(self, line):
        try:
            req = json.loads(line)
        except ValueError:
            return
        if not isinstance(req, dict) or not isinstance(req.get("id"), str) or not _ID.fullmatch(req["id"]):
            return
        code, timeout = req.get("code"), req.get("timeout_s")
        if not isinstance(code, str) or type(timeout) not in (int, float) or not 0 < timeout <= 86400:
            self.send({"id": req["id"], "error": "bad_request"})
            return
        try:
            self.spawn({"id": req["id"], "code": code, "timeout_s": float(timeout)})
        except OSError as exc:
            self.send({"id": req["id"], "error": f"spawn failed: {exc.strerror or exc}"})

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

    def reap(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.calls:
                self.calls[pid]["status"] = status

    def serve(self):
        wake_r, wake_w = os.pipe()
        for fd in (wake_r, wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.sel.register(0, selectors.EVENT_READ, "stdin")
        self.sel.register(wake_r, selectors.EVENT_READ, "wake")
        self.send({"ready": True, "distinct_ids": self.distinct_ids, "cgroups": len(self.cgroups)})
        running = True
        while running or self.calls:
            pending = [c["deadline"] for c in self.calls.values() if not c["timed_out"]]
            timeout = max(0.0, min(pending) - time.monotonic()) if pending else None
            for key, _ in self.sel.select(timeout):
                if key.data == "stdin":
                    if not self.handle_stdin():
                        running = False
                        self.sel.unregister(0)
                        for c in self.calls.values():  # the trainer is gone: stop everything
                            c["deadline"] = 0.0
                elif key.data == "wake":
                    try:
                        while os.read(wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                else:
                    self.read_fd(key.fd)
            self.reap()
            now = time.monotonic()
            for call in list(self.calls.values()):
                if call["status"] is None and not call["timed_out"] and now >= call["deadline"]:
                    call["timed_out"] = True
                    try:  # isolated: the init of the call's pid namespace, all of it dies with it
                        (os.killpg if self.unisolated else os.kill)(call["pid"], signal.SIGKILL)
                    except OSError:
                        pass
                if call["status"] is not None:
                    self.finish(call)


def main():
    config = json.loads(sys.argv[1])
    reply_fd = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctypes.CDLL(None, use_errno=True).prctl(_jail.PR_SET_DUMPABLE, 0, 0, 0, 0)
    zygote = Zygote(reply_fd, config)
    for name in config.get("preload", []):
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a missing optional module is not an error
            pass
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(0)  # run numpy's lazy seeding imports once, here (20 ms per child otherwise)
    import gc

    gc.collect()
    gc.freeze()  # keep the pre-imported heap shared copy-on-write with the children
    zygote.serve()


if __name__ == "__main__":
    main()
