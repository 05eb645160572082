"""`pdserve sim`: a discrete-event simulation of a P/D cluster (see docs/simulator.md).

Entry points: `pdserve.sim.run.run_sim(SimConfig)` for one run, `pdserve.sim.sweep.run_sweep`
for a grid, `pdserve.sim.validation.evaluate` for a validation set, and the command in
`pdserve.sim.cli` (its flags made configs by `pdserve.sim.sim_args`).
"""
