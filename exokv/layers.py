"""exokv's layers, lowest first: a module imports from its own layer and the layers below.

Each entry names a module and, for a subpackage, every module in it (the root `exokv`
is its `__init__` alone); the longest entry that covers a module places it (see
`layer_of`). `tests/test_layers.py` reads
this list and fails on an import that runs up it, and on a module no entry names: a new
package or top-level module is placed here first.

The wire sits below the rank: the rank dials the front end's channel and rings the
doorbell, the client listens and launches, and both read the launcher's marks.
"""

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "ground",
        (
            "exokv",  # the package itself: its version
            "exokv.layers",
            "exokv.errors",
            "exokv.config",
            "exokv.core",  # records, options, sizes, tables
            "exokv.prompt",  # what the model sees
            "exokv.hosts",  # the package's docstring
            "exokv.hosts.hostfile",
            "exokv.hosts.placement",  # pure: layers and budgets from gathered numbers
            "exokv.hosts.replicas",  # pure: which host keeps each rank's KV a second time
        ),
    ),
    ("below the cache", ("exokv.collectives", "exokv.state", "exokv.model", "exokv.hosts.probe")),
    ("cache", ("exokv.cache",)),
    # The channel and its messages, starting and minding ranks, asking hosts over ssh.
    (
        "wire",
        (
            "exokv.wire",
            "exokv.launch",
            "exokv.hosts.facts",
            "exokv.hosts.linktest",
            "exokv.hosts.kvfiles",  # KV files listed, sent and received on a host
            "exokv.hosts.weightfiles",  # a model's files lent to a host by another
        ),
    ),
    ("rank", ("exokv.rank", "exokv.hosts.link_main")),
    ("client", ("exokv.client", "exokv.hosts.fetch", "exokv.hosts.listing", "exokv.hosts.plan")),
    # Two front ends of the same client, and the start and the store they share.
    ("front ends", ("exokv.frontend", "exokv.chat", "exokv.serve", "exokv.bench")),
    ("cli", ("exokv.cli", "exokv.__main__")),
)


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the layer `module` (a dotted name) belongs to; None: no layer."""
    best: tuple[int, int] | None = None  # (length of the entry, layer)
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            covers = module == entry or ("." in entry and module.startswith(entry + "."))
            if covers and (best is None or len(entry) > best[0]):
                best = (len(entry), index)
    return None if best is None else best[1]
