"""Pictures of the memory layer for the lessons (matplotlib).

* `draw_block_pool()` - the physical blocks of a pool, coloured by the sequence that
  holds them, filled as far as they hold tokens; shared blocks are hatched and show
  their reference count, prefix-cached blocks that nobody holds are grey.
* `draw_block_tables()` - each sequence's logical blocks with an arrow to the
  physical block that holds it (the paper's Fig. 6 and 7).
* `draw_memory_shares()` - stacked bars of where KV memory goes (the paper's Fig. 2).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from .memory import KVCacheManager, PrefixCachingBlockAllocator
from .memory.simulate import MemoryReport

_FREE, _CACHED, _EDGE = "#f4f4f4", "#bdbdbd", "#555555"


def seq_colours(seq_ids) -> dict[str, tuple]:
    """One colour per sequence id; pass it as ``colours=`` to keep colours across pictures."""
    cmap = plt.get_cmap("tab10")
    return {s: cmap(i % 10) for i, s in enumerate(seq_ids)}


def _colours(kv: KVCacheManager, colours: dict | None) -> dict[str, tuple]:
    if colours is None:
        return seq_colours(kv.tables)
    missing = [s for s in kv.tables if s not in colours]
    return {**colours, **seq_colours(missing)} if missing else colours


def _holders(kv: KVCacheManager, device: str) -> dict[int, list[str]]:
    """Physical block -> the sequences whose tables point at it."""
    holders: dict[int, list[str]] = {}
    for seq_id, table in kv.tables.items():
        if table.allocator.device == device:
            for block in dict.fromkeys(table.blocks):
                holders.setdefault(block, []).append(seq_id)
    return holders


def _fill(kv: KVCacheManager) -> dict[int, int]:
    """Physical block -> how many of its slots hold tokens (the most any holder wrote)."""
    fill: dict[int, int] = {}
    for table in kv.tables.values():
        for i, block in enumerate(table.blocks):
            used = min(kv.block_size, table.num_tokens - i * kv.block_size)
            fill[block] = max(fill.get(block, 0), used)
    return fill


def _block(ax, x, y, colour, fraction, label, hatch=None, w=0.9, h=0.9):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=_FREE, edgecolor=_EDGE, lw=0.8))
    if fraction > 0:
        ax.add_patch(Rectangle((x, y), w * fraction, h, facecolor=colour, edgecolor="none",
                               hatch=hatch, alpha=0.85))
    ax.add_patch(Rectangle((x, y), w, h, facecolor="none", edgecolor=_EDGE, lw=0.8))
    ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=7,
            bbox=dict(boxstyle="round,pad=0.1", facecolor="white", edgecolor="none", alpha=0.7))


def draw_block_pool(kv: KVCacheManager, device: str = "gpu", ax=None, ncols: int = 16,
                    title: str | None = None, colours: dict | None = None):
    """Draw one pool's physical blocks; returns the matplotlib Axes."""
    pool = kv.gpu if device == "gpu" else kv.cpu
    holders, fill = _holders(kv, device), _fill(kv)
    colours = _colours(kv, colours)
    nrows = max(1, -(-pool.num_blocks // ncols))
    if ax is None:
        _, ax = plt.subplots(figsize=(ncols * 0.55, nrows * 0.55 + 0.8))
    for block in range(pool.num_blocks):
        x, y = block % ncols, nrows - 1 - block // ncols
        owners = holders.get(block, [])
        if owners:
            shared = len(owners) > 1
            label = f"{block}\n×{len(owners)}" if shared else str(block)
            _block(ax, x, y, colours[owners[0]], fill.get(block, 0) / kv.block_size, label,
                   hatch="///" if shared else None)
        elif isinstance(pool, PrefixCachingBlockAllocator) and pool.is_cached(block):
            _block(ax, x, y, _CACHED, 1.0, str(block))
        else:
            _block(ax, x, y, _FREE, 0.0, str(block))
    live = [s for s in colours if s in kv.tables]
    handles = [Rectangle((0, 0), 1, 1, color=colours[s]) for s in live]
    if handles:
        ax.legend(handles, live, loc="upper left", bbox_to_anchor=(1.0, 1.0),
                  fontsize=8, frameon=False)
    ax.set_xlim(-0.1, ncols)
    ax.set_ylim(-0.1, nrows)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title or f"{device.upper()} pool: {pool.num_free_blocks}/{pool.num_blocks} free")
    return ax


def draw_block_tables(kv: KVCacheManager, seq_ids: list[str] | None = None, ax=None,
                      title: str | None = None, colours: dict | None = None):
    """Logical blocks of each sequence (rows) -> physical blocks of the GPU pool (bottom row)."""
    seq_ids = list(kv.tables) if seq_ids is None else seq_ids
    colours = _colours(kv, colours)
    fill, n_phys = _fill(kv), kv.gpu.num_blocks
    width = max([n_phys] + [len(kv.tables[s].blocks) for s in seq_ids])
    height = 2 * len(seq_ids) + 2
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6, width * 0.55), height * 0.5))
    holders = _holders(kv, "gpu")
    for block in range(n_phys):
        owners = holders.get(block, [])
        colour = colours[owners[0]] if owners else _FREE
        _block(ax, block, 0, colour, fill.get(block, 0) / kv.block_size, str(block),
               hatch="///" if len(owners) > 1 else None)
    ax.text(-0.3, 0.45, "physical", ha="right", va="center", fontsize=8)
    for row, seq_id in enumerate(seq_ids):
        y = 2 * (len(seq_ids) - row) + 0.5
        table = kv.tables[seq_id]
        ax.text(-0.3, y + 0.45, seq_id, ha="right", va="center", fontsize=8)
        for logical, block in enumerate(table.blocks):
            used = min(kv.block_size, table.num_tokens - logical * kv.block_size) / kv.block_size
            _block(ax, logical, y, colours[seq_id], used, str(logical))
            ax.annotate("", xy=(block + 0.45, 0.9), xytext=(logical + 0.45, y),
                        arrowprops=dict(arrowstyle="->", color=colours[seq_id], lw=0.8,
                                        alpha=0.7))
    ax.set_xlim(-1.5, width + 0.5)
    ax.set_ylim(-0.3, height + 0.2)
    ax.axis("off")
    ax.set_title(title or "block tables: logical block -> physical block")
    return ax


_SHARES = [("token_share", "token states", "#4c9a2a"),
           ("reserved_share", "reservation", "#f2c14e"),
           ("internal_share", "internal fragmentation", "#e07a5f"),
           ("external_share", "external fragmentation", "#8d5a97")]


def draw_memory_shares(reports: list[MemoryReport], ax=None, title: str | None = None):
    """Stacked bars: the share of the KV pool in each state, one bar per system."""
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.8))
    names = [r.system for r in reports]
    bottom = [0.0] * len(reports)
    for key, label, colour in _SHARES:
        values = [100 * getattr(r, key) for r in reports]
        ax.bar(names, values, bottom=bottom, label=label, color=colour)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, r in enumerate(reports):
        ax.text(i, 100 * r.token_share / 2, f"{100 * r.token_share:.1f}%", ha="center",
                va="center", color="white", fontsize=9, fontweight="bold")
    ax.set_ylabel("% of KV cache memory")
    ax.set_ylim(0, 100)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or "where the KV cache goes (cf. paper Fig. 2)")
    return ax
