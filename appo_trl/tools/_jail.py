"""Child-side set-up of one python-tool call: private namespaces and mounts, limits, unprivileged ids, seccomp.

Imported by the zygote (`_zygote.py`) inside the bubblewrap sandbox; stdlib only (the seccomp program is
compiled once by the zygote with libseccomp and handed over as raw BPF bytes). `enter(...)` runs in the
freshly forked child, which is pid 1 of a new pid namespace, still uid 0 of the sandbox's user namespace with
its capabilities, and in this order:

1. new mount + ipc namespaces; size-capped tmpfs on the work dir, `/tmp` and `/dev/shm`; a `/proc` for this
   pid namespace alone; the cgroup tree hidden under an empty tmpfs (the call's worker process joined the
   call's cgroups once, so the child is born in them: no per-call cgroup migration, which costs ~10 ms);
2. rlimits (CPU, file size, open files, processes+threads, address space, no core files);
3. a uid/gid that no other call in flight has (when the sandbox maps a uid range, i.e. the trainer is root),
   then a *new user namespace* where that id is 65534: the per-call user namespace makes RLIMIT_NPROC count
   this call's tasks only (the kernel counts it per user namespace and uid);
4. every capability dropped (bounding, effective, permitted, inheritable, ambient), `no_new_privs`;
5. the seccomp filter (ptrace, process_vm_*, mount API, namespaces, hostname, bpf, perf, keyrings, ...).

The mounts are torn down by the kernel when the call's last process exits (its namespaces die with it), so a
call leaves no file, shared-memory segment or process behind.
"""

import ast
import ctypes
import io
import linecache
import os
import random
import resource
import sys
import traceback

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC = 32, 4096, 16384
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 4, 24, 38, 22
SECCOMP_MODE_FILTER = 2
SANDBOX_UID = 65534
FILENAME = "<python>"
SETUP_FAILED = 111
WORKDIR = "/sandbox"
CGROUP_MOUNT = "/cg"

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags):
    check(libc.unshare(flags), "unshare")


def setns(fd, nstype):
    check(libc.setns(fd, nstype), "setns")


def mount_tmpfs(target, size_mb, mode="1777"):
    opts = f"size={int(size_mb)}m,mode={mode},nr_inodes=4096".encode()
    check(libc.mount(b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts), f"mount {target}")


def prctl(option, arg=0):
    check(libc.prctl(option, arg, 0, 0, 0), f"prctl({option})")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def drop_capabilities(cap_last):
    for cap in range(cap_last + 1):
        try:
            prctl(PR_CAPBSET_DROP, cap)
        except OSError:
            pass  # a capability this kernel does not know
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    check(libc.capset(ctypes.byref(header), data), "capset")


def load_seccomp(bpf):
    """Install a seccomp filter given as raw `struct sock_filter` bytes (8 bytes per instruction)."""
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = _SockFprog(len(bpf) // 8, ctypes.cast(buf, ctypes.c_void_p))
    check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0), "seccomp")


def _write(path, text):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def loopback_down():
    """Take the sandbox network namespace's loopback down (bubblewrap brings it up): no call can reach another
    call's sockets over 127.0.0.1, and calls lack the capability to bring it back up."""
    import fcntl
    import socket
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0)))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags & ~1))  # SIOCSIFFLAGS without IFF_UP


def set_rlimits(limits):
    mb = 1024 * 1024
    rl = [
        (resource.RLIMIT_CPU, limits["cpu_s"], limits["cpu_s"] + 1),  # SIGXCPU is ignored by a pid-ns init
        (resource.RLIMIT_FSIZE, limits["file_size_mb"] * mb, None),
        (resource.RLIMIT_NOFILE, limits["max_open_files"], None),
        (resource.RLIMIT_NPROC, limits["max_processes"], None),
        (resource.RLIMIT_CORE, 0, None),
        (resource.RLIMIT_AS, limits["memory_mb"] * mb, None),
    ]
    for which, soft, hard in rl:
        resource.setrlimit(which, (soft, soft if hard is None else hard))


def bind_readonly(source, target):
    """Bind `source` at `target` (created, mode 0755) read-only: an interpreter directory that the call's fresh
    `/tmp` or `/dev/shm` tmpfs would hide (`isolation._under_call_tmpfs`)."""
    path = ""
    for part in target.strip("/").split("/"):
        path += "/" + part
        if not os.path.isdir(path):
            os.mkdir(path)
            os.chmod(path, 0o755)  # whatever the umask: the call's own uid must traverse it
    check(libc.mount(source.encode(), target.encode(), None, MS_BIND | MS_REC, None), f"bind {target}")
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
    check(libc.mount(None, target.encode(), None, flags, None), f"remount {target} read-only")


def enter(limits, slot, hide_cgroups, distinct_ids, cap_last, bpf, skip=(), rebind=()):
    """Isolate the calling (freshly forked) process. `limits`: the zygote's validated limit settings; `rebind`:
    (side path, path) pairs of interpreter directories to bind back onto the fresh tmpfs mounts.

    `skip` (benchmarks only, never set by the tool) names layers to leave out: "mounts", "ipc", "userns",
    "seccomp"; it measures what each layer costs (docs/benchmarks.md)."""
    flags = (0 if "mounts" in skip else CLONE_NEWNS) | (0 if "ipc" in skip else CLONE_NEWIPC)
    if flags:
        unshare(flags)
    if "mounts" not in skip:
        tmpfs = limits["tmpfs_mb"]
        mount_tmpfs(WORKDIR, tmpfs, "0777")
        mount_tmpfs("/tmp", tmpfs)
        mount_tmpfs("/dev/shm", tmpfs)
        for side, path in rebind:
            bind_readonly(side, path)
        check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None), "mount /proc")
        if hide_cgroups:  # the call's worker joined its cgroups already: hide the cgroup tree
            mount_tmpfs(CGROUP_MOUNT, 1, "0555")
    _write("/proc/self/oom_score_adj", "1000")  # under memory pressure the call dies, never its worker
    set_rlimits(limits)
    if "userns" not in skip:
        uid = gid = 0
        if distinct_ids:  # the sandbox maps uids 1000.. to unused host uids: one per call in flight
            uid = gid = 1000 + slot
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        prctl(PR_SET_DUMPABLE, 1)  # our own /proc/self/uid_map must stay writable by us
        unshare(CLONE_NEWUSER)
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{SANDBOX_UID} {uid} 1\n")
        _write("/proc/self/gid_map", f"{SANDBOX_UID} {gid} 1\n")
        drop_capabilities(cap_last)
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    if "seccomp" not in skip:
        load_seccomp(bpf)
    prctl(PR_SET_PDEATHSIG, 9)  # the call dies with its worker (credential changes above reset this)
    os.chdir(WORKDIR if "mounts" not in skip else "/")


# ---- seccomp policy (compiled by the zygote with libseccomp) ---------------------------------------------
DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "process_madvise", "kcmp",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "setns", "unshare", "sethostname", "setdomainname", "bpf", "perf_event_open",
    "keyctl", "add_key", "request_key", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "open_by_handle_at", "name_to_handle_at", "init_module", "finit_module", "delete_module", "kexec_load",
    "kexec_file_load", "swapon", "swapoff", "reboot", "acct", "quotactl", "lookup_dcookie", "syslog",
)  # fmt: skip
NAMESPACE_CLONE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)


def compile_seccomp():
    """Raw BPF of the call filter: allow by default, EPERM for `DENIED_SYSCALLS` and for `clone` with any
    namespace flag, ENOSYS for `clone3` (its flags are out of a filter's reach; libc falls back to `clone`).
    Foreign architectures (32-bit/x32 entry points) are killed by libseccomp's default bad-arch action."""
    import errno

    import pyseccomp as sc

    filt = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED_SYSCALLS:
        try:
            filt.add_rule(sc.ERRNO(errno.EPERM), name)
        except (ValueError, RuntimeError, OSError):
            pass  # unknown on this architecture
    for flag in NAMESPACE_CLONE_FLAGS:
        filt.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    filt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    with open(os.memfd_create("appo-seccomp"), "w+b") as fh:
        filt.export_bpf(fh)
        fh.seek(0)
        return fh.read()


def cap_last_cap():
    try:
        with open("/proc/sys/kernel/cap_last_cap") as fh:
            return int(fh.read())
    except OSError:
        return 40


# ---- running the code ---------------------------------------------------------------------------------------
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


def run_code(source, max_output, hide):
    """Execute `source` as `__main__` (stdout capped at `max_output + 1` bytes before anything is encoded: one
    byte over marks truncation); returns the exit code. Tracebacks start at the code's own frames and have host
    paths replaced (`hide`: (path, replacement) pairs)."""
    code = 1
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(_Capped(1, max_output + 1)), encoding="utf-8",
                                  errors="backslashreplace")  # fmt: skip
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  write_through=True)  # fmt: skip
    sys.argv = [FILENAME]
    random.seed(os.urandom(16))  # children must not share the zygote's random state
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(int.from_bytes(os.urandom(4), "little"))
    linecache.cache[FILENAME] = (len(source), None, source.splitlines(True), FILENAME)
    try:
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
            for path, repl in hide:  # host paths never reach the model
                text = text.replace(path, repl)
            sys.stderr.write(text)
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            pass
    return code if isinstance(code, int) and 0 <= code < 256 and code != SETUP_FAILED else 1
