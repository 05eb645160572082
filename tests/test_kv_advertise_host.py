"""`--kv-advertise-host`: the address peers are told for the side channel and transport.

A wildcard `--kv-host` without it is refused at start-up (peers cannot dial 0.0.0.0);
with it, /kv/info, pull params, `reply_to` and the transport card carry it. Listeners here
bind 127.0.0.1 (test rule) and advertise `localhost`, a different spelling peers can dial,
so a working transfer shows the advertised address is the one used.
"""

from __future__ import annotations

import argparse
import uuid

import msgspec
import pytest
import torch

from pdserve.config import ModelConfig, TransportConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.types import SamplingParams
from pdserve.model.loader import LoadedModel, load_model
from pdserve.server.serve import advertised
from pdserve.server.serve_args import add_arguments, pd_configs_from_args
from pdserve.transfer.connector import ConnectorConfig
from pdserve.transfer.factory import build_factory
from pdserve.transfer.transport.base import PeerCard
from pdserve.transfer.transport.handshake import advertised_host
from pdserve.transfer.transport.tcp import TcpTransport
from tests.pd_harness import Pair, engine_config
from tests.procs import free_port

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--role", "prefill", *argv])


def connector_config(args: argparse.Namespace) -> ConnectorConfig:
    pd = advertised(pd_configs_from_args(args))
    assert pd is not None
    return pd[0]


def transport_config(args: argparse.Namespace) -> TransportConfig:
    pd = advertised(pd_configs_from_args(args))
    assert pd is not None
    return pd[1]


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", ""])
def test_wildcard_kv_host_without_advertise_host_is_refused(wildcard: str) -> None:
    args = _args("--kv-host", wildcard)
    for build in (connector_config, transport_config):
        with pytest.raises(ValueError, match="--kv-advertise-host"):
            build(args)
    with pytest.raises(ValueError, match="--kv-advertise-host"):  # before binding anything
        TcpTransport(TransportConfig(host=wildcard), "e")


def test_advertise_host_reaches_both_configs() -> None:
    args = _args("--kv-host", "0.0.0.0", "--kv-advertise-host", "10.1.2.3")
    assert connector_config(args).side_advertise_host == "10.1.2.3"
    assert transport_config(args).advertise_host == "10.1.2.3"
    assert connector_config(args).side_host == transport_config(args).host == "0.0.0.0"


def test_kv_port_fixes_the_transport_listener() -> None:
    assert transport_config(_args()).port == 0  # default: a free port
    port = free_port()
    transport = TcpTransport(transport_config(_args("--kv-port", str(port))), "e")
    try:
        card = msgspec.msgpack.decode(transport.local_metadata(), type=PeerCard)
        assert (card.host, card.port) == ("127.0.0.1", port)
    finally:
        transport.close()


def test_without_the_flag_the_kv_host_is_advertised() -> None:
    args = _args("--kv-host", "10.0.0.7")
    assert connector_config(args).side_advertise_host == "10.0.0.7"
    assert transport_config(args).advertise_host == "10.0.0.7"
    assert advertised_host("10.0.0.7") == "10.0.0.7"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    torch.set_num_threads(1)
    return load_model(ModelConfig(cache_dir=tmp_path_factory.mktemp("models")))


def _engine(loaded: LoadedModel, role: str, mode: str) -> LLMEngine:
    ccfg = ConnectorConfig(
        role=role,
        mode=mode,
        engine_id=f"{role}-{uuid.uuid4().hex[:6]}",
        side_host="127.0.0.1",
        side_advertise_host="localhost",
    )
    tcfg = TransportConfig(host="127.0.0.1", advertise_host="localhost", timeout_s=5.0)
    return LLMEngine(loaded, engine_config(64), build_factory(ccfg, tcfg))


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_peers_are_told_and_use_the_advertised_host(loaded: LoadedModel, mode: str) -> None:
    pair = Pair(_engine(loaded, "prefill", mode), _engine(loaded, "decode", mode), mode)
    try:
        for eng in (pair.p, pair.d):
            connector = eng.connector
            assert connector is not None
            assert connector.side.address[0] == "localhost"
            card = msgspec.msgpack.decode(connector.transport.local_metadata(), type=PeerCard)
            assert card.host == "localhost"
        out = pair.generate("r", list(range(5, 40)), GREEDY)
        assert out.finished and len(pair.tokens("r")) == GREEDY.max_tokens
        if mode == "pull":
            assert pair.finished("r-p").kv_transfer_params.remote_host == "localhost"
        pair.settle()
    finally:
        pair.close()
