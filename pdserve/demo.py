"""`make demo`: pull vs push on this machine in a few minutes, with a table and plots.

A small `pdserve bench sweep` on the built-in `builtin:small` model: 1 prefill + 1 decode
instance pinned to their own cores behind the router, one cluster with pull and one with
push KV transfer (`--monolithic` adds the single-instance floor), at 2 input lengths x 2
request rates. Both clusters stay up and the modes take turns at each point, so that other
jobs on the machine weigh on both alike. The grid goes from a lightly loaded prefill
instance (1024 tokens at 0.5 req/s) to a saturated one (4096 tokens at 2 req/s); the
table's "P util" column says how loaded each point is. Results, `sweep.md` and the plots
go to `results/demo/`.

The numbers are one run on a small shared machine: compare push with pull at the same
point (the ratio table), not with other runs. `pdserve bench sweep --help` runs bigger
grids; docs/results.md has the current full sweep.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.sweep import SweepConfig, sweep_and_report
from pdserve.options import add_options, from_args, option

DEMO_DIR = Path("results/demo")


def demo_config(out_dir: Path = DEMO_DIR, monolithic: bool = False) -> SweepConfig:
    """The demo's grid: about 2 minutes per mode on 2 cores, plus ~30 s of set-up."""
    return SweepConfig(
        out_dir=out_dir,
        input_lens=(1024, 4096),
        rates=(0.5, 2.0),
        modes=("pull", "push", "monolithic") if monolithic else ("pull", "push"),
        output_len=32,
        num_prompts=16,
        model="builtin:small",
        seed=0,
        interleave=True,  # both clusters up, modes alternating: fairer on a shared machine
        disable_tqdm=not sys.stderr.isatty(),  # the bars would clutter a log
    )


@dataclass(frozen=True)
class DemoOptions:
    """What the demo's command line may change (`demo_config` makes the rest)."""

    out_dir: Path = option(DEMO_DIR, help="")
    monolithic: bool = option(False, help="add the monolithic floor")


def main(argv: list[str] | None = None) -> int:
    """Run the demo sweep; 0 when every point ran (failed requests show in the table)."""
    parser = argparse.ArgumentParser(prog="python -m pdserve.demo", description=__doc__)
    add_options(parser, DemoOptions)
    argv = sys.argv[1:] if argv is None else argv
    opts = from_args(DemoOptions, parser.parse_args(argv))
    cfg = demo_config(opts.out_dir, opts.monolithic)
    print(
        f"pdserve demo: {' vs '.join(cfg.modes)} on {cfg.model}, input lengths "
        f"{list(cfg.input_lens)}, rates {list(cfg.rates)} req/s, {cfg.num_prompts} prompts "
        f"per point; results in {cfg.out_dir}/"
    )
    command = shlex.join(["python", "-m", "pdserve.demo", *argv])
    manifest, files = sweep_and_report(cfg, command, print)
    if manifest.interrupted:
        return 130
    print(f"\ntable: {files.markdown}")
    # Failed requests are results (the table shows them); a point that could not run is not.
    return 0 if all(p.error is None for p in manifest.points) else 1


if __name__ == "__main__":
    sys.exit(main())
