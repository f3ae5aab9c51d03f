"""What `onebit serve`'s port answers while the model loads: every request gets 503 and
`{"status": "loading"}` (llama-server's answer), so a client polling /health waits for 200
instead of hanging on a connection nobody reads. The same listening socket is handed to the
HTTP server once the model is in."""

from __future__ import annotations

import json
import socket
import threading

BODY = json.dumps({"status": "loading", "error": {"message": "Loading model", "type": "unavailable_error",
                                                  "code": 503}}).encode()
RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"Connection: close\r\nContent-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)


class LoadingAnswer:
    """A thread answering 503 on `sock` until `stop()` (the socket stays open and listening)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="onebit-serve-loading", daemon=True)
        self.timeout = sock.gettimeout()
        sock.settimeout(0.1)
        self.thread.start()

    def _serve(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                return
            try:
                conn.settimeout(1.0)
                head = b""
                while b"\r\n\r\n" not in head and len(head) < 65536:
                    piece = conn.recv(4096)
                    if not piece:
                        break
                    head += piece
                conn.sendall(RESPONSE)
            except OSError:
                pass
            finally:
                conn.close()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        self.sock.settimeout(self.timeout)


__all__ = ["LoadingAnswer"]

