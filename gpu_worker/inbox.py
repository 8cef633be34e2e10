"""Where a worker rank takes its batches from the scheduler.

On the head node (node 0: the tokenizer, the scheduler and rank 0) every rank binds an ipc socket
of its own. A rank on a worker node (--nnodes > 1, --node-rank > 0) binds tcp on its node's
address instead, and since nothing else tells it when the head node stops, it watches its socket:
once the scheduler that connected has gone (closed, or silent past the heartbeat timeout: a dead
host), the rank stops. Under --tp-size > 1 rank 0 gathers every rank's address and reports them
in its WorkerReady; the scheduler connects to each.
"""

from __future__ import annotations

import zmq
import zmq.utils.monitor

from protocol.transport import HEARTBEAT_SOCKET_OPTIONS, Endpoints, make_socket


class Inbox:
    """A rank's batch socket; ``wait`` blocks until a frame can be read, or the scheduler left."""

    def __init__(self, ctx: zmq.Context, endpoints: Endpoints, tp_rank: int, node_host: str) -> None:
        if not node_host:
            self.sock = make_socket(ctx, zmq.PULL, endpoints.tp_rank(tp_rank).to_worker, bind=True)
            self._monitor: zmq.Socket | None = None
        else:
            self.sock = ctx.socket(zmq.PULL)
            for option, value in HEARTBEAT_SOCKET_OPTIONS:  # it pings the scheduler's connection
                self.sock.setsockopt(option, value)
            self.sock.bind(f"tcp://{node_host}:*")  # a free port: rank 0 passes it on
            self._monitor = self.sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        if self._monitor is not None:
            self._poller.register(self._monitor, zmq.POLLIN)
        self._peers = 0

    def wait(self) -> bool:
        """True when a frame can be read; False once the scheduler that connected is gone."""
        if self._monitor is None:
            return True  # an ipc inbox only waits for frames: its blocking recv waits, no poll a step
        while True:
            ready = dict(self._poller.poll())
            if self.sock in ready:
                return True
            event = zmq.utils.monitor.recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_ACCEPTED:
                self._peers += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self._peers -= 1
                if self._peers == 0:
                    return False
