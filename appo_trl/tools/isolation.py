"""How the python tool isolates model-written code: a bubblewrap box for the zygote, a fresh jail per call.

Layers (outer to inner), each a well-kept kernel primitive driven by a well-kept tool, no ptrace-style guards:

1. **bubblewrap** (`bwrap`, Debian package `bubblewrap`) starts the zygote in new user, pid, network, ipc, uts
   and cgroup namespaces, with `no_new_privs`, on a read-only root that holds only an allow-list: `/usr`,
   `/etc`, the `/bin`-style links, the interpreter's own prefixes and site-packages (bound read-only), a fresh
   `/dev`, and the two zygote files. No home directory, no project directory (no `./.env`), no `/work`, no host
   `/tmp` (no unix sockets of the host), no host `/proc` (no other process's `environ` or `mem`), no network
   interface but a loopback, which the zygote takes down (bwrap brings it up). Why bubblewrap: it is the sandbox Flatpak builds on, small, audited, and it
   works both as root and unprivileged; a hand-written mount/namespace set-up would be ours to audit.
   - As **root**, the user namespace is prepared by us (`unshare --user` holding it, maps written by root):
     uid 0 inside is the trainer's uid (so the zygote can read a venv under a 0700 home through its binds) and
     uids 1000.. inside map to unused host uids `2^30 + k*2^16 + ...`, one per call in flight. A call's code thus
     runs as a host uid that owns no file. As a **normal user**, bwrap maps the user's uid alone; calls then run
     as that uid (in their own user namespace, without any capability) and see only the allow-listed files.
   - The zygote forks one *worker* per concurrency slot (on demand); the worker joins the slot's cgroups once and
     forks that slot's calls, so no call pays a cgroup migration (10-15 ms, docs/benchmarks.md). Workers for
     code that names numpy or sympy are forked by a *template* process that imported them; the zygote holds the
     standard library only, because fork cost grows with the forking process's memory (docs/benchmarks.md).
   - An interpreter under `/tmp` (a venv in a `mktemp -d` clone) is bound after bwrap's `/tmp` tmpfs, and a
     second time at a side path from which each call binds it back, read-only, onto its own fresh `/tmp`.
2. **Per call** (`_jail.enter`, in the forked child): pid 1 of a new pid namespace with its own `/proc`; new
   mount + ipc namespaces with size-capped private tmpfs on the work dir `/sandbox`, `/tmp` and `/dev/shm`;
   cgroups (below); rlimits; a per-call uid (root) and a per-call user namespace; every capability dropped;
   `no_new_privs`; a **seccomp** filter compiled once with **libseccomp** through `pyseccomp` (a ctypes
   binding to the system `libseccomp2`, so it installs from PyPI in any venv, unlike Debian's
   `python3-seccomp`, which exists for the system interpreter only). The filter denies ptrace,
   process_vm_readv/writev, the mount API (mount, umount2, pivot_root, fsopen, ...), setns/unshare and `clone`
   with namespace flags, sethostname/setdomainname, bpf, perf_event_open, keyrings, userfaultfd, io_uring.
   bwrap's `--seccomp FD` is not used because the zygote itself must still create namespaces and mounts.
3. **Limits per call.** Where this process may create cgroups (root, cgroup v2 with memory/pids/cpu enabled,
   or the v1 hierarchies), each call in flight gets its own cgroup: memory (`memory.max` /
   `memory.limit_in_bytes`, swap included) for all its processes together, `pids.max`, and, when `cpus` is set,
   a CPU quota (`cpu.max`). The CPU quota is off by default: the cpu controller makes the whole sandbox one
   scheduling entity, which halved its throughput on a contended machine (docs/benchmarks.md); CPU time is
   bounded by RLIMIT_CPU per process and the wall-clock deadline instead. Without cgroups (e.g. a normal user
   without delegated cgroups) the limits are rlimits: RLIMIT_NPROC counts the call's processes *and threads*
   per call (the kernel counts it per user namespace, and every call has its own), RLIMIT_AS caps each
   process's address space, RLIMIT_CPU each process's CPU time. Every call has RLIMIT_AS/CPU/FSIZE/NOFILE/
   NPROC/CORE and a wall-clock deadline either way.

What this does NOT protect against (see also `python_sandbox.py`):
- Kernel exploits: the code shares the host kernel (namespaces and seccomp reduce, not remove, its surface).
- Side channels and CPU contention: without `cpus`, a call can keep up to `max_processes` cores busy until
  its CPU rlimit or deadline; timing and cache side channels between calls are not addressed.
- An escape from a call's jail (a kernel bug) into its worker or the zygote: those run, as root, as host uid 0
  with capabilities inside the sandbox's namespaces only, so they can read root-owned allow-listed files
  (e.g. `/etc/shadow`) but still see no home, project or host process.
- Reading allow-listed files: anything under `/usr`, `/etc` and the python prefixes that is world-readable (or,
  as a normal user, readable by that user) is readable by the code. Put no secret there.
- Without cgroups, memory is limited per process (RLIMIT_AS, virtual memory), so a call may use up to
  `max_processes * memory_mb`; as a normal user the calls share that user's uid on the host.
- Concurrent calls share the zygote's network namespace (loopback down, no other interface): two calls *in
  flight at the same time* can meet through abstract unix sockets, if both code snippets try. Nothing persists.
- If the trainer is SIGKILLed, its empty per-sandbox cgroup directories (`appo-sandbox-<pid>-<hex>`) remain
  until the next sandbox starts on this machine and removes those whose owner is dead (`remove_stale_cgroups`);
  every process of the sandbox exits (its stdin closes).
- `isolation: none` runs the code as the trainer's user with none of the above.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import secrets
import shutil
import site
import subprocess
import sys
import sysconfig
import time

logger = logging.getLogger(__name__)

TOOLS_DIR = os.path.dirname(os.path.abspath(__file__))
ZYGOTE_FILES = ("_zygote.py", "_jail.py")
INNER_DIR = "/appo"
HINT = (
    "install bubblewrap (`apt-get install -y bubblewrap`; `make install` does it as root) and pyseccomp, "
    "or set `python.isolation: none` to run model code UNISOLATED"
)
ID_BASE, ID_COUNT = 1000, 60000
CALL_TMPFS = ("/tmp", "/dev/shm")  # each call gets a fresh tmpfs on these (`_jail.enter`)
CGROUP_ROOT = "/sys/fs/cgroup"
_SANDBOX_CGROUP = re.compile(r"^appo-sandbox-(\d+)-[0-9a-f]+$")


class IsolationError(RuntimeError, ValueError):
    """The configured isolation cannot be had on this machine (the message says why and what to change).

    Also a ValueError: a setting this machine cannot honour, reported like other bad settings (pre-model checks)."""


@dataclasses.dataclass
class Launch:
    """A ready-to-run zygote command and what must be cleaned up after it."""

    argv: list[str]
    pass_fds: tuple[int, ...]
    cgroup_dirs: list[str]
    distinct_ids: bool
    hide_paths: list[tuple[str, str]]

    def release_fds(self) -> None:
        for fd in self.pass_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.pass_fds = ()

    def cleanup(self) -> None:
        """Remove the per-call cgroups (their processes are dead once the zygote's pid namespace is gone)."""
        self.release_fds()
        for base in self.cgroup_dirs:
            for _ in range(50):
                try:
                    for name in os.listdir(base):
                        if name.isdigit():
                            os.rmdir(os.path.join(base, name))
                    os.rmdir(base)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
        self.cgroup_dirs = []


def python_paths() -> list[str]:
    """Directories the interpreter needs: prefixes, stdlib and site-packages (never the project or cwd)."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    names = ("stdlib", "platstdlib", "purelib", "platlib")
    paths.update(sysconfig.get_paths()[n] for n in names)
    paths.update(site.getsitepackages())
    out = set()
    for p in paths:
        for q in (os.path.abspath(p), os.path.realpath(p)):
            if os.path.isdir(q):
                out.add(q)
    return sorted(out)


def hidden_path_map() -> list[tuple[str, str]]:
    """Host path prefixes to replace in tracebacks and tool output, longest first."""
    pairs = []
    for name in ("purelib", "platlib"):
        pairs.append((sysconfig.get_paths()[name], "<site-packages>"))
    for p in site.getsitepackages():
        pairs.append((p, "<site-packages>"))
    for name in ("stdlib", "platstdlib"):
        pairs.append((sysconfig.get_paths()[name], "<stdlib>"))
    for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, os.getcwd(), os.path.expanduser("~"), TOOLS_DIR):
        pairs.append((p, "<host>"))
    seen, out = set(), []
    for p, r in pairs:
        for q in {os.path.abspath(p), os.path.realpath(p)}:
            if len(q) > 1 and q not in seen:
                seen.add(q)
                out.append((q, r))
    return sorted(out, key=lambda pr: -len(pr[0]))


def _root_userns() -> tuple[int, bool]:
    """As root: a user namespace whose uid 0 is root and whose uids 1000.. are unused host uids (fd, True)."""
    exe = shutil.which("unshare")
    if exe is None:
        raise IsolationError("python sandbox: util-linux `unshare` not found (needed to map per-call uids as root)")
    holder = subprocess.Popen([exe, "--user", "--", "sleep", "60"], stdin=subprocess.DEVNULL, env={})
    try:
        mine = os.readlink("/proc/self/ns/user")
        deadline = time.monotonic() + 10
        while os.readlink(f"/proc/{holder.pid}/ns/user") == mine:
            if holder.poll() is not None or time.monotonic() > deadline:
                raise IsolationError(
                    f"python sandbox: cannot create a user namespace here (`unshare --user` failed); {HINT}"
                )
            time.sleep(0.001)
        base = (1 << 30) + secrets.randbelow(1 << 12) * (1 << 16)
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{holder.pid}/{name}", "w") as fh:
                fh.write(f"0 0 1\n{ID_BASE} {base} {ID_COUNT}\n")
        return os.open(f"/proc/{holder.pid}/ns/user", os.O_RDONLY), True
    except OSError as exc:
        raise IsolationError(f"python sandbox: cannot prepare the user namespace ({exc}); {HINT}") from None
    finally:
        holder.kill()
        holder.wait()


def _cgroup_lines() -> list[tuple[str, str]]:
    out = []
    with open("/proc/self/cgroup") as fh:
        for line in fh:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            out.append((controllers, path))
    return out


def _v1_settings(memory_mb: int, max_processes: int, cpus: float | None) -> dict[str, tuple[list, str | None]]:
    mem = memory_mb * 1024 * 1024
    out = {
        "memory": ([("memory.limit_in_bytes", mem), ("memory.memsw.limit_in_bytes", mem)], "memory.oom_control"),
        "pids": ([("pids.max", max_processes + 1)], None),  # + the slot's worker
    }
    if cpus is not None:
        out["cpu"] = ([("cpu.cfs_period_us", 100_000), ("cpu.cfs_quota_us", max(1000, int(cpus * 100_000)))], None)
    return out


def make_cgroups(memory_mb: int, max_processes: int, cpus: float | None) -> tuple[list[str], list[dict], list[str]]:
    """Create this sandbox's cgroup directories (empty; the zygote adds one per call in flight).

    Returns `(bwrap bind args, zygote cgroup specs, host dirs to remove)`; empty lists when this process may not
    create cgroups (then the per-call limits are rlimits, see the module docstring)."""
    name = f"appo-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
    binds, specs, made = [], [], []
    try:
        lines = _cgroup_lines()
    except OSError:
        return [], [], []
    v2_path = next((p for c, p in lines if c == ""), None)
    v2_root = CGROUP_ROOT if os.path.exists(f"{CGROUP_ROOT}/cgroup.controllers") else f"{CGROUP_ROOT}/unified"
    if v2_path is not None and os.path.exists(f"{v2_root}/cgroup.controllers"):
        remove_stale_cgroups(f"{v2_root}{v2_path.rstrip('/')}")
        try:
            with open(f"{v2_root}{v2_path}/cgroup.controllers") as fh:
                available = fh.read().split()
        except OSError:
            available = []
        wanted = {"memory", "pids"} | ({"cpu"} if cpus is not None else set())
        if wanted <= set(available):
            base = f"{v2_root}{v2_path.rstrip('/')}/{name}"
            try:
                os.mkdir(base)
                made.append(base)
                with open(f"{base}/cgroup.subtree_control", "w") as fh:
                    fh.write(" ".join(f"+{c}" for c in sorted(wanted)))
                mem = memory_mb * 1024 * 1024
                files = [("memory.max", mem), ("memory.swap.max", 0), ("pids.max", max_processes + 1)]
                if cpus is not None:
                    files.append(("cpu.max", f"{max(1000, int(cpus * 100_000))} 100000"))
                binds += ["--bind", base, "/cg/v2"]
                specs.append({"dir": "/cg/v2", "files": files, "oom": "memory.events"})
                return binds, specs, made
            except OSError:
                for d in made:
                    _rmdir(d)
                made = []
    for controller, (files, oom) in _v1_settings(memory_mb, max_processes, cpus).items():
        path = next((p for c, p in lines if controller in c.split(",")), None)
        root = f"{CGROUP_ROOT}/{controller}"
        if path is None or not os.path.exists(f"{root}/cgroup.procs"):
            continue
        remove_stale_cgroups(f"{root}{path.rstrip('/')}")
        base = f"{root}{path.rstrip('/')}/{name}"
        try:
            os.mkdir(base)
        except OSError:
            continue
        made.append(base)
        files = [(f, v) for f, v in files if os.path.exists(f"{base}/{f}")]
        binds += ["--bind", base, f"/cg/{controller}"]
        specs.append({"dir": f"/cg/{controller}", "files": files, "oom": oom})
    return binds, specs, made


def _started_after(pid: int, when: float) -> bool:
    """Whether process `pid` started after time `when` (seconds since the epoch): then it reuses a dead pid."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks since boot
        with open("/proc/stat") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return False
    return boot + ticks / os.sysconf("SC_CLK_TCK") > when + 1.0


def stale_pid_entries(folder: str, pattern: re.Pattern) -> list[str]:
    """The entries of `folder` whose name matches `pattern` (group 1: the pid of the process that made it) and
    whose process is gone, or was reused by a process started after the entry last changed; never this process's."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    stale = []
    for name in names:
        match = pattern.match(name)
        if not match or int(match.group(1)) == os.getpid():
            continue
        pid, path = int(match.group(1)), os.path.join(folder, name)
        try:
            changed = os.lstat(path).st_mtime
        except OSError:
            continue
        if os.path.exists(f"/proc/{pid}") and not _started_after(pid, changed):
            continue
        stale.append(path)
    return stale


def remove_stale_cgroups(parent: str) -> list[str]:
    """Remove the `appo-sandbox-<pid>-<hex>` cgroups under `parent` that a killed trainer left behind.

    One is stale when process `pid` is gone, or when the process now holding that pid started after the
    directory was last changed (the pid was reused). A cgroup that still holds a process cannot be removed
    (the kernel refuses) and is left. Returns the removed directories (each logged)."""
    removed = []
    for base in stale_pid_entries(parent, _SANDBOX_CGROUP):
        try:
            for child in os.listdir(base):
                if child.isdigit() and os.path.isdir(os.path.join(base, child)):
                    os.rmdir(os.path.join(base, child))
            os.rmdir(base)
        except OSError as exc:
            logger.debug("python sandbox: stale cgroup %s not removed (%s)", base, exc)
            continue
        removed.append(base)
    if removed:
        logger.info("python sandbox: removed %d cgroup(s) left by killed runs: %s", len(removed), ", ".join(removed))
    return removed


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def _top_paths(paths: list[str]) -> list[str]:
    """`paths` without those inside another one, and without what `/usr` and `/etc` (bound whole) hold."""
    keep = [p for p in sorted(set(paths)) if not any(p != q and p.startswith(q + "/") for q in paths)]
    return [p for p in keep if not (p.startswith("/usr/") or p.startswith("/etc/") or p in ("/usr", "/etc"))]


def _bind_tree(paths: list[str]) -> list[str]:
    """bwrap arguments binding `paths` read-only, creating missing parents (mode 0755) first."""
    args, made = [], {"/", "/usr", "/etc"}
    for p in _top_paths(paths):
        parts = p.strip("/").split("/")
        for i in range(1, len(parts)):
            parent = "/" + "/".join(parts[:i])
            if parent not in made:
                made.add(parent)
                args += ["--perms", "0755", "--dir", parent]
        args += ["--ro-bind", p, p]
    return args


def _under_call_tmpfs(paths: list[str]) -> list[tuple[str, str]]:
    """(side path, path) for the interpreter's directories that a call's private `/tmp` or `/dev/shm` would hide
    (a venv under `/tmp`, as in a CI clone): bwrap binds them a second time at the side path, and each call binds
    them back, read-only, on its fresh tmpfs (`_jail.enter`)."""
    under = [p for p in _top_paths(paths) if any(p.startswith(d + "/") for d in CALL_TMPFS)]
    return [(f"{INNER_DIR}/keep/{i}", p) for i, p in enumerate(under)]


def check_available() -> None:
    """Raise IsolationError (one line: why, and what to change) when bwrap or libseccomp is missing."""
    if shutil.which("bwrap") is None:
        raise IsolationError(f"python sandbox: bubblewrap (`bwrap`) is not installed; {HINT}")
    try:
        import pyseccomp  # noqa: F401
    except (ImportError, RuntimeError) as exc:
        raise IsolationError(f"python sandbox: pyseccomp/libseccomp unavailable ({exc}); {HINT}") from None


def build_launch(
    zygote_config: dict, memory_mb: int, max_processes: int, cpus: float | None, cgroups: bool = True
) -> Launch:
    """The bwrap command line that starts the zygote (see the module docstring for what it sets up)."""
    check_available()
    bwrap = shutil.which("bwrap")
    fds: list[int] = []
    if os.geteuid() == 0:
        fd, distinct = _root_userns()
        fds.append(fd)
        user = ["--userns", str(fd), "--uid", "0", "--gid", "0"]
    else:
        distinct = False
        user = ["--unshare-user", "--uid", "0", "--gid", "0"]
    cg_binds, cg_specs, cg_made = make_cgroups(memory_mb, max_processes, cpus) if cgroups else ([], [], [])
    py_paths = python_paths()
    system = []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            system += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            system += ["--ro-bind", top, top]
    argv = [
        bwrap, *user,
        "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        # no --die-with-parent: it fires when the *thread* that started bwrap exits; the zygote exits when its
        # stdin closes, i.e. when the trainer dies
        # --as-pid-1: the zygote is init of its pid namespace, so killing it kills everything in the sandbox
        "--new-session", "--as-pid-1", "--cap-add", "ALL", "--hostname", "sandbox",
        "--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc", *system,
        "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/dev/shm",
        *_bind_tree(py_paths),  # after the tmpfs mounts, which would hide a venv under /tmp
        "--dir", "/sandbox", "--dir", "/cg", *cg_binds,
    ]  # fmt: skip
    rebind = _under_call_tmpfs(py_paths)
    for side, path in rebind:
        argv += ["--ro-bind", path, side]
    for name in ZYGOTE_FILES:
        argv += ["--ro-bind", os.path.join(TOOLS_DIR, name), f"{INNER_DIR}/{name}"]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}  # fmt: skip
    argv += ["--remount-ro", "/", "--clearenv"]
    for k, v in env.items():
        argv += ["--setenv", k, v]
    hide = hidden_path_map()
    import json

    zcfg = dict(zygote_config, distinct_ids=distinct, cgroups=cg_specs, hide_paths=hide, rebind=rebind)
    argv += ["--chdir", "/", "--", sys.executable, "-I", f"{INNER_DIR}/_zygote.py", json.dumps(zcfg)]
    return Launch(argv, tuple(fds), cg_made, distinct, hide)


def build_unisolated(zygote_config: dict) -> Launch:
    """`isolation: none`: the zygote runs as the trainer's user, with rlimits only. Logged loudly."""
    logger.warning(
        "python sandbox: isolation=none: model-written code runs UNISOLATED as uid %d, with the trainer's files, "
        "network and processes in reach. Use it only for trusted code.",
        os.geteuid(),
    )
    zcfg = dict(zygote_config, distinct_ids=False, cgroups=[], hide_paths=hidden_path_map(), unisolated=True)
    import json

    argv = [sys.executable, "-I", os.path.join(TOOLS_DIR, "_zygote.py"), json.dumps(zcfg)]
    return Launch(argv, (), [], False, zcfg["hide_paths"])
