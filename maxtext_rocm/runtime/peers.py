"""A dead peer, named: the survivors of a multi-process run say which process went silent.

Left to itself, a process whose peer dies learns it from below: a Gloo collective fails on a
closed socket (a traceback, then an abort, exit status 134, with a C++ stack dump), or, after
`distributed.heartbeat_timeout_s`, the coordination service declares the task dead and JAX
aborts the others with a message about "another task". Neither names the process.

So every process keeps one TCP connection to process 0 (a star; process 0 listens on a free port
of the coordinator's host and publishes it in JAX's key-value store): a process that dies, for
whatever reason, SIGKILL included, has its socket closed by the kernel at once, long before a
heartbeat is missed. The side that sees the connection close without a goodbye prints one
sentence naming the process (its id, pid and host) and exits with PEER_LOST_EXIT_STATUS, before
JAX's own abort; process 0 first tells every other process which one it lost, so they name it
too. A process that ends through `say_goodbye` (any exit of `train.main`) tells the others its
exit status first: 0 is a normal end, and so is the status every process agreed to end with (an
agreed stop after SIGINT ends all with 130: `expect_exit`); anything else stops them with a
sentence naming it. A peer's user error (exit status 2: bad input, which every process usually
finds alike, a few milliseconds apart) gives this process USER_ERROR_GRACE_S to reach its own end
and print its own sentence; if it does not, it stops with the same status 2, since restarting
from a checkpoint cannot mend bad input.

What this cannot see: a host that vanishes without closing its sockets (power loss, a network
partition). TCP keepalive probes after `heartbeat_timeout_s / 2` cover part of that; the
coordination service's heartbeat remains the bound, and JAX's abort (exit 134) the outcome there.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

PEER_LOST_EXIT_STATUS = 5
USER_ERROR_EXIT_STATUS = 2  # bad input (train.py's status for a UserError)
USER_ERROR_GRACE_S = 5.0
KEY = "maxtext_rocm/peers/listener"


def _keepalive(sock: socket.socket, timeout_s: float) -> None:
    idle = max(1, int(timeout_s / 2))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", max(1, idle // 4)), ("TCP_KEEPCNT", 4)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class PeerWatch:
    """This process's end of the star: process 0 holds one connection per peer, the others one."""

    def __init__(self, client, process_id: int, num_processes: int, coordinator_host: str,
                 timeout_s: float, heartbeat_s: float, exit=os._exit, stream=None):
        self.process_id, self.num_processes = process_id, num_processes
        self._exit, self._stream = exit, stream
        self._peers: dict[int, tuple[socket.socket, str]] = {}  # id -> (socket, "pid P on HOST")
        self._lock = threading.Lock()
        self._closing = False
        self._lost = threading.Event()  # set once a peer is known lost (this process is about to exit 5)
        self._expected_exit = 0  # a peer's goodbye with this status is an end, not a failure
        self._ending = threading.Event()  # this process has begun its own end (say_goodbye, end_together)
        me = f"{process_id} {os.getpid()} {socket.gethostname()}\n".encode()
        if process_id == 0:
            listener = socket.create_server(("", 0), backlog=num_processes)
            client.key_value_set(KEY, f"{coordinator_host}:{listener.getsockname()[1]}")
            listener.settimeout(timeout_s)
            try:
                for _ in range(num_processes - 1):
                    conn, _ = listener.accept()
                    conn.settimeout(timeout_s)
                    peer_id, pid, host = self._readline(conn).split()
                    conn.settimeout(None)
                    conn.sendall(me)
                    _keepalive(conn, heartbeat_s)
                    self._peers[int(peer_id)] = (conn, f"pid {pid} on {host}")
            finally:
                listener.close()
        else:
            host, port = client.blocking_key_value_get(KEY, int(timeout_s * 1000)).rsplit(":", 1)
            conn = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
            conn.sendall(me)
            peer_id, pid, peer_host = self._readline(conn).split()
            conn.settimeout(None)
            _keepalive(conn, heartbeat_s)
            self._peers[int(peer_id)] = (conn, f"pid {pid} on {peer_host}")
        for peer_id, (conn, _) in self._peers.items():
            threading.Thread(target=self._watch, args=(peer_id, conn), daemon=True,
                             name=f"peer-watch-{peer_id}").start()

    @staticmethod
    def _readline(conn: socket.socket) -> str:
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(256)
            if not chunk:
                raise ConnectionError("closed during the greeting")
            data += chunk
        return data.decode()

    def _watch(self, peer_id: int, conn: socket.socket) -> None:
        """Reads the peer's messages until its connection closes; a close without a goodbye is a
        death. Messages are tab-separated lines: `exit ID STATUS` (a goodbye) and, from process 0,
        `lost ID DESCRIPTION WHAT STATUS` (a relay of what it saw, and the status it stops with)."""
        buffer = b""
        while True:
            try:
                chunk = conn.recv(256)
            except OSError:
                chunk = b""
            if not chunk:
                self._stop(peer_id, self._describe(peer_id), "went silent: its connection closed without "
                           "a goodbye (the process died or its host went down)")
                return
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                words = line.decode(errors="replace").split("\t")
                if words[0] == "exit" and len(words) == 3:
                    who, status = int(words[1]), int(words[2])
                    if status == USER_ERROR_EXIT_STATUS and status != self._expected_exit:
                        if not self._ending.wait(USER_ERROR_GRACE_S):  # else this process says its own
                            self._stop(who, self._describe(who), f"stopped with exit status {status} (bad "
                                       "input; its own log says which)", status=USER_ERROR_EXIT_STATUS)
                    elif status not in (0, self._expected_exit):
                        self._stop(who, self._describe(who), f"stopped with exit status {status} (its own "
                                   "log says why)")
                    return  # a goodbye: the close that follows is expected
                if words[0] == "lost" and len(words) == 5:
                    self._stop(int(words[1]), words[2], words[3], status=int(words[4]))
                    return

    def _describe(self, peer_id: int) -> str:
        detail = self._peers.get(peer_id, (None, ""))[1]
        return f"process {peer_id} of {self.num_processes}" + (f" ({detail})" if detail else "")

    def _stop(self, peer_id: int, who: str, what: str, status: int = PEER_LOST_EXIT_STATUS) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._lost.set()
        if self.process_id == 0:  # the others hear it from here, with the name
            self._broadcast(f"lost\t{peer_id}\t{who}\t{what}\t{status}\n", skip=peer_id)
        why = ("so the scheduler can restart the run from its last checkpoint" if status == PEER_LOST_EXIT_STATUS
               else "(a restart would meet the same input)")
        print(f"error: {who} {what}; process {self.process_id} stops too (exit status {status}) {why}",
              file=self._stream or sys.stderr, flush=True)
        self._exit(status)

    def _broadcast(self, message: str, skip: int | None = None) -> None:
        for peer_id, (conn, _) in self._peers.items():
            if peer_id != skip:
                try:
                    conn.sendall(message.encode())
                except OSError:
                    pass

    def wait_if_peer_lost(self, grace_s: float) -> None:
        """Called when the main thread fails: a collective fails when its peer dies, often just
        before this watch has seen the connection close. If a loss is seen within `grace_s`, the
        watch's own thread names it and exits 5; this one waits for that instead of printing a
        traceback of the consequence."""
        if self._lost.wait(grace_s):
            threading.Event().wait()  # the watch thread ends the process

    def expect_exit(self, status: int) -> None:
        """Every process will end with `status` (runtime/preemption.py's agreed stop): a peer that
        says goodbye with it first has ended as agreed, and this one goes on to its own end."""
        self._expected_exit = status

    def end_together(self) -> None:
        """Every process is about to end with the same error (a config disagreement): no goodbye
        and no report of a peer whose connection closes from here on."""
        self._ending.set()
        with self._lock:
            self._closing = True

    def say_goodbye(self, status: int) -> None:
        """This process ends with `status`: the others learn it before its sockets close."""
        self._ending.set()
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._broadcast(f"exit\t{self.process_id}\t{status}\n")
        time.sleep(0.05)  # let the message leave before the process (and its sockets) goes
