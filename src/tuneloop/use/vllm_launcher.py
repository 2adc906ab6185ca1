"""vLLM's OpenAI server, started without its worker's one-second busy-wait after every message.

`tuneloop vllm-serve` runs this file with vLLM's own interpreter (tuneloop never imports vLLM: their transformers
pins differ). vLLM's multiprocess executor, which its CPU platform always uses, has each worker spin on its shared
memory queue (sched_yield, SpinCondition) for a second after every message before it sleeps on a socket: after each
generation and each weight reload, a core taken from the training's next step (measured on the embedded SmolLM2 on
2 cores: training 7.38 s a step beside the server against 6.09 s with transformers' generate). A reader here goes
to its socket at once, which costs a message microseconds. Where vLLM has no such class the server starts as it is.
"""

import runpy
import sys


def _readers_sleep_when_idle() -> None:
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:  # (imported without vLLM: nothing to change)
        return
    condition = getattr(shm_broadcast, "SpinCondition", None)
    if condition is None or getattr(condition, "_tuneloop_sleeps", False):
        return
    original = condition.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "is_reader", False):
            self.busy_loop_s = 0

    condition.__init__ = init
    condition._tuneloop_sleeps = True


# at the top level: a worker started by spawn imports this file again as its main module, and is changed too
_readers_sleep_when_idle()

if __name__ == "__main__":
    # this file stays the process's main module (alter_sys=False), so a process started by spawn runs it first
    sys.argv[0] = "vllm.entrypoints.openai.api_server"
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=False)
