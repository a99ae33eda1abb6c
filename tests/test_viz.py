"""The pictures show the memory state they are given: owner colours, fill levels, arrows."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.text import Annotation  # noqa: E402

from minipaged.memory import KVCacheManager  # noqa: E402
from minipaged.memory.simulate import MemoryReport  # noqa: E402
from minipaged.viz import (draw_block_pool, draw_block_tables, draw_memory_shares,  # noqa: E402
                           seq_colours)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def fills_at(ax, x, y):
    """The coloured (non-outline, non-free) rectangles drawn at block position (x, y)."""
    return [p for p in ax.patches if p.get_xy() == (x, y) and p.get_facecolor()[3] > 0
            and to_rgb(p.get_facecolor()) != to_rgb("#f4f4f4")]


def test_pool_colours_fill_and_sharing():
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    kv.allocate("A", list(range(5)))          # blocks 0 (full) and 1 (1 of 4 slots)
    kv.fork("A", "B")
    kv.allocate("C", [9, 9, 9, 9, 7])         # block 2 full (cached), block 3
    kv.free("C")                              # block 2 stays cached, nobody holds it
    colours = seq_colours(["A", "B"])
    ax = draw_block_pool(kv, ncols=8, colours=colours)
    (full,) = fills_at(ax, 0, 0)
    (quarter,) = fills_at(ax, 1, 0)
    assert full.get_width() == pytest.approx(0.9)
    assert quarter.get_width() == pytest.approx(0.9 / 4)
    assert to_rgb(full.get_facecolor()) == pytest.approx(to_rgb(colours["A"]))
    assert full.get_hatch() == "///"          # shared by A and B
    (cached,) = fills_at(ax, 2, 0)
    assert to_rgb(cached.get_facecolor()) == pytest.approx(to_rgb("#bdbdbd"))
    assert fills_at(ax, 3, 0) == []           # freed and never cached: free
    labels = [t.get_text() for t in ax.texts]
    assert "0\n×2" in labels and "1\n×2" in labels


def test_block_table_arrows_point_at_physical_blocks():
    kv = KVCacheManager(12, 2)
    kv.allocate("filler", [0] * 6)
    kv.allocate("A", [1] * 3)
    kv.free("filler")
    kv.allocate("B", [2] * 5)
    ax = draw_block_tables(kv)
    arrows = [a for a in ax.get_children() if isinstance(a, Annotation)]
    expected = sorted(b + 0.45 for s in ("A", "B") for b in kv.block_table(s))
    assert sorted(a.xy[0] for a in arrows) == pytest.approx(expected)


def test_memory_shares_stack_to_the_reported_fractions():
    report = MemoryReport("x", 0.5, 0.2, 0.1, 0.05, max_batch=3.0, num_steps=10)
    ax = draw_memory_shares([report])
    heights = sorted(p.get_height() for p in ax.patches)
    assert heights == pytest.approx(sorted([50, 20, 10, 5]))
