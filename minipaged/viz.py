"""Pictures of the memory layer and the engine for the lessons (matplotlib).

The memory layer:

* `draw_block_pool()` - the physical blocks of a pool, coloured by the sequence that
  holds them, filled as far as they hold tokens; shared blocks are hatched and show
  their reference count, prefix-cached blocks that nobody holds are grey.
* `draw_block_tables()` - each sequence's logical blocks with an arrow to the
  physical block that holds it (the paper's Fig. 6 and 7).
* `draw_memory_shares()` - stacked bars of where KV memory goes (the paper's Fig. 2).
* `slot_kinds()` and `draw_slots()` - one sequence's slots: tokens, a draft's guesses
  in lookahead slots, and the slots a rollback released (speculative decoding).

The engine at work, from its event trace (`minipaged.trace`):

* `timeline_from_trace()` and `draw_batch_timeline()` - what every request did at every
  step: prefill, decode, waiting, preempted, swapped (continuous batching, lesson 05);
* `draw_step_tokens()` - the tokens each step ran, against the token budget;
* `request_blocks()` and `draw_request_journey()` - one request's events and the blocks
  it held, step by step (lessons 06 and 09);
* `draw_system_map()` - the engine's parts and who calls whom (lesson 09).
"""

from __future__ import annotations

import textwrap

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from .core.memory import KVCacheManager, PrefixCachingBlockAllocator
from .core.memory.simulate import MemoryReport

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
        ax.add_patch(
            Rectangle(
                (x, y), w * fraction, h, facecolor=colour, edgecolor="none", hatch=hatch, alpha=0.85
            )
        )
    ax.add_patch(Rectangle((x, y), w, h, facecolor="none", edgecolor=_EDGE, lw=0.8))
    ax.text(
        x + w / 2,
        y + h / 2,
        label,
        ha="center",
        va="center",
        fontsize=7,
        bbox=dict(boxstyle="round,pad=0.1", facecolor="white", edgecolor="none", alpha=0.7),
    )


def draw_block_pool(
    kv: KVCacheManager,
    device: str = "gpu",
    ax=None,
    ncols: int = 16,
    title: str | None = None,
    colours: dict | None = None,
):
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
            _block(
                ax,
                x,
                y,
                colours[owners[0]],
                fill.get(block, 0) / kv.block_size,
                label,
                hatch="///" if shared else None,
            )
        elif isinstance(pool, PrefixCachingBlockAllocator) and pool.is_cached(block):
            _block(ax, x, y, _CACHED, 1.0, str(block))
        else:
            _block(ax, x, y, _FREE, 0.0, str(block))
    live = [s for s in colours if s in kv.tables]
    handles = [Rectangle((0, 0), 1, 1, color=colours[s]) for s in live]
    if handles:
        ax.legend(
            handles, live, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False
        )
    ax.set_xlim(-0.1, ncols)
    ax.set_ylim(-0.1, nrows)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title or f"{device.upper()} pool: {pool.num_free_blocks}/{pool.num_blocks} free")
    return ax


def draw_block_tables(
    kv: KVCacheManager,
    seq_ids: list[str] | None = None,
    ax=None,
    title: str | None = None,
    colours: dict | None = None,
    num_physical: int | None = None,
):
    """Logical blocks of each sequence (rows) -> physical blocks of the GPU pool (bottom row).

    ``num_physical`` draws only the pool's first blocks, so that a large pool stays
    readable; a note says how many more there are, and every block a drawn table points
    at must be among them.
    """
    seq_ids = list(kv.tables) if seq_ids is None else seq_ids
    colours = _colours(kv, colours)
    holders = _holders(kv, "gpu")
    fill, n_phys = _fill(kv), kv.gpu.num_blocks if num_physical is None else num_physical
    pointed = max((b for s in seq_ids for b in kv.tables[s].blocks), default=-1)
    if not pointed < n_phys <= kv.gpu.num_blocks:
        raise ValueError(
            f"num_physical must cover block {pointed} and not exceed the pool's "
            f"{kv.gpu.num_blocks} blocks, got {num_physical!r}"
        )
    width = max([n_phys] + [len(kv.tables[s].blocks) for s in seq_ids])
    height = 2 * len(seq_ids) + 2
    if ax is None:
        _, ax = plt.subplots(figsize=(max(6, width * 0.55), height * 0.5))
    if n_phys < kv.gpu.num_blocks:
        more = kv.gpu.num_blocks - n_phys
        ax.text(n_phys + 0.1, 0.45, f"… {more} more", va="center", fontsize=8)
    for block in range(n_phys):
        owners = holders.get(block, [])
        colour = colours[owners[0]] if owners else _FREE
        _block(
            ax,
            block,
            0,
            colour,
            fill.get(block, 0) / kv.block_size,
            str(block),
            hatch="///" if len(owners) > 1 else None,
        )
    ax.text(-0.3, 0.45, "physical", ha="right", va="center", fontsize=8)
    for row, seq_id in enumerate(seq_ids):
        y = 2 * (len(seq_ids) - row) + 0.5
        table = kv.tables[seq_id]
        ax.text(-0.3, y + 0.45, seq_id, ha="right", va="center", fontsize=8)
        for logical, block in enumerate(table.blocks):
            used = min(kv.block_size, table.num_tokens - logical * kv.block_size) / kv.block_size
            _block(ax, logical, y, colours[seq_id], used, str(logical))
            ax.annotate(
                "",
                xy=(block + 0.45, 0.9),
                xytext=(logical + 0.45, y),
                arrowprops=dict(arrowstyle="->", color=colours[seq_id], lw=0.8, alpha=0.7),
            )
    ax.set_xlim(-1.5, width + (2.5 if n_phys < kv.gpu.num_blocks else 0.5))
    ax.set_ylim(-0.3, height + 0.2)
    ax.axis("off")
    ax.set_title(title or "block tables: logical block -> physical block")
    return ax


SLOT_KINDS = {
    "token": ("#4c72b0", "a token's KV"),
    "guess": ("#f2a541", "a guess's KV (lookahead slot)"),
    "released": ("#e8e8e8", "released (a rejected guess)"),
    "empty": ("#ffffff", "empty"),
}


def slot_kinds(block_size: int, num_blocks: int, num_tokens: int, num_guesses: int = 0,
               num_released: int = 0) -> list[list[str]]:  # fmt: skip
    """What each slot of a sequence's blocks holds, block by block: its real tokens,
    then its guesses, then slots just released by a rollback, then empty ones."""
    kinds = ["token"] * num_tokens + ["guess"] * num_guesses + ["released"] * num_released
    kinds += ["empty"] * (num_blocks * block_size - len(kinds))
    return [kinds[b * block_size : (b + 1) * block_size] for b in range(num_blocks)]


def draw_slots(blocks: list[int], kinds: list[list[str]], ax=None, title: str | None = None):
    """One sequence's block table slot by slot (`slot_kinds`): physical block ids
    above, a square per slot coloured by what it holds (speculative decoding, lesson 13)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(max(4, len(kinds) * len(kinds[0]) * 0.3), 1.3))
    x = 0.0
    for block, slots in zip(blocks, kinds):
        ax.text(x + len(slots) * 0.5 / 2, 0.75, f"block {block}", ha="center", fontsize=8)
        for kind in slots:
            colour, _ = SLOT_KINDS[kind]
            ax.add_patch(Rectangle((x, 0), 0.45, 0.6, facecolor=colour, edgecolor=_EDGE, lw=0.6))
            x += 0.5
        x += 0.3
    handles = [
        Rectangle((0, 0), 1, 1, facecolor=c, edgecolor=_EDGE) for c, _ in SLOT_KINDS.values()
    ]
    ax.legend(handles, [label for _, label in SLOT_KINDS.values()], fontsize=7, ncol=4,
              loc="upper center", bbox_to_anchor=(0.5, -0.05), frameon=False)  # fmt: skip
    ax.set_xlim(-0.2, x)
    ax.set_ylim(-0.1, 1.0)
    ax.axis("off")
    ax.set_title(title or "one sequence's slots")
    return ax


_SHARES = [
    ("token_share", "token states", "#4c9a2a"),
    ("reserved_share", "reservation", "#f2c14e"),
    ("internal_share", "internal fragmentation", "#e07a5f"),
    ("external_share", "external fragmentation", "#8d5a97"),
]


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
        ax.text(
            i,
            100 * r.token_share / 2,
            f"{100 * r.token_share:.1f}%",
            ha="center",
            va="center",
            color="white",
            fontsize=9,
            fontweight="bold",
        )
    ax.set_ylabel("% of KV cache memory")
    ax.set_ylim(0, 100)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or "where the KV cache goes (cf. paper Fig. 2)")
    return ax


# -- the engine at work: batches over steps, one request's journey ----------------------
#
# These pictures read the event trace (`minipaged.trace`, ``LLM(..., trace=True)``) or
# the same kind of data written by hand (lesson 05's static-batching baseline).  A
# *timeline* is ``{request_id: {step: (state, num_tokens)}}``: what each request did at
# each engine step, with the tokens it ran there (0 when it ran none).

STATES = {  # timeline state -> (colour, hatch, what it means)
    "waiting": ("#e6e6e6", None, "waiting (no blocks)"),
    "prefill": ("#4c72b0", None, "prefill (tokens run)"),
    "recompute": ("#dd8452", None, "recompute prefill"),
    "decode": ("#55a868", None, "decode"),
    "stalled": ("#f2c14e", None, "running, not scheduled"),
    "preempted": ("#c44e52", None, "preempted"),
    "swapped": ("#8172b3", None, "swapped out (CPU)"),
    "swap_in": ("#c5b8e8", None, "swapped back in"),
    "idle": ("#ffffff", "xxx", "idle slot (batch not done)"),
}


def timeline_from_trace(trace) -> dict[str, dict[int, tuple[str, int]]]:
    """What every request did at every step, from a `Trace` (or its list of events).

    A request appears from its arrival to the step it finished (or was aborted).  In a
    step it ran, its state is ``"prefill"`` (a prompt or a chunk of one; ``"recompute"``
    when it is re-running tokens after a recompute preemption) or ``"decode"``, and
    ``num_tokens`` sums its sequences' tokens; otherwise it is ``"waiting"``,
    ``"stalled"`` (admitted, but the step's token budget did not reach it),
    ``"preempted"``, ``"swapped"`` or ``"swap_in"``.
    """
    events = getattr(trace, "events", trace)
    by_step: dict[int, list] = {}
    for e in events:
        by_step.setdefault(e.step, []).append(e)
    timeline: dict[str, dict[int, tuple[str, int]]] = {}
    status: dict[str, str] = {}  # request -> waiting | running | swapped, while alive
    prompt_len: dict[str, int] = {}
    recomputing: set[str] = set()
    for step in range(min(by_step, default=0), max(by_step, default=-1) + 1):
        ran: dict[str, int] = {}  # request -> tokens run this step
        did: dict[str, str] = {}  # request -> what it did this step, if anything
        ended = set()
        for e in by_step.get(step, []):
            r = e.request_id
            if e.kind == "arrive":
                status[r], prompt_len[r] = "waiting", e.detail["num_prompt_tokens"]
            elif e.kind in ("allocate", "swap_in"):
                status[r] = "running"
                if e.kind == "swap_in":
                    did[r] = "swap_in"
            elif e.kind == "schedule":
                n, start = e.detail["num_tokens"], e.detail["start"]
                ran[r] = ran.get(r, 0) + n
                if n > 1 or start < prompt_len.get(r, 0):
                    did[r] = "recompute" if r in recomputing else "prefill"
                elif did.get(r) not in ("prefill", "recompute"):
                    did[r] = "decode"
                    recomputing.discard(r)
            elif e.kind == "preempt":
                did[r] = "preempted"
                status[r] = "swapped" if e.detail.get("mode") == "swap" else "waiting"
                if status[r] == "waiting":
                    recomputing.add(r)
            elif e.kind in ("finish", "abort"):
                ended.add(r)
        for r, state in status.items():
            if r in did:
                state = did[r]
            elif state == "running":
                state = "stalled"
            timeline.setdefault(r, {})[step] = (state, ran.get(r, 0))
        for r in ended:
            status.pop(r, None)
    return timeline


def draw_batch_timeline(
    timeline: dict[str, dict[int, tuple[str, int]]],
    ax=None,
    title: str | None = None,
    label_tokens: bool = True,
):
    """One row per request, one column per engine step, coloured by `STATES`.

    Prefill cells are labelled with the tokens they ran, and decode cells too when a
    request decoded more than one sequence (``n`` > 1); ``label_tokens=False`` drops
    the labels.  Returns the Axes.
    """
    rows = list(timeline)
    steps = [s for cells in timeline.values() for s in cells]
    first, last = (min(steps), max(steps)) if steps else (0, 0)
    if ax is None:
        _, ax = plt.subplots(
            figsize=(min(16, 2 + 0.28 * (last - first + 1)), 0.8 + 0.32 * len(rows))
        )
    used = set()
    for row, r in enumerate(rows):
        y = len(rows) - 1 - row
        for step, (state, n) in timeline[r].items():
            colour, hatch, _ = STATES[state]
            used.add(state)
            ax.add_patch(
                Rectangle(
                    (step, y + 0.05),
                    1,
                    0.9,
                    facecolor=colour,
                    hatch=hatch,
                    edgecolor="white" if hatch is None else "#999999",
                    lw=0.5,
                )
            )
            if label_tokens and (
                state in ("prefill", "recompute") or (state == "decode" and n > 1)
            ):
                ax.text(
                    step + 0.5,
                    y + 0.5,
                    str(n),
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white" if state != "decode" else "black",
                )
    ax.set_yticks([len(rows) - 1 - i + 0.5 for i in range(len(rows))], rows, fontsize=8)
    ax.set_xlim(first, last + 1)
    ax.set_ylim(0, max(1, len(rows)))
    ax.set_xlabel("engine step")
    ax.set_ylabel("request")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    order = [s for s in STATES if s in used]
    ax.legend(
        [
            Rectangle((0, 0), 1, 1, facecolor=STATES[s][0], hatch=STATES[s][1], edgecolor="#999999")
            for s in order
        ],
        [STATES[s][2] for s in order],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        frameon=False,
    )
    ax.set_title(title or "what each request did, step by step")
    return ax


def draw_step_tokens(
    timeline: dict[str, dict[int, tuple[str, int]]],
    ax=None,
    max_num_batched_tokens: int | None = None,
    title: str | None = None,
    colours: dict | None = None,
):
    """Stacked bars: the tokens each request ran in each step (one colour per request),
    with the step's token budget as a dashed line when it is given.  Returns the Axes."""
    colours = colours or seq_colours(timeline)
    steps = sorted({s for cells in timeline.values() for s in cells})
    if ax is None:
        _, ax = plt.subplots(figsize=(min(16, 2 + 0.28 * len(steps)), 2.6))
    bottom = dict.fromkeys(steps, 0)
    for r, cells in timeline.items():
        xs = [s for s in steps if cells.get(s, ("", 0))[1] > 0]
        heights = [cells[s][1] for s in xs]
        if xs:
            ax.bar(
                [s + 0.5 for s in xs],
                heights,
                width=0.9,
                bottom=[bottom[s] for s in xs],
                color=colours[r],
                label=r,
            )
            for s, h in zip(xs, heights):
                bottom[s] += h
    if max_num_batched_tokens is not None:
        ax.axhline(
            max_num_batched_tokens, color="black", ls="--", lw=1, label="max_num_batched_tokens"
        )
    if steps:
        ax.set_xlim(steps[0], steps[-1] + 1)
    ax.set_xlabel("engine step")
    ax.set_ylabel("tokens in the step")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title(title or "tokens per step, by request")
    return ax


def request_blocks(
    trace, request_id: str, block_size: int, during: bool = False
) -> dict[int, tuple[int, int]]:
    """Blocks one request holds after each step it is alive: ``{step: (gpu, cpu)}``;
    with ``during``, while the step's forward pass ran instead (a sequence that ran and
    finished in a step frees its blocks after the pass; one preempted frees them before).

    Replayed from the trace: allocate, fork, swap and free events name the physical
    blocks; a copy-on-write swaps one block for another; prefill chunks and decodes
    that cross a block boundary (the trace has no event for them) add a block each
    (hence ``block_size``; an ``append`` event with ``blocks`` is used as it is).  A
    block shared by the request's sequences counts once.
    """
    tables: dict[str, tuple[str, list]] = {}  # seq -> (pool, blocks; new ones as tuples)
    result: dict[int, tuple[int, int]] = {}
    alive = False
    ran: set[str] = set()  # sequences scheduled in this step
    freed_after_pass: list[str] = []  # ... and freed in it (kept for a `during` count)
    events = [e for e in getattr(trace, "events", trace) if e.request_id == request_id]
    for i, e in enumerate(events):
        d = e.detail
        if e.kind == "arrive":
            alive = True
        elif e.kind in ("allocate", "append") and "blocks" in d:
            tables[e.seq_id] = ("gpu", list(d["blocks"]))
        elif e.kind == "schedule":
            ran.add(e.seq_id)
            _, blocks = tables.setdefault(e.seq_id, ("gpu", []))
            need = -(-(d["start"] + d["num_tokens"]) // block_size)
            blocks += [(e.seq_id, j) for j in range(len(blocks), need)]
        elif e.kind == "fork":
            # The parent's table is the child's at this moment: name its new blocks too.
            tables[d["parent"]] = ("gpu", list(d["blocks"]))
            tables[e.seq_id] = ("gpu", list(d["blocks"]))
        elif e.kind == "cow":
            blocks = tables[e.seq_id][1]
            if d["src"] in blocks:  # (an append event may have named the copy already)
                blocks[blocks.index(d["src"])] = d["dst"]
        elif e.kind in ("swap_out", "swap_in"):
            for seq_id, blocks in d["blocks"].items():
                tables[seq_id] = ("cpu" if e.kind == "swap_out" else "gpu", list(blocks))
        elif e.kind == "free":
            if during and e.seq_id in ran:
                freed_after_pass.append(e.seq_id)
            else:
                tables.pop(e.seq_id, None)
        elif e.kind in ("finish", "abort"):
            alive = False
        if i + 1 == len(events) or events[i + 1].step != e.step:  # the step is over
            held = {pool: set() for pool in ("gpu", "cpu")}
            for pool, blocks in tables.values():
                held[pool].update(blocks)
            if alive or e.kind in ("finish", "abort"):
                result[e.step] = (len(held["gpu"]), len(held["cpu"]))
            for seq_id in freed_after_pass:
                tables.pop(seq_id, None)
            ran.clear()
            freed_after_pass.clear()
    for step in range(min(result, default=0), max(result, default=-1) + 1):
        if step not in result:  # a step without events changed nothing
            result[step] = result[step - 1]
    return dict(sorted(result.items()))


_JOURNEY_ROWS = (
    "arrive",
    "allocate",
    "prefill",
    "decode",
    "fork",
    "cow",
    "preempt",
    "swap_out",
    "swap_in",
    "free",
    "finish",
    "abort",
)


def _journey_label(e) -> str:
    d = e.detail
    if e.kind == "arrive":
        return f"{d['num_prompt_tokens']} tok"
    if e.kind in ("allocate", "free", "fork"):
        blocks = d["blocks"]
        return str(blocks) if len(blocks) <= 6 else f"[{blocks[0]}, {blocks[1]}, … {blocks[-1]}]"
    if e.kind == "cow":
        return f"{d['src']}→{d['dst']}"
    if e.kind == "preempt":
        return d.get("mode", "")
    if e.kind in ("swap_out", "swap_in"):
        return f"{len({b for t in d['blocks'].values() for b in t})} blk"
    return ""


def draw_request_journey(
    trace,
    request_id: str,
    block_size: int,
    axes=None,
    title: str | None = None,
    colours: dict | None = None,
):
    """One request's life from the event trace, left to right.

    Top: one row per kind of event (arrive, allocate, prefill, decode, fork, CoW,
    preempt, swap out/in, free, finish), a marker at each step it happened, coloured by
    sequence (request-wide events in black), labelled with the blocks or tokens
    involved.  Bottom: the blocks the request holds on the GPU and the CPU after each
    step (`request_blocks`).  Returns the two Axes.
    """
    events = [e for e in getattr(trace, "events", trace) if e.request_id == request_id]
    if not events:
        raise ValueError(f"request_id {request_id!r} has no events in the trace")
    arrive = next((e for e in events if e.kind == "arrive"), None)
    prompt_len = arrive.detail["num_prompt_tokens"] if arrive else 0
    seq_ids = list(dict.fromkeys(e.seq_id for e in events if e.seq_id is not None))
    colours = {**seq_colours(seq_ids), **(colours or {})}
    rows: list[tuple[str, object]] = []  # (row name, event)
    for e in events:
        name = e.kind
        if e.kind == "schedule":
            prefill = e.detail["num_tokens"] > 1 or e.detail["start"] < prompt_len
            name = "prefill" if prefill else "decode"
        if name in _JOURNEY_ROWS:
            rows.append((name, e))
    present = [r for r in _JOURNEY_ROWS if any(name == r for name, _ in rows)]
    if axes is None:
        steps = max(e.step for e in events) - min(e.step for e in events) + 1
        _, axes = plt.subplots(
            2,
            1,
            figsize=(min(16, 3 + 0.4 * steps), 1.2 + 0.35 * len(present) + 1.6),
            sharex=True,
            gridspec_kw={"height_ratios": [len(present), 3]},
        )
    top, bottom = axes
    stacked: dict[tuple[str, int], int] = {}
    for name, e in rows:
        y = len(present) - 1 - present.index(name)
        colour = colours.get(e.seq_id, "black")
        k = stacked.get((name, e.step), 0)
        stacked[(name, e.step)] = k + 1
        offset = 0.25 * (k % 3)  # several sequences in one step: side by side
        top.plot(e.step + 0.25 + offset, y, "o", color=colour, ms=5)
        label = str(e.detail["num_tokens"]) if name == "prefill" else _journey_label(e)
        if label and name != "decode":
            top.text(
                e.step + 0.25 + offset,
                y + 0.15 + 0.25 * k,
                label,
                fontsize=6,
                color=colour,
                va="bottom",
            )
    top.set_yticks(range(len(present)), list(reversed(present)), fontsize=8)
    top.set_ylim(-0.6, len(present) - 0.2)
    top.grid(axis="x", color="#eeeeee")
    top.legend(
        [plt.Line2D([], [], marker="o", ls="", color=colours[s]) for s in seq_ids],
        seq_ids,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        frameon=False,
        title="sequence",
        title_fontsize=8,
    )
    top.set_title(title or f"the journey of request {request_id}")
    # Step s is the span [s, s + 1) in every panel: the blocks held while it ran.
    held = request_blocks(events, request_id, block_size, during=True)
    xs = [*held, max(held, default=-1) + 1]
    for i, (pool, colour) in enumerate((("gpu", "#4c72b0"), ("cpu", "#8172b3"))):
        ys = [counts[i] for counts in held.values()] + [0]
        if any(ys) or pool == "gpu":
            bottom.step(
                xs, ys, where="post", color=colour, lw=1.5, label=f"{pool.upper()} blocks held"
            )
    bottom.set_ylabel("blocks")
    bottom.set_xlabel("engine step")
    bottom.set_ylim(bottom=0)
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))  # blocks come whole
    bottom.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return top, bottom


# name -> (x, y, module, what it does); the layers of docs/architecture.md, top down
_SYSTEM = {
    "LLM": (1.5, 4, "llm.py", "tokenize, queue, step until done"),
    "LLMEngine": (1.5, 3, "engine.py", "schedule → execute → sample → update"),
    "Scheduler": (0, 2, "scheduler.py", "which tokens run; preempt"),
    "CacheEngine": (1, 2, "cache_engine.py", "swap / copy blocks"),
    "ModelRunner": (2, 2, "model_runner.py", "one forward pass"),
    "sampler": (3, 2, "sampler.py", "logits → next token"),
    "KVCacheManager": (0, 1, "memory/", "block tables, CoW, swap"),
    "model": (2, 1, "models/", "Llama layers"),
    "ops": (2, 0, "ops/", "PagedAttention kernels"),
}
_BOX_CHARS = 36  # characters of 7.5-point text that fit across a box of the system map
_CALLS = [
    ("LLM", "LLMEngine"),
    ("LLMEngine", "Scheduler"),
    ("LLMEngine", "CacheEngine"),
    ("LLMEngine", "ModelRunner"),
    ("LLMEngine", "sampler"),
    ("Scheduler", "KVCacheManager"),
    ("ModelRunner", "model"),
    ("model", "ops"),
]


def draw_system_map(notes: dict[str, str] | None = None, ax=None, title: str | None = None):
    """The engine's parts as boxes (name, module, job), arrows from caller to callee.

    ``notes`` adds a line to a box by name (one of ``LLM``, ``LLMEngine``, ``Scheduler``,
    ``CacheEngine``, ``ModelRunner``, ``sampler``, ``KVCacheManager``, ``model``,
    ``ops``): what that part did in a run, say.  Returns the Axes.
    """
    notes = notes or {}
    unknown = sorted(set(notes) - set(_SYSTEM))
    if unknown:
        raise ValueError(f"notes names unknown parts {unknown}; known: {list(_SYSTEM)}")
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 6.5))
    w, h = 0.9, 0.7
    for name, (x, y, module, job) in _SYSTEM.items():
        ax.add_patch(
            Rectangle(
                (x * 1.2, y),
                w * 1.2,
                h,
                facecolor="#eef3fa" if name in notes else "#f7f7f7",
                edgecolor=_EDGE,
                lw=1,
            )
        )
        # Job and note are wrapped to the box's width: a note can be longer than a line.
        said = [job] + ([notes[name]] if name in notes else [])
        lines = [f"$\\bf{{{name}}}$  ({module})"] + [textwrap.fill(t, _BOX_CHARS) for t in said]
        ax.text(
            x * 1.2 + 0.6 * w, y + h / 2, "\n".join(lines), ha="center", va="center", fontsize=7.5
        )
    for src, dst in _CALLS:
        (x0, y0, *_), (x1, y1, *_) = _SYSTEM[src], _SYSTEM[dst]
        start = (x0 * 1.2 + 0.6 * w, y0)
        end = (x1 * 1.2 + 0.6 * w, y1 + h)
        ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="->", color=_EDGE, lw=1))
    # The scheduler's block operations reach the cache engine as data, through the engine.
    y = _SYSTEM["Scheduler"][1] + h / 2
    ax.annotate(
        "",
        xy=(1.2, y),
        xytext=(w * 1.2, y),
        arrowprops=dict(arrowstyle="->", color=_EDGE, lw=1, ls="--"),
    )
    ax.set_xlim(-0.1, 4.8)
    ax.set_ylim(-0.2, 4.9)
    ax.axis("off")
    ax.set_title(title or "minipaged: who calls whom in one step")
    return ax
