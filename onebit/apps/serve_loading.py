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


def load_in_passing_thread(load):
    """load() run on a thread that ends when it returns (its result, or its exception raised
    here). The cpu backend's kernels run on GNU OpenMP, which gives every thread that starts a
    parallel region a team of workers of its own, kept until that thread ends, and lets the
    workers spin between regions only while it manages no more threads than there are cores.
    A load on the main thread left its team there while the requests' forwards ran on a
    serving thread with another: the 0.86B MoE decoded 64-75 tok/s on a serving thread against
    92-106 on the thread that loaded it (2-core VM). Loaded on a thread that ends, the serving
    thread's team is the only one."""
    out: dict = {}

    def run():
        try:
            out["model"] = load()
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            out["error"] = e

    t = threading.Thread(target=run, name="onebit-serve-load", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.2)  # (in steps: Ctrl-C still reaches the main thread)
    if "error" in out:
        raise out["error"]
    return out["model"]
