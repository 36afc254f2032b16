"""How `retrace serve` answers hostile requests, timed by hand (docs/request-limits.md): a 12 MB prompt to
completions and chat, a prompt over the character limit, a chat template stuck in a loop, with /health
polled meanwhile (its slowest answer) and the server's RSS; SIGTERM while the template loops; a 50 MB
line in `retrace generate --prompts-file`. A measurement, not a test (tests/test_serve_limits.py asserts
the behaviour).

    python -m benchmarks.hostile_requests --engine BUNDLE
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# renders the messages, except that a message "LOOP" runs 10^10 empty iterations first
LOOP_TEMPLATE = ("{% for m in messages %}{% if m['content'] == 'LOOP' %}{% for i in range(100000) %}"
                 "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}{{ m['content'] }} {% endfor %}")


def request(port: int, method: str, path: str, body: str | None = None) -> tuple[int, float, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t0 = time.perf_counter()
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, time.perf_counter() - t0, data


def rss_mb(pid: int) -> int:
    line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("VmRSS"))
    return int(line.split()[1]) // 1024


def timed_with_health(port: int, path: str, body: str) -> tuple[int, float, float, int, bytes]:
    """POST body while /health is polled every 50 ms -> (status, seconds, slowest /health s, polls, body)."""
    health: list[float] = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            health.append(request(port, "GET", "/health")[1])
            time.sleep(0.05)

    t = threading.Thread(target=poll)
    t.start()
    try:
        status, dt, data = request(port, "POST", path, body)
    finally:
        stop.set()
        t.join()
    return status, dt, max(health, default=0.0), len(health), data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True, help="engine bundle")
    args = ap.parse_args()
    exe = str(Path(sys.executable).parent / "retrace")
    tmp = Path(tempfile.mkdtemp(prefix="retrace-hostile-"))
    (tmp / "loop.jinja").write_text(LOOP_TEMPLATE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "serve", "--engine", args.engine, "--port", str(port), "--threads", "1",
                             "--no-verify-bundle", "--log-level", "warning", "--chat-template",
                             str(tmp / "loop.jinja")])
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"retrace serve exited with {proc.returncode}")
        try:
            if request(port, "GET", "/health")[0] == 200:
                break
        except OSError:
            time.sleep(0.3)
    print(f"server RSS at start: {rss_mb(proc.pid)} MB")
    big = "word " * 2_400_000  # 12 MB
    for name, path, body in (
        ("12 MB prompt, completions", "/v1/completions", json.dumps({"prompt": big, "max_tokens": 4})),
        ("12 MB prompt, chat", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": big}]})),
        ("1.04 M-character prompt (1.3 MB)", "/v1/completions", json.dumps({"prompt": "word" * 260_000})),
        ("chat template in a loop", "/v1/chat/completions", json.dumps({"messages": [{"role": "user",
                                                                                       "content": "LOOP"}]})),
    ):
        status, dt, health, polls, data = timed_with_health(port, path, body)
        message = json.loads(data)["error"]["message"] if status >= 400 else ""
        print(f"{name}: {status} in {dt:.3f} s; slowest /health {health * 1000:.0f} ms of {polls}; "
              f"RSS {rss_mb(proc.pid)} MB; {message}")
    loop = threading.Thread(target=request, args=(port, "POST", "/v1/chat/completions",
                                                  json.dumps({"messages": [{"role": "user", "content": "LOOP"}]})))
    loop.start()
    time.sleep(1.0)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(120)
    loop.join()
    print(f"SIGTERM 1 s into a looping template: exit {rc} after {time.perf_counter() - t0:.2f} s")
    line = tmp / "50mb.jsonl"
    line.write_text(json.dumps({"prompt": "word " * 10_000_000}) + "\n")
    for name, f in (("1-line prompts file (start-up only)", tmp / "small.jsonl"), ("50 MB line", line)):
        if not f.exists():
            f.write_text('{"prompt": "word"}\n')
        t0 = time.perf_counter()
        res = subprocess.run(["/usr/bin/time", "-f", "%U %S %M", exe, "generate", "--engine", "/nonexistent",
                              "--prompts-file", str(f)], capture_output=True, text=True)
        user, sys_s, max_kb = res.stderr.strip().splitlines()[-1].split()
        print(f"generate --prompts-file, {name}: exit {res.returncode} in {time.perf_counter() - t0:.2f} s wall, "
              f"{float(user) + float(sys_s):.2f} s CPU, {int(max_kb) // 1024} MB max RSS; "
              f"{res.stderr.strip().splitlines()[0][:100]}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
