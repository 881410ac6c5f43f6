"""The one client interface: both clients implement all of it themselves."""

from __future__ import annotations

import inspect

import pytest

from exokv.client import Client, make_client
from exokv.client.cluster import ClusterClient
from exokv.client.local import LocalClient

MEMBERS = [n for n in vars(Client) if not n.startswith("_")] + ["ranks"]


def test_the_interface_names_what_front_ends_use() -> None:
    assert {"turn", "stop", "budgets", "save_cache", "cache_held", "close", "ranks"} <= set(MEMBERS)
    # Replies' exact tokens travel with the messages: no client remembers them.
    assert not {"reply_tokens", "remember_replies"} & set(MEMBERS)


@pytest.mark.parametrize("cls", [LocalClient, ClusterClient])
def test_each_client_implements_every_member(cls: type) -> None:
    assert Client in cls.__mro__  # declared, so a type checker holds it to the interface
    source = inspect.getsource(cls)
    for name in MEMBERS:
        if name == "ranks":
            assert "self.ranks =" in source, f"{cls.__name__} never sets ranks"
            continue
        assert name in vars(cls), f"{cls.__name__} inherits {name} from the Protocol's stub"
        ours, theirs = vars(cls)[name], vars(Client)[name]
        if callable(theirs):
            wanted = list(inspect.signature(theirs).parameters)
            # the interface's parameters first; a client may take more (with defaults)
            assert list(inspect.signature(ours).parameters)[: len(wanted)] == wanted, name


def test_one_local_rank_gets_the_engine_in_process() -> None:
    from exokv.core.options import parse_budgets
    from exokv.frontend.start import ChatOptions, validate

    client = make_client(validate(ChatOptions(model="builtin:tiny", seed=0, cache_budget="1MB")))
    try:
        assert isinstance(client, LocalClient)
        assert client.ranks == 1 and client.budgets == parse_budgets("1MB", 1)
    finally:
        client.close()
