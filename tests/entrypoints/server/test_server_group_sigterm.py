"""A stop signal sent to every process of the server at once, as `kill -TERM -PGID` and systemd
(KillMode=control-group, its default) send it: SIGTERM drains exactly as it does sent to the
server process alone (Docker, Kubernetes): the engine cores and workers leave the stop to the
front end, every open request finishes, the server exits 0 and leaves nothing behind. And an
offline script (`LLM`, an mp worker) killed with `kill -TERM -PGID` dies by the signal, and its
worker follows through its death pipe. (Ctrl-C's SIGINT, which a terminal sends to the whole
foreground group, is ignored by every process but the front end, which stops at once: 130, as
test_server_faults checks with the SIGINT sent to the server alone.)

"In flight" is made certain, not likely: the workers run gate_worker.GatedWorker behind a held
step gate, so no request can finish; the gate opens only once every engine core and worker has
logged that it left the signal to the process that started it (or one of them has died: the
test then fails).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from types import SimpleNamespace

import httpx
import psutil
import pytest
import server_helpers
from server_helpers import TINY_ARGS, Server, StepGate
from sync_helpers import HANG_S, wait_until

from shardserve.process_setup import LEFT_TO_PARENT

pytestmark = pytest.mark.usefixtures("no_leftovers")

GATED = ["--worker-cls", "gate_worker.GatedWorker"]
# Held at the gate, a request of any length stays open; a short one keeps the drain short.
BODY = {"prompt": "The quick brown fox", "max_tokens": 64, "temperature": 0,
        "ignore_eos": True, "stream": True}
# name: (options, how many processes the server starts: engine cores and mp workers). Two
# data-parallel replicas (two engine cores, each with its worker inside) take the uni path
# twice; they passed too, and are left out to keep this file short.
LAYOUTS = {
    "uni": ([], 1),
    "mp_tp2": (["--tensor-parallel-size", "2"], 3),
}


class Stream(threading.Thread):
    """One streaming completion: its events, an error event, a cut connection."""

    def __init__(self, server: Server) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.events: list[dict] = []
        self.error: dict | None = None
        self.failure: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.server.url}/v1/completions", json=BODY,
                              headers=self.server.headers, timeout=HANG_S) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        self.error = event.get("error", self.error)
                        self.events.append(event)
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.failure = e

    def finished_normally(self) -> bool:
        return self.error is None and self.failure is None and any(
            c.get("finish_reason") for e in self.events for c in e.get("choices", []))


def open_request(server: Server) -> Stream:
    """A streaming request, returned once the API server has handed it to the engine client
    (it counts the prompt's tokens then): from there it is open until it ends."""
    before = server.metric("shardserve:prompt_tokens_total", 0.0)
    stream = Stream(server)
    wait_until(lambda: server.metric("shardserve:prompt_tokens_total", 0.0) > before
               or not stream.is_alive(), "the request to reach the engine client")
    assert stream.is_alive(), (stream.events, stream.failure)
    return stream


def start_in_own_group(model, extra: list[str], log_path, gate: StepGate) -> Server:
    """A server that leads a process group (session) of its own: a group signal then reaches
    it and what it starts, not pytest."""
    popen = partial(subprocess.Popen, start_new_session=True)
    server_helpers.subprocess = SimpleNamespace(**{**vars(subprocess), "Popen": popen})
    try:
        server = Server(model, [*TINY_ARGS, *GATED, *extra], log_path, env=gate.env)
    finally:
        server_helpers.subprocess = subprocess
    assert os.getpgid(server.proc.pid) == server.proc.pid
    return server


def signal_group(server: Server, sig: int) -> None:
    server.family |= {p.pid for p in server.descendants()}
    server._signalled_at = time.monotonic()  # what wait_stopped measures from
    os.killpg(server.proc.pid, sig)


def assert_clean_exit(server: Server, status: int) -> None:
    """The server's own exit status; no engine core killed, none died, nothing left."""
    assert server.proc.returncode == status, (server.proc.returncode, server.log())
    log = server.log()
    for bad in ("Traceback", "did not exit in time", "unexpectedly"):
        assert bad not in log, log
    assert not server.leftovers()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def children_alive(server: Server) -> bool:
    return all(alive(p) for p in server.family - {server.proc.pid})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_group_sigterm_drains_every_open_request(tiny_llama_dir, tmp_path, layout):
    extra, children = LAYOUTS[layout]
    gate = StepGate(tmp_path / "steps")
    server = start_in_own_group(tiny_llama_dir, extra, tmp_path / "server.log", gate)
    stopped = False
    try:
        assert len(server.family) == 1 + children, [p.cmdline() for p in server.descendants()]
        gate.hold()  # no model step starts from here: every request stays open
        streams = [open_request(server) for _ in range(4)]
        t0 = time.monotonic()
        signal_group(server, signal.SIGTERM)
        wait_until(lambda: "signal 15: draining" in server.log()
                   and (server.log().count(LEFT_TO_PARENT) == children
                        or not children_alive(server)),
                   "every process to take the signal")
        assert children_alive(server), f"a process died of the signal:\n{server.log()}"
        assert all(s.is_alive() for s in streams), [(s.events[-1:], s.failure) for s in streams]
        gate.open()
        stopped = True
        server.wait_stopped()
    finally:
        gate.open()
        if not stopped:
            server.stop(signal.SIGKILL)
    print(f"{layout}: stopped {time.monotonic() - t0:.2f} s after the group SIGTERM")
    for stream in streams:
        stream.join(HANG_S)
        assert stream.finished_normally(), (stream.events[-1:], stream.failure, server.log())
    assert_clean_exit(server, 0)


OFFLINE_SCRIPT = """
import sys
from shardserve import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", max_model_len=256,
              distributed_executor_backend="mp")
    print(" ".join(str(w.pid) for w in llm.engine.core.executor.workers), flush=True)
    while True:
        llm.generate(["The quick brown fox"] * 8, SamplingParams(max_tokens=50), use_tqdm=False)
        print("generating", flush=True)
"""


def test_group_sigterm_of_an_offline_script_ends_every_process(tiny_llama_dir, tmp_path):
    """The script dies by the signal's default action; its workers, which leave a SIGTERM to
    their live parent, see their death pipe's EOF and exit (unlinking the shared memory)."""
    script = tmp_path / "offline.py"
    script.write_text(OFFLINE_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_llama_dir)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 1
        assert proc.stdout.readline() == "generating\n"  # the workers are busy
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=HANG_S) == -signal.SIGTERM
        t0 = time.monotonic()
        wait_until(lambda: not any(alive(p) for p in workers), "the workers to exit")
        print(f"workers gone {time.monotonic() - t0:.2f} s after the script")
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
