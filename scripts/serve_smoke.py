"""Start ``cdb serve`` as a user would, stream one completion through the OpenAI HTTP API, stop it; print what a
terminal shows (the start lines: the memory plan, the device) and the streamed text.

    python scripts/serve_smoke.py MODEL [cdb serve options...]

Exit 0 when the tree started, streamed and stopped cleanly. Used by ``scripts/gpu_check.sh`` on a CUDA host (no
``--device``: the tree must pick the GPU and size its KV cache to the GPU's memory by itself).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

HTTP = "127.0.0.1:8017"


def _pump(proc: subprocess.Popen[str], lines: list[str], ready: threading.Event) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        print(f"  | {line.rstrip()}", flush=True)
        if "OpenAI-compatible HTTP API" in line:
            ready.set()
    ready.set()


def _stream(model: str) -> str:
    body = json.dumps({"model": model, "prompt": "The quick brown fox", "max_tokens": 16, "stream": True}).encode()
    request = urllib.request.Request(f"http://{HTTP}/v1/completions", body, {"content-type": "application/json"})
    text = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                text.extend(choice.get("text", "") for choice in json.loads(line[6:])["choices"])
    return "".join(text)


def main(argv: list[str]) -> int:
    cmd = [sys.executable, "-m", "cdb", "serve", *argv, "--http", HTTP, "--listen", "127.0.0.1:50077"]
    print("$ " + " ".join(cmd[1:]), flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    ready = threading.Event()
    threading.Thread(target=_pump, args=(proc, lines, ready), daemon=True).start()
    ready.wait(300)
    if proc.poll() is not None:
        print(f"cdb serve exited {proc.returncode} before serving", flush=True)
        return 1
    try:
        with urllib.request.urlopen(f"http://{HTTP}/v1/models", timeout=30) as response:
            model = json.load(response)["data"][0]["id"]
        t0 = time.perf_counter()
        text = _stream(model)
        print(f"streamed ({time.perf_counter() - t0:.2f} s): {text!r}", flush=True)
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
    print(f"cdb serve exited {code}", flush=True)
    return 0 if code == 0 and text else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
