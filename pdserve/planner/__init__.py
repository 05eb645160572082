"""The planner: how many prefill and decode instances to run, from measured latency."""
