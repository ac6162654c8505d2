"""The sandbox's fork server ("zygote"): a pre-warmed interpreter that forks one fresh child per call.

Run by `appo_trl.tools.python_sandbox.PythonSandbox` as a standalone script (stdlib only, `python -I`), with a
scrubbed environment and, where the machine allows it, inside new network + pid namespaces (`unshare`), so that
it is pid 1 of its namespace: orphans are re-parented to it, and a child cannot kill it (the kernel drops
SIGKILL sent to a namespace's init from inside). Protocol: one JSON request per line on stdin
(`{"id", "code", "timeout_s", "cpu_s", "memory_mb", "file_size_mb", "max_processes", "max_open_files",
"max_output_bytes"}`), one JSON reply per line on the original stdout. Exits when stdin closes.

Per call, the child: starts a new session (its own process group), gets a fresh temporary directory as cwd and
HOME, a minimal environment, rlimits (CPU, address space, file size, processes, open files, no core files),
drops to uid/gid `nobody` when the zygote runs as root, then executes the code with ARPO's rewrite (a bare final
expression is printed). When the child exits or its wall-clock deadline passes, the zygote SIGKILLs the child's
process group and every orphan that was re-parented to it, reaps everything and removes the directory.
"""

import ast
import io
import json
import linecache
import os
import random
import resource
import selectors
import shutil
import signal
import sys
import tempfile
import time
import traceback

NOBODY = 65534
FILENAME = "<python>"


def _prctl_subreaper():
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:
        pass


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


def _child(req, out_w, err_w, drop_to_nobody):
    """Runs in the forked child; never returns."""
    code = 1
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        for fd in os.listdir("/proc/self/fd"):  # cheaper than closerange(3, 65536) (one syscall per number)
            if int(fd) > 2:
                try:
                    os.close(int(fd))
                except OSError:
                    pass
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        workdir = req["workdir"]
        if drop_to_nobody:
            os.chown(workdir, NOBODY, NOBODY)
        os.chdir(workdir)
        mb = 1024 * 1024
        limits = [
            (resource.RLIMIT_CPU, req["cpu_s"]),
            (resource.RLIMIT_AS, req["memory_mb"] * mb),
            (resource.RLIMIT_FSIZE, req["file_size_mb"] * mb),
            (resource.RLIMIT_NPROC, req["max_processes"]),
            (resource.RLIMIT_NOFILE, req["max_open_files"]),
            (resource.RLIMIT_CORE, 0),
        ]
        for which, value in limits:
            if value is not None and value >= 0:
                resource.setrlimit(which, (value, value))
        if drop_to_nobody:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        os.environ.clear()
        os.environ.update(
            {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": workdir,
                "TMPDIR": workdir,
                "LANG": "C.UTF-8",
                "OPENBLAS_NUM_THREADS": "1",
                "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1",
            }
        )
        tempfile.tempdir = workdir
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace")
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
        )
        sys.argv = [FILENAME]
        random.seed(os.urandom(16))  # children must not share the zygote's random state
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed(int.from_bytes(os.urandom(4), "little"))
        source = req["code"]
        linecache.cache[FILENAME] = (len(source), None, source.splitlines(True), FILENAME)
        try:
            compiled = _rewrite(source)
            exec(compiled, {"__name__": "__main__", "__builtins__": __builtins__})
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        except BaseException as exc:  # noqa: BLE001 - the user's error is the result
            tb = exc.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename != FILENAME:
                tb = tb.tb_next
            sys.stderr.write("".join(traceback.format_exception(type(exc), exc, tb)))
            code = 1
    except BaseException as exc:  # noqa: BLE001 - a set-up failure is reported, never propagated
        os.write(2, f"sandbox set-up failed: {exc!r}\n".encode())
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            pass
        os._exit(code if isinstance(code, int) and 0 <= code < 256 else 1)


def _world_readable(prefix):
    """True when uid `nobody` could import from this interpreter (every path component o+x, and o+r)."""
    import stat

    paths = {os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)} | {os.path.realpath(prefix)}
    for path in paths:
        parts = path.split(os.sep)
        for i in range(2, len(parts) + 1):
            mode = os.stat(os.sep.join(parts[:i]) or os.sep).st_mode
            if not mode & stat.S_IXOTH or (i == len(parts) and not mode & stat.S_IROTH):
                return False
    return True


class Call:
    def __init__(self, req, pid, out_r, err_r, workdir):
        self.req, self.pid, self.workdir = req, pid, workdir
        self.buffers = {out_r: bytearray(), err_r: bytearray()}
        self.names = {out_r: "stdout", err_r: "stderr"}
        self.truncated = {"stdout": False, "stderr": False}
        self.start = time.monotonic()
        self.deadline = self.start + float(req["timeout_s"])
        self.status = None
        self.timed_out = False
        self.killed = None


class Zygote:
    def __init__(self, reply_fd, config):
        self.reply_fd = reply_fd
        self.sel = selectors.DefaultSelector()
        self.calls = {}  # pid -> Call
        self.fds = {}  # read fd -> Call
        self.base_dir = tempfile.mkdtemp(prefix="appo-sandbox-")
        self.drop_to_nobody = (
            bool(config.get("drop_privileges", True)) and os.geteuid() == 0 and _world_readable(sys.prefix)
        )
        self.max_processes = int(config.get("max_processes", 256))
        self.last_watch = 0.0
        if self.drop_to_nobody:
            os.chmod(self.base_dir, 0o711)
        self.stdin_buf = b""

    def send(self, obj):
        data = (json.dumps(obj) + "\n").encode()
        while data:
            data = data[os.write(self.reply_fd, data) :]

    # ---- process bookkeeping ------------------------------------------------------------------
    def reap(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            call = self.calls.get(pid)
            if call is not None and call.status is None:
                call.status = status

    def children(self):
        pids = set()
        try:
            for tid in os.listdir("/proc/self/task"):
                with open(f"/proc/self/task/{tid}/children") as fh:
                    pids.update(int(p) for p in fh.read().split())
        except OSError:
            pass
        return pids

    def sweep(self, group):
        """SIGKILL a finished call's process group and any orphan not belonging to a running call."""
        for _ in range(200):
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.reap()
            active = {pid for pid, c in self.calls.items() if c.status is None}
            strays = [pid for pid in self.children() if pid not in active and not self._is_zombie(pid)]
            if not strays and not self._group_alive(group):
                self.reap()
                return
            for pid in strays:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)

    @staticmethod
    def _is_zombie(pid):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            return True

    @staticmethod
    def _group_alive(group):
        try:
            os.killpg(group, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def watch(self):
        """Process-count watchdog (pid-namespace mode only, where /proc lists only sandbox processes): a
        backstop for RLIMIT_NPROC, which the kernel does not enforce for root. Kills the call owning most
        processes when the namespace holds more than `max_processes` per running call."""
        if os.getpid() != 1 or not self.calls:
            return
        owners = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and entry != "1":
                try:
                    with open(f"/proc/{entry}/stat") as fh:
                        fields = fh.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                session = int(fields[3])
                owners[session] = owners.get(session, 0) + 1
        running = [c for c in self.calls.values() if c.status is None and not c.killed]
        if sum(owners.values()) > self.max_processes * max(1, len(running)) and running:
            worst = max(running, key=lambda c: owners.get(c.pid, 0))
            worst.killed = "process_limit"
            self.sweep(worst.pid)

    # ---- requests ---------------------------------------------------------------------------------
    def spawn(self, req):
        workdir = tempfile.mkdtemp(dir=self.base_dir)
        req["workdir"] = workdir
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _child(req, out_w, err_w, self.drop_to_nobody)
        os.close(out_w)
        os.close(err_w)
        call = Call(req, pid, out_r, err_r, workdir)
        self.calls[pid] = call
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
            self.fds[fd] = call
            self.sel.register(fd, selectors.EVENT_READ, "out")

    def read_fd(self, fd, call):
        limit = int(call.req["max_output_bytes"])
        buf, name = call.buffers[fd], call.names[fd]
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return False
            except OSError:
                chunk = b""
            if not chunk:
                self.sel.unregister(fd)
                os.close(fd)
                del self.fds[fd]
                return True
            room = limit - len(buf)
            if room > 0:
                buf += chunk[:room]
            if len(chunk) > max(room, 0):
                call.truncated[name] = True

    def finish(self, call):
        self.sweep(call.pid)
        for fd in [fd for fd, c in self.fds.items() if c is call]:
            self.read_fd(fd, call)
            if fd in self.fds:
                self.sel.unregister(fd)
                os.close(fd)
                del self.fds[fd]
        del self.calls[call.pid]
        shutil.rmtree(call.workdir, ignore_errors=True)
        status = call.status
        reply = {
            "id": call.req["id"],
            "exit_code": os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None,
            "timed_out": call.timed_out,
            "killed": call.killed,
            "duration_s": time.monotonic() - call.start,
        }
        for fd_buf, name in ((b, call.names[fd]) for fd, b in call.buffers.items()):
            reply[name] = fd_buf.decode("utf-8", errors="replace")
            reply[name + "_truncated"] = call.truncated[name]
        self.send(reply)

    def handle_stdin(self):
        chunk = os.read(0, 1 << 20)
        if not chunk:
            return False
        self.stdin_buf += chunk
        *lines, self.stdin_buf = self.stdin_buf.split(b"\n")
        for line in lines:
            if line.strip():
                self.spawn(json.loads(line))
        return True

    def serve(self):
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.sel.register(0, selectors.EVENT_READ, "stdin")
        self.sel.register(wake_r, selectors.EVENT_READ, "wake")
        self.send({"ready": True, "pid": os.getpid(), "drop_privileges": self.drop_to_nobody})
        running = True
        while running or self.calls:
            now = time.monotonic()
            pending = [c.deadline for c in self.calls.values() if not c.timed_out]
            timeout = max(0.0, min(pending) - now) if pending else None
            if self.calls and os.getpid() == 1:
                timeout = 0.02 if timeout is None else min(timeout, 0.02)
            for key, _ in self.sel.select(timeout):
                if key.data == "stdin":
                    if not self.handle_stdin():
                        running = False
                        self.sel.unregister(0)
                        for c in self.calls.values():  # parent is gone: stop everything
                            c.deadline = 0.0
                elif key.data == "wake":
                    try:
                        while os.read(wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                else:
                    self.read_fd(key.fd, self.fds[key.fd])
            self.reap()
            now = time.monotonic()
            if now - self.last_watch >= 0.02:
                self.last_watch = now
                self.watch()
            for call in list(self.calls.values()):
                if call.status is None and not call.timed_out and now >= call.deadline:
                    call.timed_out = True
                    try:
                        os.killpg(call.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        os.kill(call.pid, signal.SIGKILL)
                if call.status is not None:
                    self.finish(call)
        shutil.rmtree(self.base_dir, ignore_errors=True)


def main():
    config = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    reply_fd = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    _prctl_subreaper()
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
    Zygote(reply_fd, config).serve()


if __name__ == "__main__":
    main()
