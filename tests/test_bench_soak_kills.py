"""`pdserve bench soak --kill-every`: the kill plan, the report's kill lines, the flags, and
one short real soak killing two random processes of a supervised cluster."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import numpy as np
import pytest

from pdserve.bench import soak, soak_args
from pdserve.bench.soak_kills import (
    KILL_ROLES,
    RESTARTS_MARGIN,
    choose_victim,
    plan_kills,
    soak_restart_policy,
)
from pdserve.bench.soak_report import (
    KillInfo,
    SoakResult,
    exit_status,
    format_summary,
    not_healed,
)
from pdserve.bench.soak_traffic import TrafficConfig
from tests.test_bench_soak import _result


def test_kills_are_planned_every_period_before_the_end() -> None:
    assert plan_kills(15, 40) == [15, 30]
    assert plan_kills(20, 40) == [20]  # not at the very end
    assert plan_kills(60, 600) == [60.0 * k for k in range(1, 10)]
    assert plan_kills(50, 40) == []
    # the planned kills alone cannot use up a budget, even all on one process
    assert soak_restart_policy(60, 600).max_restarts == 9 + RESTARTS_MARGIN


def test_victims_are_drawn_from_the_chosen_roles_and_repeat_with_the_seed() -> None:
    names = {"prefill": ["prefill-0", "prefill-1"], "decode": ["decode-0"], "router": ["router"]}

    def draws(seed: int, roles=KILL_ROLES) -> list[tuple[str, str]]:
        rng = np.random.default_rng(seed)
        return [choose_victim(roles, names, rng) for _ in range(60)]

    first = draws(1)
    assert first == draws(1) and first != draws(2)
    assert {role for role, _ in first} == set(KILL_ROLES)
    assert {name for _, name in first} == {"prefill-0", "prefill-1", "decode-0", "router"}
    assert all(name.startswith(role) for role, name in first)
    assert {role for role, _ in draws(1, ("decode",))} == {"decode"}


def _kills() -> list[KillInfo]:
    return [
        KillInfo(
            instance="decode-0",
            role="decode",
            killed_s=15.0,
            back_s=18.5,
            old_pid=11,
            new_pid=21,
            old_incarnation="a",
            new_incarnation="b",
        ),
        KillInfo(
            instance="router", role="router", killed_s=30.0, back_s=31.0, old_pid=12, new_pid=22
        ),
    ]


def test_the_report_adds_kills_and_restarts_and_fails_when_one_is_not_back() -> None:
    healed = msgspec.structs.replace(
        _result(),
        kill_every_s=15.0,
        kill_roles=list(KILL_ROLES),
        kills=_kills(),
        restarts={"prefill-0": 0, "decode-0": 1, "router": 1},
    )
    assert exit_status(healed) == 0 and not_healed(healed) == []
    text = format_summary(healed)
    assert "kills every 15 s (prefill, decode, router): 2 killed, 0 skipped" in text
    assert "2 back; longest outage 3.5 s" in text
    assert "restarts: 2 (prefill-0 0, decode-0 1, router 1); given up: none" in text
    assert "decode-0   killed at 15.0 s (pid 11), back at 18.5 s (pid 21)" in text
    late = KillInfo(instance="decode-0", role="decode", killed_s=30.0, old_pid=21)
    skipped = KillInfo(instance="router", role="router", killed_s=31.0, skipped=True)
    broken = msgspec.structs.replace(healed, kills=[*_kills(), late, skipped])
    assert exit_status(broken) == 1 and not_healed(broken) == ["decode-0"]
    assert "NOT BACK" in format_summary(broken) and "not back: decode-0" in format_summary(broken)
    assert exit_status(msgspec.structs.replace(healed, given_up=["router"])) == 1
    decoded = msgspec.json.decode(msgspec.json.encode(broken), type=SoakResult)
    assert decoded.kills == broken.kills and decoded.restarts == broken.restarts


def test_a_result_saved_before_the_kill_mode_still_reads() -> None:
    raw = msgspec.json.decode(msgspec.json.encode(_result()))
    for key in ("kill_every_s", "kill_roles", "kills", "restarts", "given_up"):
        del raw[key]
    old = msgspec.json.decode(msgspec.json.encode(raw), type=SoakResult)
    assert old.kills == [] and old.kill_every_s is None and exit_status(old) == 0
    assert "kills every" not in format_summary(old)


def test_kill_flags_map_to_the_config() -> None:
    parser = argparse.ArgumentParser()
    soak.add_arguments(parser)
    cfg = soak_args.config_from_args(parser.parse_args(["--kill-every", "60", "--seed", "3"]))
    assert (cfg.kill_every_s, cfg.kill_roles, cfg.restart_at) == (60.0, KILL_ROLES, None)
    args = ["--kill-every", "15", "--kill-roles", "decode,router"]
    assert soak_args.config_from_args(parser.parse_args(args)).kill_roles == ("decode", "router")
    assert soak_args.config_from_args(parser.parse_args([])).kill_every_s is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--kill-every", "15", "--kill-roles", "decode,oracle"])
    with pytest.raises(ValueError):
        soak.SoakConfig(kill_every_s=10, restart_at=0.5)
    with pytest.raises(ValueError):
        soak.SoakConfig(kill_every_s=0, restart_at=None)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_short_soak_with_two_random_kills(tmp_path: Path) -> None:
    cfg = soak.SoakConfig(
        mode="pull",
        model="builtin:tiny",
        duration_s=40.0,
        request_rate=3.0,
        traffic=TrafficConfig(input_len=(32, 512), output_len=(4, 48), abort_fraction=0.2),
        restart_at=None,
        kill_every_s=15.0,
        oracle_sample=0.3,
        request_timeout_s=60.0,
        drain_timeout_s=90.0,
        out_dir=tmp_path,
        progress=False,
        instance_args=("--kv-lease", "5"),
        seed=1,
    )
    result, path = soak.run_soak(cfg)
    summary = format_summary(result)
    saved = msgspec.json.decode(path.read_bytes(), type=SoakResult)
    assert saved.kills == result.kills and saved.restarts == result.restarts, summary
    assert [k.killed_s for k in result.kills] == pytest.approx([15.0, 30.0], abs=2.0), summary
    killed = [k for k in result.kills if not k.skipped]
    assert killed and all(k.back_s is not None and k.new_pid != k.old_pid for k in killed)
    for k in killed:
        if k.role != "router":
            assert k.new_incarnation is not None and k.new_incarnation != k.old_incarnation
    assert sum(result.restarts.values()) == len(killed), summary
    assert result.given_up == [] and result.restart is None, summary
    assert result.blocks_leaked == 0, summary
    assert result.completed > 0 and result.oracle_checked > 0, summary
    assert result.mismatches == [] and result.oracle_failed == 0, summary
    assert exit_status(result) == 0, summary
