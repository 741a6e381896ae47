"""``python -m mmzoo.bench.burst``: the server's memory and a good request's latency under a burst
of oversized requests.

A fresh ``python -m mmzoo.serve`` (the embedded demo checkpoint, ``executor=eager``) takes, from
``--clients`` threads at once:

* ``over body``: chat bodies of ``--body-mb`` MB, over ``limits.max_request_bytes`` (413 from the
  Content-Length, nothing read);
* ``under body, long prompt``: bodies just under that limit whose text is over the prompt limit
  derived from ``max_model_len`` (400 before tokenizing);
* with ``limits.*=0`` (no limits, a server of its own), one body of ``--body-mb`` MB: what a single
  such request cost before the limits.

Meanwhile another thread sends a small good request every 0.2 s. Printed per row: the answers'
status codes, the wall time of the burst, the server's RSS before, its peak (VmHWM) and after, and
the good requests' slowest latency.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from mmzoo.serve import free_port

GB = 1 << 30
MB = 1 << 20


class Server:
    def __init__(self, *overrides: str):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mmzoo.serve", "executor=eager", f"port={self.port}", "served_model_name=demo",
             *overrides], env={**os.environ, "PJRT_DEVICE": "CPU"}, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited: {self.proc.stderr.read()[-2000:]}")
            try:
                if self.request("GET", "/health", b"")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise SystemExit("the server did not start in 300 s")

    def request(self, method: str, path: str, body: bytes, timeout: float = 600) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, r.read()
        except (ConnectionError, http.client.HTTPException):  # closed after a 413 sent before the body was read
            return 413, b""
        finally:
            conn.close()

    def memory(self) -> dict[str, int]:
        """VmRSS and VmHWM (the peak) of the server process, in bytes."""
        out = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0]) * 1024
        return out

    def reset_peak(self) -> None:
        """Start VmHWM afresh (Linux: writing 5 to clear_refs), so each burst's peak is its own."""
        try:
            with open(f"/proc/{self.proc.pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def chat_body(text: str) -> bytes:
    return json.dumps({"model": "demo", "max_tokens": 4, "temperature": 0,
                       "messages": [{"role": "user", "content": text}]}).encode()


def burst(server: Server, bodies: list[bytes], clients: int) -> dict:
    """Send ``bodies`` from ``clients`` threads while a good request repeats; the figures."""
    good = chat_body("What shape is this?")
    stop, latencies = threading.Event(), []

    def keep_asking():
        while not stop.is_set():
            t0 = time.perf_counter()
            status, _ = server.request("POST", "/v1/chat/completions", good)
            latencies.append((time.perf_counter() - t0, status))
            time.sleep(0.2)

    server.reset_peak()
    before = server.memory()["VmRSS"]
    worker = threading.Thread(target=keep_asking, daemon=True)
    worker.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        statuses = list(pool.map(lambda b: server.request("POST", "/v1/chat/completions", b)[0], bodies))
    wall = time.perf_counter() - t0
    time.sleep(1.0)
    stop.set()
    worker.join()
    mem = server.memory()
    codes = {c: statuses.count(c) for c in sorted(set(statuses))}
    return {"requests": len(bodies), "body_mb": round(len(bodies[0]) / MB, 1), "statuses": codes, "wall_s": wall,
            "rss_before": before, "peak": mem["VmHWM"], "rss_after": mem["VmRSS"],
            "good_requests": len(latencies), "good_ok": sum(1 for _, s in latencies if s == 200),
            "good_max_s": max((t for t, _ in latencies), default=float("nan"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--body-mb", type=float, default=50.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--no-baseline", action="store_true", help="skip the server without limits")
    args = ap.parse_args()
    rows = []
    server = Server()
    try:
        over = chat_body("x" * int(args.body_mb * MB))
        rows.append(("over body (413)", burst(server, [over] * args.clients, args.clients)))
        under = chat_body("x" * (32 * MB - 200))  # limits.max_request_bytes: 32 MiB
        rows.append(("under body, long prompt (400)", burst(server, [under] * args.clients, args.clients)))
    finally:
        server.stop()
    if not args.no_baseline:
        server = Server("limits.max_request_bytes=0", "limits.max_prompt_chars=0", "limits.max_media_bytes=0",
                        "limits.max_media_items=0", "limits.max_media_pixels=0")
        try:
            rows.append(("no limits, one body", burst(server, [over], 1)))
        finally:
            server.stop()
    print(f"\nmmzoo.serve under a burst of oversized chat requests ({os.cpu_count()} CPUs; the embedded demo, "
          f"executor=eager)\n")
    print("| burst | requests x MB | answers | wall s | RSS before | peak RSS | RSS after | good requests: ok / sent, "
          "slowest |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | --- |")
    for name, r in rows:
        codes = ", ".join(f"{n}x {c}" for c, n in r["statuses"].items())
        print(f"| {name} | {r['requests']} x {r['body_mb']:g} | {codes} | {r['wall_s']:.1f} | "
              f"{r['rss_before'] / GB:.2f} GB | {r['peak'] / GB:.2f} GB | {r['rss_after'] / GB:.2f} GB | "
              f"{r['good_ok']} / {r['good_requests']}, {r['good_max_s']:.2f} s |")


if __name__ == "__main__":
    main()
