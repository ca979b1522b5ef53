"""The zygote process of a tree (``services.launcher.zygote``, where the launcher's side and the why are): it
imports what ``cdb stage`` imports, then forks a stage for each request line on stdin, answering with its pid.
``--resolved-config DOC`` only names the tree's configuration in its command line (which its stages show too).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback

from services.launcher.child import PARENT_ENV, die_with_parent
from services.launcher.zygote import PR_SET_NAME, prctl


def _fork_stage(request: dict[str, object]) -> int:
    """Fork twice (``services.launcher.zygote``): the stage's pid, or -1."""
    r, w = os.pipe()
    first = os.fork()
    if first == 0:  # the intermediate: fork the stage, say its pid, exit (the stage goes to the launcher)
        code = 0
        try:
            os.close(r)
            pid = os.fork()
            if pid == 0:
                os.close(w)
                _become_stage(request)
            os.write(w, str(pid).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    data = os.read(r, 32)
    os.close(r)
    os.waitpid(first, 0)
    return int(data) if data else -1


def _become_stage(request: dict[str, object]) -> None:
    """In the forked stage: become the launcher's child with its own session, output, environment and name, and
    run ``cdb`` with its arguments. Never returns."""
    code = 1
    try:
        env = dict(request["env"])  # type: ignore[call-overload]
        launcher = int(env[PARENT_ENV])
        while os.getppid() != launcher:  # until the intermediate has exited
            if os.getppid() == 1:
                os._exit(70)  # re-parented to init: the launcher is gone, or no subreaper
            time.sleep(0.0005)
        os.setsid()
        out = os.open(str(request["log"]), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(null)
        os.environ.clear()
        os.environ.update(env)
        argv = [str(a) for a in request["argv"]]  # type: ignore[attr-defined]
        role = argv[argv.index("--role") + 1] if "--role" in argv else "stage"
        prctl(PR_SET_NAME, f"cdb-{role}".encode()[:15])
        from cdb.cli import main

        code = main(argv)
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # (a closed stream: nothing left to write)
                stream.flush()
        os._exit(code)


def main() -> int:
    """``python -m cdb.zygote --resolved-config DOC``: preload, then fork a stage per request line
    on stdin (JSON: ``argv``, ``env``, ``log``), answering each with the stage's pid on stdout."""
    die_with_parent()
    import torch

    import cdb.processes  # noqa: F401  (what ``cdb stage`` imports: torch, gRPC, the model and the stage server)
    import services.transport.stage_server  # noqa: F401

    if torch.cuda.is_initialized():  # a forked child could not use the device: the launcher starts interpreters
        print("cdb.zygote: CUDA was initialized by an import: stages cannot be forked", file=sys.stderr)
        return 3

    answers = sys.stdout.buffer
    for line in sys.stdin.buffer:
        answers.write(f"{_fork_stage(json.loads(line))}\n".encode())
        answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
