"""The suite's fork launcher: ranks forked from one warm interpreter instead of started cold.

A cold rank spends 4 to 5 seconds before it trains: importing torch, torch._dynamo (the optimizer
imports it), DeepSpeed and the suite, every time, in every rank and in the launcher too (measured
2026-11-27 on the 2-core CI machine: a 2-step tiny run takes 5.6 s under plain python, of which
1.3 s is training; 8.3 s as 2 DDP ranks under torchrun). A test whose subject is a backend, a
checkpointing policy or a record rather than a launcher launches through this instead:

    server   python tests/support/forkserver.py serve SOCKET
             one per test run (tests/conftest.py starts it at the first fork launch and stops it at
             the end): imports torch, dynamo, DeepSpeed, transformers and the suite's modules once,
             then forks a supervisor per request, which forks the rank and reports how it ended.
    launch   python tests/support/forkserver.py launch --launcher torchrun --nproc 2 train.py ARGS
             (or `-m MODULE ARGS`, as python -m)
             a launcher command (the sweep's runner starts it as it would start torchrun): asks the
             server for the ranks, passes its stdout and stderr on to them, forwards SIGTERM and
             SIGINT, and exits as the launcher it stands for would (the first failing rank's code).
    Forked   that command run from the calling process without its interpreter (conftest.forked_runs:
             the runner of a sweep run in the test process starts its runs this way): the ranks in a
             process group of their own, a thread waiting for them.

Each rank runs its script as `python SCRIPT ARGS` would (runpy, as __main__, with the request's
argv, environment, working directory and PYTHONPATH), in the environment its launcher gives it:
torchrun's (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID,
...) or the deepspeed launcher's (CROSS_RANK, LOCAL_SIZE and `--local_rank=N` in argv), so a record
names the launcher it would have named. What stays real: every launcher keeps tests of its own
(tests/support/launches.py launches the reference, DDP with accumulation and ZeRO-2 with the real ones; the
fault, multi-node, accelerate, Slurm and bad-input tests start them too). A rank whose client dies
(the test timed out, SIGKILL) is killed by its supervisor; a rank whose supervisor dies gets
SIGTERM (train.py's stop_with_launcher). Each forked rank adds a line to the suite's launch log
(tests/support/tiers.py counts them as forks, beside the interpreters).

This module's launch side imports nothing heavy (it runs as a launcher command); only `serve` imports torch.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys
import time

SOCKET_ENV = "GPTLITE_TEST_FORKSERVER"  # the server's socket, for launch commands started under the suite
LOG_ENV = "GPTLITE_TEST_LAUNCH_LOG"  # tests/support/tiers.py's launch log
LAUNCHERS = ("python", "torchrun", "deepspeed")
KILL_GRACE_S = 15  # after SIGTERM, as the sweep's runner waits
REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above tests/support/


# ------------------------------------------------------------------ the wire: one JSON message, with fds
def _send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    payload = json.dumps(message).encode()
    data = struct.pack("!I", len(payload)) + payload
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def _receive(sock: socket.socket, with_fds: bool = False):
    fds: list[int] = []
    if with_fds:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 8)
    else:
        data = sock.recv(1 << 20)
    if not data:
        return None, fds
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        more = sock.recv(1 << 20)
        if not more:
            raise ConnectionError("the fork server closed the connection mid-message")
        data += more
    size = struct.unpack("!I", data[:4])[0]
    return json.loads(data[4:4 + size]), fds


# ------------------------------------------------------------------ the server
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.fsdp", "torch.utils.flop_counter",
           "training.cli", "training.run", "training.setup", "training.loop", "backends", "estimator", "models",
           "gptlite.model", "deepspeed", "transformers")


def _preload() -> None:
    """Everything a rank imports, once. Not train.py itself: it pins the allocator at import
    (core/allocator.py), and a rank must do that itself, from its own environment."""
    import importlib
    import pkgutil

    for name in PRELOAD:
        try:
            module = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 (an optional library: the rank imports it itself, as it would)
            print(f"forkserver: not preloaded: {name} ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
            continue
        if name in ("backends", "models", "estimator"):  # the suite's packages, every module
            for info in pkgutil.iter_modules(module.__path__, f"{name}."):
                try:
                    importlib.import_module(info.name)
                except Exception as e:  # noqa: BLE001
                    print(f"forkserver: not preloaded: {info.name} ({e})", file=sys.stderr, flush=True)


def _cache_cpuinfo() -> None:
    """py-cpuinfo answers get_cpu_info() by starting an interpreter (1.2 s of CPU on the CI machine),
    and DeepSpeed asks it each time it loads a CPU op (twice per op: its -march and SIMD flags): 32
    interpreters in one test run. The same machine gives the same answer: asked once here, every
    fork reads it."""
    try:
        import cpuinfo

        info = cpuinfo.get_cpu_info()
    except Exception:  # noqa: BLE001 (not installed or failing: DeepSpeed falls back as it would)
        return
    cpuinfo.get_cpu_info = lambda: dict(info)


def serve(path: str) -> None:
    import gc

    sys.path[0] = REPOSITORY  # the repository, not tests/support/
    ready = os.dup(1)  # stdout says "ready" only: what the imports print goes to stderr
    os.dup2(2, 1)
    _preload()
    _cache_cpuinfo()
    base_path = [p for p in sys.path if p]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    gc.collect()
    gc.freeze()  # what is loaded stays shared with every fork (no copy-on-write from the collector)
    os.write(ready, b"ready\n")
    os.close(ready)
    while True:
        conn, _ = listener.accept()
        try:
            request, fds = _receive(conn, with_fds=True)
        except (OSError, ValueError):
            conn.close()
            continue
        if request is None or request.get("stop"):
            conn.close()
            if request is not None:
                return
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            _supervise(conn, request, fds, base_path)  # never returns
        conn.close()
        for fd in fds:
            os.close(fd)


def _supervise(conn: socket.socket, request: dict, fds: list[int], base_path: list[str]) -> None:
    """A rank's supervisor: forks it, tells the client its pid and then how it ended; kills it if the
    client goes away."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        child = os.fork()
        if child == 0:
            conn.close()
            _run_rank(request, fds, base_path)  # never returns
        for fd in fds:
            os.close(fd)
        if "group" in request:  # set here too (the rank also sets it): the group exists before the reply
            _set_group(child, request["group"])
        _send(conn, {"pid": child})
        conn.setblocking(False)
        killed_at = None
        while True:
            pid, status = os.waitpid(child, os.WNOHANG)
            if pid:
                try:
                    _send_blocking(conn, {"returncode": os.waitstatus_to_exitcode(status)})
                except OSError:
                    pass
                os._exit(0)
            try:
                gone = conn.recv(1) == b""
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone and killed_at is None:  # the client died: its ranks go with it, as a launcher's would
                killed_at = time.monotonic()
                _signal(child, signal.SIGTERM)
            if killed_at is not None and time.monotonic() - killed_at > KILL_GRACE_S:
                _signal(child, signal.SIGKILL)
            time.sleep(0.05)
    except BaseException:  # noqa: BLE001 (a supervisor never returns into the server's loop)
        os._exit(1)


def _send_blocking(conn: socket.socket, message: dict) -> None:
    conn.setblocking(True)
    _send(conn, message)


def _set_group(pid: int, group: int) -> None:
    """`pid` into process group `group` (0: a group of its own, whose id is its pid)."""
    try:
        os.setpgid(pid, group or pid)
    except OSError:  # the rank already ended, or (a race) joined it itself
        pass


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _run_rank(request: dict, fds: list[int], base_path: list[str]) -> None:
    """In the forked rank: become `python SCRIPT ARGS` in the request's environment, run, exit."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (null, *fds):
            if fd > 2:
                os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if "group" in request:
            _set_group(0, request["group"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        argv = request["argv"]
        module = argv[1] if argv[0] == "-m" else None  # python -m MODULE ARGS
        first = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0]))
        python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = list(dict.fromkeys([first, *python_path, *base_path]))
        sys.argv = [module, *argv[2:]] if module else [os.path.abspath(argv[0]), *argv[1:]]
        _log_fork(argv)
        import runpy

        try:
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            code = 128 + signal.SIGINT
        except BaseException:  # noqa: BLE001 (as an interpreter would: the traceback, exit 1)
            import traceback

            traceback.print_exc()
            code = 1
        import atexit
        import logging

        atexit._run_exitfuncs()
        logging.shutdown()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _log_fork(argv: list[str]) -> None:
    log = os.environ.get(LOG_ENV)
    if not log:
        return
    line = f"{os.getpid()} [fork] {' '.join(argv)}"[:300].replace("\n", " ")
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode() + b"\n")
    finally:
        os.close(fd)


# ------------------------------------------------------------------ the client: a launcher
def rank_envs(launcher: str, nproc: int, env: dict, port: int) -> list[dict]:
    """Each rank's environment, as `launcher` would give it."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)} (got {launcher!r})")
    if launcher == "python":
        if nproc != 1:
            raise ValueError("the python launcher starts one process")
        return [dict(env)]
    ranks = []
    for rank in range(nproc):
        e = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        if launcher == "torchrun":
            e.update(LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_RANK=str(rank),
                     ROLE_NAME="default", ROLE_WORLD_SIZE=str(nproc), TORCHELASTIC_RUN_ID="none",
                     TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                     TORCHELASTIC_USE_AGENT_STORE="False")
            e.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default
        else:
            e.update(CROSS_RANK="0", CROSS_SIZE="1", LOCAL_SIZE=str(nproc))
        ranks.append(e)
    return ranks


def start(argv: list[str], launcher: str, nproc: int, *, env: dict, cwd: str, stdout: int, stderr: int,
          socket_path: str | None = None, pids: list[int] | None = None, group: bool = False) -> list[dict]:
    """Fork `nproc` ranks of `python argv...` as `launcher` would start them; each rank's
    {"sock", "pid", "code"} (for _wait). `pids`: a list the ranks' pids are appended to as they start
    (a signal handler forwards to them). `group`: the ranks in a process group of their own, whose id
    is rank 0's pid (what a launcher started in a session of its own is to its caller)."""
    from core.ports import free_port

    path = socket_path or os.environ[SOCKET_ENV]
    port = free_port() if nproc > 1 or launcher != "python" else 0
    ranks: list[dict] = []
    try:
        for rank, rank_env in enumerate(rank_envs(launcher, nproc, env, port)):
            rank_argv = list(argv)
            if launcher == "deepspeed":
                rank_argv.insert(2 if argv[0] == "-m" else 1, f"--local_rank={rank}")
            request = {"argv": rank_argv, "env": rank_env, "cwd": cwd}
            if group:
                request["group"] = ranks[0]["pid"] if ranks else 0
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            _send(sock, request, [stdout, stderr])
            reply, _ = _receive(sock)
            if reply is None or "pid" not in reply:
                sock.close()
                raise ConnectionError(f"the fork server did not start rank {rank}")
            ranks.append({"sock": sock, "pid": reply["pid"], "code": None})
            if pids is not None:
                pids.append(reply["pid"])
    except BaseException:
        _end(ranks)
        raise
    return ranks


def _end(ranks: list[dict]) -> None:
    """Kill the ranks that have not ended; close their connections."""
    for r in ranks:
        if r["code"] is None:
            _signal(r["pid"], signal.SIGKILL)
        r["sock"].close()


def launch(argv: list[str], launcher: str, nproc: int, *, env: dict, cwd: str, stdout: int, stderr: int,
           timeout: float | None = None, socket_path: str | None = None, pids: list[int] | None = None) -> int:
    """Fork `nproc` ranks of `python argv...` as `launcher` would start them; wait for them; the
    first failing rank's exit code (0 if all succeeded). On a failure the other ranks get SIGTERM
    (torchrun's behaviour). `timeout`: kill them all and raise TimeoutError. `pids`: as start's."""
    ranks = start(argv, launcher, nproc, env=env, cwd=cwd, stdout=stdout, stderr=stderr, socket_path=socket_path,
                  pids=pids)
    try:
        return _wait(ranks, timeout)
    finally:
        _end(ranks)


def _wait(ranks: list[dict], timeout: float | None) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    selector = selectors.DefaultSelector()
    for r in ranks:
        selector.register(r["sock"], selectors.EVENT_READ, r)
    first_failure, stopping_since = None, None
    while any(r["code"] is None for r in ranks):
        wait = 1.0
        if deadline is not None:
            wait = min(wait, deadline - time.monotonic())
            if wait <= 0:
                for r in ranks:
                    if r["code"] is None:
                        _signal(r["pid"], signal.SIGKILL)
                raise TimeoutError(f"the ranks ran past {timeout:g} s")
        for key, _ in selector.select(wait):
            r = key.data
            reply, _ = _receive(r["sock"])
            r["code"] = reply["returncode"] if reply else -signal.SIGKILL
            selector.unregister(r["sock"])
            if r["code"] != 0 and first_failure is None:
                first_failure, stopping_since = r["code"], time.monotonic()
                for other in ranks:
                    if other["code"] is None:
                        _signal(other["pid"], signal.SIGTERM)
        if stopping_since is not None and time.monotonic() - stopping_since > KILL_GRACE_S:
            for r in ranks:
                if r["code"] is None:
                    _signal(r["pid"], signal.SIGKILL)
    return first_failure if first_failure is not None else 0


class Forked:
    """A launch command (`forkserver.py launch ...`) run from this process, without its interpreter:
    the subset of subprocess.Popen that orchestration/runner.py uses (`pid`, `returncode`, `poll`, `wait`).
    The ranks are forked as the command would fork them, in a process group of their own whose id is
    `pid`, so signalling the group (the runner's _kill_group) reaches them as the launcher's
    forwarding would; a thread waits for them as the command would (a failing rank stops the others)."""

    def __init__(self, command: list[str], *, cwd, env: dict, stdout, stderr=None, start_new_session=True):
        """`command`: one is_launch_command accepts (conftest._popen sends only those, without a preexec_fn)."""
        import subprocess
        import threading

        parsed = parse_launch(list(map(str, command[3:])))
        if parsed is None:
            raise ValueError(f"not a fork launch command: {command}")
        launcher, nproc, argv = parsed
        out = stdout if isinstance(stdout, int) else stdout.fileno()
        err = out if stderr in (None, subprocess.STDOUT) else stderr if isinstance(stderr, int) else stderr.fileno()
        self.args, self.returncode = command, None
        self._ranks = start(argv, launcher, nproc, env=dict(env), cwd=str(cwd), stdout=out, stderr=err,
                            socket_path=env.get(SOCKET_ENV) or os.environ[SOCKET_ENV], group=True)
        self.pid = self._ranks[0]["pid"]
        self._thread = threading.Thread(target=self._wait, name=f"forked-{self.pid}", daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        code = 1
        try:
            code = _wait(self._ranks, None)
        finally:
            _end(self._ranks)
            self.returncode = code

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


def is_launch_command(command) -> bool:
    """A command fork launcher's `launch` (conftest.fork_command builds them)."""
    return (len(command) > 3 and os.path.abspath(str(command[1])) == os.path.abspath(__file__)
            and command[2] == "launch")


class Server:
    """The server of one test run: started on first use, stopped at the end (tests/conftest.py)."""

    def __init__(self, directory: str, env: dict):
        self.directory, self.env = directory, env
        self.path: str | None = None
        self.proc = None

    def socket(self) -> str:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"the fork server exited ({self.proc.returncode}): {self.directory}/server.log")
        if self.path is None:
            import subprocess

            path = os.path.join(self.directory, "forkserver.sock")
            log = open(os.path.join(self.directory, "server.log"), "w")
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", path],
                                         env=self.env, stdout=subprocess.PIPE, stderr=log, text=True)
            ready = self.proc.stdout.readline().strip()
            if ready != "ready":
                self.proc.kill()
                raise RuntimeError(f"the fork server did not start ({self.proc.wait()}): {log.name}")
            self.path = path
        return self.path

    def stop(self) -> None:
        """Stop the server; its directory (socket and log) goes with it unless it died (the log says why)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(self.path)
                _send(sock, {"stop": True})
            self.proc.wait(timeout=30)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            return
        import shutil

        shutil.rmtree(self.directory, ignore_errors=True)


def parse_launch(args: list[str]) -> tuple[str, int, list[str]] | None:
    """`--launcher L --nproc N SCRIPT ARGS...` as (launcher, nproc, argv); None if malformed."""
    if (len(args) < 5 or args[0] != "--launcher" or args[2] != "--nproc" or args[1] not in LAUNCHERS
            or not args[3].isdigit()):
        return None
    return args[1], int(args[3]), args[4:]


def _launch_main(args: list[str]) -> int:
    """`forkserver.py launch --launcher L --nproc N SCRIPT ARGS...` (or `-m MODULE ARGS...`): a
    launcher command."""
    parsed = parse_launch(args)
    if parsed is None:
        print("usage: forkserver.py launch --launcher {python,torchrun,deepspeed} --nproc N (SCRIPT | -m MODULE) "
              "ARGS...", file=sys.stderr)
        return 2
    launcher, nproc, argv = parsed
    pids: list[int] = []

    def forward(signum, frame):  # to the ranks, as torchrun does; then wait for them to end
        for pid in list(pids):
            _signal(pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    sys.path.insert(0, REPOSITORY)
    return launch(argv, launcher, nproc, env=dict(os.environ), cwd=os.getcwd(), stdout=1, stderr=2, pids=pids)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"] and len(sys.argv) == 3:
        serve(sys.argv[2])
    elif sys.argv[1:2] == ["launch"]:
        sys.exit(_launch_main(sys.argv[2:]))
    else:
        sys.exit("usage: python tests/support/forkserver.py serve SOCKET | launch --launcher L --nproc N SCRIPT ARGS...")
