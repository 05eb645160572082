"""Server-level A/B of two code trees on push 1P1D: the workloads of thread_pin_ab.py.

One `pdserve up` per tree and round (trees alternate ABBA over rounds), every D thread on
core 1, router and bench clients on core 0 (as thread_pin_ab's `same`). Each tree is a
directory holding a `pdserve/` package; the cluster runs with that directory as its working
directory, so `python -m pdserve` imports that tree.

usage: flock /work/notes/bench.lock .venv/bin/python scripts/bench/perf/tree_ab.py OUT \
           BEFORE_DIR AFTER_DIR [--rounds 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import thread_pin_ab as tp  # the workloads, the window and the thread helpers

inflight = tp.inflight


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    a.out = a.out.resolve()  # the clusters run in the trees' directories
    a.out.mkdir(parents=True, exist_ok=True)
    print(f"start {time.strftime('%F %T')} load {Path('/proc/loadavg').read_text().strip()}")
    rows = []
    for r in range(a.rounds):
        order = ("before", "after") if r % 2 == 0 else ("after", "before")
        for name in order:
            tree = getattr(a, name).resolve()
            c = inflight.start_cluster("push", a.out, True, cwd=tree, tag=f"{name}-{r}")
            try:
                for wl in tp.WORKLOADS:
                    warm = tp.with_prompts(tp.WORKLOADS[wl], 4)
                    inflight.bench(c.url, warm, None, a.out / f"warm-{wl}.log", core0=True).wait()
                eng = tp.engine_thread(c.pids["decode"])
                for wl in tp.WORKLOADS:
                    row = tp.window(c, eng, "same", wl, a.out)
                    rows.append({"round": r, "tree": name, **row})
            finally:
                tp.stop(c)
    tp.finish(a.out, rows)


if __name__ == "__main__":
    main()
