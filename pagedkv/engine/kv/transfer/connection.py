"""The decode instance's link to one prefill instance: the NIXL connection set up front, and request /
reply messages over ZeroMQ. A part of KVTransferClient (its state is set by KVTransferClient.__init__)."""
import json
import time

import numpy as np
import torch

from .protocol import KVTransferError, send


class PeerConnection:
    """Messages to and from the prefill instance (socket, agent, remote and cache: see KVTransferClient)."""

    def _connect(self) -> None:
        """Sets up the NIXL connection now, not in the first read: a read of a few bytes of the remote cache
        into a scratch buffer, while the server drives its side of the wire-up."""
        self.agent.make_connection(self.remote_name)
        scratch = torch.empty(64, dtype=torch.uint8, device=self.cache.tensors[0].device)
        reg = self.agent.register_memory(scratch)
        try:
            local = np.array([(scratch.data_ptr(), 64, self.cache.device_id)], dtype=np.uint64)
            remote = np.array([(self.remote["bases"][0], 64, self.remote["device_id"])], dtype=np.uint64)
            handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, self.cache.mem_type),
                                                self.agent.get_xfer_descs(remote, self.cache.mem_type),
                                                self.remote_name)
            deadline = time.monotonic() + self.timeout_s
            state = self.agent.transfer(handle)
            while state == "PROC" and time.monotonic() < deadline:
                state = self.agent.check_xfer_state(handle)
            handle.release()
            if state != "DONE":
                raise KVTransferError(f"NIXL could not read from the prefill instance at {self.endpoint}: {state}")
        finally:
            self.agent.deregister_memory(reg)
        self._request({"type": "connected"})

    # ---- messages
    def _request(self, message: dict, timeout_s: float | None = None):
        """Sends a message and waits for the reply with its id (replies to older requests are dropped);
        (None, []) after the timeout."""
        self._next_id += 1
        message = dict(message, id=self._next_id)
        send(self.socket, message)
        return self._wait({self._next_id}, timeout_s)[self._next_id]

    def _wait(self, ids: set, timeout_s: float | None = None) -> dict:
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        replies: dict = {i: (None, []) for i in ids}
        pending = set(ids)
        while pending:
            left = deadline - time.monotonic()
            if left <= 0 or not self.socket.poll(int(left * 1000) + 1):
                break
            parts = self.socket.recv_multipart()
            try:
                msg = json.loads(parts[0])
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("id") in pending:
                replies[msg["id"]] = (msg, parts[1:])
                pending.discard(msg["id"])
            elif isinstance(msg, dict) and msg.get("id") in self._submitted:
                self._inbox[msg["id"]] = msg      # an asynchronous request's reply: step() takes it
        return replies

    def server_stats(self) -> dict | None:
        """The prefill server's counters (leases held, pinned blocks, ...), or None without an answer."""
        return self._request({"type": "stats"})[0]
