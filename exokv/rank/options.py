"""A rank's EngineOptions from the options it was started with: read in this one place.

Each rank of several (`exokv.rank.main`, from the word it was started with) and the
one rank in the front end's own process (`exokv.client.make_client`) build their
engine's options here, so the two cannot read a setting differently.
"""

from __future__ import annotations

from exokv.cache.tier_options import tier_options
from exokv.core.options import RankOptions
from exokv.rank.engine import EngineOptions


def engine_options(opts: RankOptions, rank: int, layout: str) -> EngineOptions:
    """The engine's options on rank `rank`; `layout` (parallelism, ranks, split) names the
    disk tier's directory with the model, so another layout does not read this one's KV."""
    cluster = opts.cluster
    return EngineOptions(
        budget=cluster.budgets[rank] if cluster.budgets else None,
        ranks_here=opts.ranks_here,  # a rank's default budget is a share of its machine's RAM
        memory_threshold=cluster.memory_threshold,
        max_kv_size=cluster.max_kv_size,
        # On several ranks the launch's drawn seed, the same everywhere: sampling agrees.
        seed=cluster.seed,
        chat_template=cluster.chat_template,
        stops=cluster.stops,
        context=cluster.context,
        kv=cluster.kv,
        replica_targets=opts.replica_targets,
        plan=(opts.plan_chat, opts.plan_generation) if opts.plan_chat else None,
        **tier_options(cluster, rank, layout, opts.ranks_here),
    )
