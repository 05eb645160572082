"""What a simulated run is: profiles, mode, instance counts and TP sizes (`ClusterConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pdserve.sim.profiles import HardwareProfile, ModelProfile, SoftwareProfile

Mode = Literal["monolithic", "pull", "push"]
MODES: tuple[Mode, ...] = ("monolithic", "pull", "push")


@dataclass(frozen=True)
class ClusterConfig:
    """What is simulated: profiles, mode, instance counts and TP sizes.

    `warm`: the P-D handshakes happened before the measured run (bench's warm-up requests
    pay them), so no measured request does. For `mode="monolithic"` the cluster has
    `num_prefill + num_decode` monolithic instances of TP `tp_prefill` (the same devices);
    `monolithic_router=False`: the client talks to the monolithic instance directly (one
    HTTP hop each way, as with `pdserve up --monolithic`, which starts no router).
    """

    model: ModelProfile
    hardware: HardwareProfile
    software: SoftwareProfile
    mode: Mode = "push"
    num_prefill: int = 1
    num_decode: int = 1
    tp_prefill: int = 1
    tp_decode: int = 1
    warm: bool = True
    monolithic_router: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.num_prefill < 0 or self.num_decode < 0:
            raise ValueError("instance counts must be >= 0")
        if self.mode != "monolithic" and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError("pull and push need at least one prefill and one decode instance")
        if self.mode == "monolithic" and self.num_prefill + self.num_decode < 1:
            raise ValueError("monolithic needs at least one instance")
