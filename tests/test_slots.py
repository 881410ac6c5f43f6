"""A batch's vacant slots (exokv.rank.slots): when they are compacted, and a newcomer
written into one is the row an extend would have appended."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from exokv.rank import slots


def own_cache(n: int, seed: int) -> KVCache:
    cache = KVCache()
    key = mx.random.key(seed)
    cache.update_and_fetch(
        mx.random.normal((1, 2, n, 8), key=key), mx.random.normal((1, 2, n, 8), key=key + 1)
    )
    return cache


def test_a_vacancy_waits_its_patience_and_idle_padding_is_trimmed() -> None:
    patience = slots.PATIENCE_STEPS
    assert not slots.compact_now({}, 100, 8, 600, 600)  # nothing vacant, no idle padding
    assert not slots.compact_now({3: 10}, 10 + patience - 1, 8, 600, 600)
    assert slots.compact_now({3: 10}, 10 + patience, 8, 600, 600)
    assert not slots.compact_now({3: 10}, 10 + patience, 64, 600, 600)  # 64 rows wait 16 steps
    assert slots.compact_now({3: 10, 5: 30}, 26, 64, 600, 600)  # the oldest decides
    assert slots.compact_now({}, 5, 8, 600, 600 - slots.IDLE_PADDING - 151)
    assert not slots.compact_now({}, 5, 8, 600, 600 - slots.IDLE_PADDING)  # within the bound
    assert not slots.compact_now({}, 5, 8, 400, 320)  # 80 idle: above 64, not a quarter
    assert slots.keep({1: 0, 3: 0}, 5).tolist() == [0, 2, 4]


def test_a_row_placed_in_a_slot_reads_as_the_row_an_extend_appends() -> None:
    rows = [own_cache(n, seed) for seed, n in enumerate((9, 5, 7))]
    newcomer = own_cache(6, 10)
    assert not slots.fits([BatchKVCache.merge([own_cache(5, 11)])], [newcomer])  # longer
    placed = BatchKVCache.merge(rows)
    assert slots.fits([placed], [newcomer])
    slots.place([placed], 1, [newcomer])  # row 1 ended: the newcomer takes its slot
    appended = BatchKVCache.merge([rows[0], rows[2]])
    appended.extend(BatchKVCache.merge([newcomer]))
    for mine, theirs in ((0, 0), (2, 1), (1, 2)):
        pad = placed.left_padding.tolist()[mine]
        assert pad == appended.left_padding.tolist()[theirs]
        assert placed.offset.tolist()[mine] == appended.offset.tolist()[theirs]
        assert mx.array_equal(
            placed.keys[mine, :, pad : placed._idx], appended.keys[theirs, :, pad : appended._idx]
        )
        assert mx.array_equal(
            placed.values[mine, :, pad:], appended.values[theirs, :, pad : appended._idx]
        )
