"""The pictures show the memory state they are given: owner colours, fill levels, arrows."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.text import Annotation  # noqa: E402

from minipaged.core.memory import KVCacheManager  # noqa: E402
from minipaged.core.memory.simulate import MemoryReport  # noqa: E402
from minipaged.viz import (  # noqa: E402
    draw_block_pool,
    draw_block_tables,
    draw_memory_shares,
    draw_system_map,
    seq_colours,
)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def fills_at(ax, x, y):
    """The coloured (non-outline, non-free) rectangles drawn at block position (x, y)."""
    return [
        p
        for p in ax.patches
        if p.get_xy() == (x, y)
        and p.get_facecolor()[3] > 0
        and to_rgb(p.get_facecolor()) != to_rgb("#f4f4f4")
    ]


def test_pool_colours_fill_and_sharing():
    kv = KVCacheManager(8, 4, enable_prefix_caching=True)
    kv.allocate("A", list(range(5)))  # blocks 0 (full) and 1 (1 of 4 slots)
    kv.fork("A", "B")
    kv.allocate("C", [9, 9, 9, 9, 7])  # block 2 full (cached), block 3
    kv.free("C")  # block 2 stays cached, nobody holds it
    colours = seq_colours(["A", "B"])
    ax = draw_block_pool(kv, ncols=8, colours=colours)
    (full,) = fills_at(ax, 0, 0)
    (quarter,) = fills_at(ax, 1, 0)
    assert full.get_width() == pytest.approx(0.9)
    assert quarter.get_width() == pytest.approx(0.9 / 4)
    assert to_rgb(full.get_facecolor()) == pytest.approx(to_rgb(colours["A"]))
    assert full.get_hatch() == "///"  # shared by A and B
    (cached,) = fills_at(ax, 2, 0)
    assert to_rgb(cached.get_facecolor()) == pytest.approx(to_rgb("#bdbdbd"))
    assert fills_at(ax, 3, 0) == []  # freed and never cached: free
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


def test_block_tables_can_draw_the_first_blocks_of_a_large_pool():
    kv = KVCacheManager(64, 4)
    kv.allocate("A", [1] * 9)  # blocks 0, 1, 2
    ax = draw_block_tables(kv, num_physical=6)
    physical = {x for x in range(64) if any(r.get_y() == 0 for r in fills_at(ax, x, 0))}
    assert physical == {0, 1, 2}  # the held blocks are drawn, filled
    texts = [t.get_text() for t in ax.texts]
    assert "5" in texts and "6" not in texts and "… 58 more" in texts
    with pytest.raises(ValueError, match="num_physical"):
        draw_block_tables(kv, num_physical=2)  # block 2 is held but would not be drawn


def test_memory_shares_stack_to_the_reported_fractions():
    report = MemoryReport("x", 0.5, 0.2, 0.1, 0.05, max_batch=3.0, num_steps=10)
    ax = draw_memory_shares([report])
    heights = sorted(p.get_height() for p in ax.patches)
    assert heights == pytest.approx(sorted([50, 20, 10, 5]))


# -- the engine pictures: timelines, journeys, the system map ---------------------------

from matplotlib.patches import Rectangle  # noqa: E402

from minipaged.trace import Event  # noqa: E402
from minipaged.viz import (  # noqa: E402
    STATES,
    draw_batch_timeline,
    draw_request_journey,
    draw_step_tokens,
    request_blocks,
    timeline_from_trace,
)


def E(step, kind, request_id, seq_id=None, **detail):
    return Event(step, kind, request_id, seq_id, detail)


def S(step, seq_id, start, n):
    return E(step, "schedule", seq_id.split(".")[0], seq_id, start=start, num_tokens=n)


# A runs throughout; B is admitted at step 1, preempted (recompute) at 2, recomputed at 4.
RECOMPUTE_TRACE = [
    E(0, "arrive", "A", num_prompt_tokens=3),
    E(0, "arrive", "B", num_prompt_tokens=2),
    E(0, "allocate", "A", "A.0", num_tokens=3, num_cached_tokens=0, blocks=[0, 1]),
    S(0, "A.0", 0, 3),
    E(1, "allocate", "B", "B.0", num_tokens=2, num_cached_tokens=0, blocks=[2]),
    S(1, "A.0", 3, 1),
    S(1, "B.0", 0, 2),
    E(2, "preempt", "B", mode="recompute"),
    E(2, "free", "B", "B.0", blocks=[2]),
    S(2, "A.0", 4, 1),
    S(3, "A.0", 5, 1),
    E(4, "allocate", "B", "B.0", num_tokens=3, num_cached_tokens=0, blocks=[2, 3]),
    S(4, "A.0", 6, 1),
    S(4, "B.0", 0, 3),
    E(4, "free", "A", "A.0", blocks=[0, 1, 4, 5]),
    E(4, "finish", "A"),
    S(5, "B.0", 3, 1),
    E(5, "free", "B", "B.0", blocks=[2, 3]),
    E(5, "finish", "B"),
]
# C has n = 2: it forks after its prompt, copies its shared half-full block, is swapped
# out at step 2 and back in at step 4.
SWAP_TRACE = [
    E(0, "arrive", "C", num_prompt_tokens=3),
    E(0, "allocate", "C", "C.0", num_tokens=3, num_cached_tokens=0, blocks=[0, 1]),
    S(0, "C.0", 0, 3),
    E(0, "fork", "C", "C.1", parent="C.0", blocks=[0, 1]),
    E(1, "cow", "C", "C.0", src=1, dst=2),
    S(1, "C.0", 3, 1),
    S(1, "C.1", 3, 1),
    E(2, "preempt", "C", mode="swap"),
    E(2, "swap_out", "C", blocks={"C.0": [0, 1], "C.1": [0, 2]}),
    E(4, "swap_in", "C", blocks={"C.0": [5, 6], "C.1": [5, 7]}),
    S(5, "C.0", 4, 1),
    S(5, "C.1", 4, 1),
    E(5, "free", "C", "C.0", blocks=[5, 6, 8]),
    E(5, "free", "C", "C.1", blocks=[5, 7, 9]),
    E(5, "finish", "C"),
]


def test_timeline_from_trace_reads_each_step():
    timeline = timeline_from_trace(RECOMPUTE_TRACE + SWAP_TRACE)
    assert timeline["A"] == {
        0: ("prefill", 3),
        1: ("decode", 1),
        2: ("decode", 1),
        3: ("decode", 1),
        4: ("decode", 1),
    }
    assert timeline["B"] == {
        0: ("waiting", 0),
        1: ("prefill", 2),
        2: ("preempted", 0),
        3: ("waiting", 0),
        4: ("recompute", 3),
        5: ("decode", 1),
    }
    assert timeline["C"] == {
        0: ("prefill", 3),
        1: ("decode", 2),
        2: ("preempted", 0),
        3: ("swapped", 0),
        4: ("swap_in", 0),
        5: ("decode", 2),
    }


def test_timeline_marks_admitted_requests_the_budget_skipped_as_stalled():
    trace = [
        E(0, "arrive", "A", num_prompt_tokens=8),
        E(0, "allocate", "A", "A.0", num_tokens=4, num_cached_tokens=0, blocks=[0]),
        S(0, "A.0", 0, 4),
        E(1, "arrive", "B", num_prompt_tokens=2),
        S(2, "A.0", 4, 4),
    ]
    timeline = timeline_from_trace(trace)
    assert timeline["A"] == {0: ("prefill", 4), 1: ("stalled", 0), 2: ("prefill", 4)}
    assert timeline["B"] == {1: ("waiting", 0), 2: ("waiting", 0)}


def cell(ax, step, row, nrows):
    """The coloured rectangle of a timeline cell."""
    (rect,) = [p for p in ax.patches if p.get_xy() == pytest.approx((step, nrows - 1 - row + 0.05))]
    return rect


def test_batch_timeline_colours_cells_by_state():
    timeline = {
        "r0": {0: ("prefill", 12), 1: ("decode", 1), 2: ("idle", 0)},
        "r1": {0: ("waiting", 0), 1: ("preempted", 0), 2: ("swapped", 0)},
        "r2": {1: ("recompute", 5), 2: ("decode", 2)},
    }
    ax = draw_batch_timeline(timeline)
    for row, cells in enumerate(timeline.values()):
        for step, (state, _) in cells.items():
            rect = cell(ax, step, row, 3)
            assert to_rgb(rect.get_facecolor()) == pytest.approx(to_rgb(STATES[state][0]))
            assert (rect.get_hatch() is not None) == (state == "idle")
    assert len(ax.patches) == 8  # one rectangle per cell, no more
    labels = sorted(t.get_text() for t in ax.texts)
    assert labels == ["12", "2", "5"]  # prefills, and the decode of 2 seqs
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        STATES[s][2] for s in STATES if s != "stalled" and s != "swap_in"
    ]


def test_step_tokens_stack_by_request_with_the_budget_line():
    timeline = {
        "a": {0: ("prefill", 6), 1: ("decode", 1)},
        "b": {0: ("waiting", 0), 1: ("prefill", 7)},
    }
    ax = draw_step_tokens(timeline, max_num_batched_tokens=8)
    bars = {(p.get_x() + p.get_width() / 2, p.get_y()): p.get_height() for p in ax.patches}
    assert bars == pytest.approx({(0.5, 0): 6, (1.5, 0): 1, (1.5, 1): 7})
    (budget,) = [line for line in ax.lines if line.get_linestyle() == "--"]
    assert list(budget.get_ydata()) == [8, 8]


def test_request_blocks_replays_the_trace():
    assert request_blocks(RECOMPUTE_TRACE, "A", 2) == {
        0: (2, 0),
        1: (2, 0),
        2: (3, 0),
        3: (3, 0),
        4: (0, 0),
    }
    assert request_blocks(RECOMPUTE_TRACE, "B", 2) == {
        0: (0, 0),
        1: (1, 0),
        2: (0, 0),
        3: (0, 0),
        4: (2, 0),
        5: (0, 0),
    }
    # fork shares, the copy-on-write adds one, swaps move the distinct blocks only
    assert request_blocks(SWAP_TRACE, "C", 2) == {
        0: (2, 0),
        1: (3, 0),
        2: (0, 3),
        3: (0, 3),
        4: (3, 0),
        5: (0, 0),
    }
    # while the step ran: a sequence that ran and finished still held its blocks, one
    # preempted (B at step 2) had given them back before the forward pass
    assert request_blocks(RECOMPUTE_TRACE, "A", 2, during=True)[4] == (4, 0)
    assert request_blocks(RECOMPUTE_TRACE, "B", 2, during=True) == {
        0: (0, 0),
        1: (1, 0),
        2: (0, 0),
        3: (0, 0),
        4: (2, 0),
        5: (2, 0),
    }
    assert request_blocks(SWAP_TRACE, "C", 2, during=True)[5] == (
        5,
        0,
    )  # 3 blocks each, block 5 shared
    # append events that name the blocks (before or after the CoW event) agree
    with_appends = (
        SWAP_TRACE[:4] + [E(1, "append", "C", "C.0", num_tokens=1, blocks=[0, 2])] + SWAP_TRACE[4:]
    )
    assert request_blocks(with_appends, "C", 2) == request_blocks(SWAP_TRACE, "C", 2)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_request_blocks_matches_the_engine(tmp_path, mode):
    """Replayed from a real engine's trace, the block counts equal the KV cache
    manager's tables after every step, through forks, CoW, preemption and swaps."""
    from minipaged import LLM, SamplingParams
    from minipaged.models import make_tiny_model

    llm = LLM(
        make_tiny_model(tmp_path),
        block_size=4,
        num_gpu_blocks=14,
        trace=True,
        preemption_mode=mode,
        swap_space=0.0001,
    )
    engine = llm.engine
    for i, (prompt_len, n, max_tokens) in enumerate([(9, 1, 20), (7, 1, 16), (10, 2, 12)]):
        engine.add_request(
            str(i),
            list(range(1, prompt_len + 1)),
            SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, seed=i),
        )
    truth: dict[str, dict[int, tuple[int, int]]] = {str(i): {} for i in range(3)}
    while engine.has_unfinished_requests():
        step = engine.num_steps
        engine.step()
        for request_id, counts in truth.items():
            held = {"gpu": set(), "cpu": set()}
            for seq_id, table in engine.kv.tables.items():
                if seq_id.split(".")[0] == request_id:
                    held["cpu" if engine.kv.is_swapped(seq_id) else "gpu"].update(table.blocks)
            counts[step] = (len(held["gpu"]), len(held["cpu"]))
    assert engine.stats()["num_preemptions"] > 0
    kinds = {e.kind for e in engine.trace.events}
    assert {"fork", "cow", "preempt"} <= kinds
    for request_id, counts in truth.items():
        replayed = request_blocks(engine.trace, request_id, 4)
        assert replayed == {s: counts[s] for s in replayed}


def test_request_journey_puts_each_event_on_its_row():
    top, bottom = draw_request_journey(SWAP_TRACE, "C", 2)
    rows = [t.get_text() for t in top.get_yticklabels()]
    assert rows == [
        "finish",
        "free",
        "swap_in",
        "swap_out",
        "preempt",
        "cow",
        "fork",
        "decode",
        "prefill",
        "allocate",
        "arrive",
    ]
    markers = {(line.get_xdata()[0], rows[int(line.get_ydata()[0])]) for line in top.lines}
    assert (1.25, "cow") in markers and (0.25, "fork") in markers
    assert (4.25, "swap_in") in markers and (5.5, "decode") in markers  # C.1, beside C.0
    texts = [t.get_text() for t in top.texts]
    assert "1→2" in texts and "3 blk" in texts and "[0, 1]" in texts
    # step s spans [s, s + 1), as the markers do: C's blocks while each step ran
    gpu, cpu = bottom.lines
    assert list(gpu.get_xdata()) == [0, 1, 2, 3, 4, 5, 6]
    assert list(gpu.get_ydata()) == [2, 3, 0, 0, 3, 5, 0]
    assert list(cpu.get_ydata()) == [0, 0, 3, 3, 0, 0, 0]


def test_request_journey_skips_event_kinds_it_does_not_draw():
    extra = [E(0, "sample", "C", "C.0", token_id=5), E(6, "sample", "C", "C.1")]
    top, _ = draw_request_journey(SWAP_TRACE + extra, "C", 2)
    assert "sample" not in [t.get_text() for t in top.get_yticklabels()]


def test_request_journey_rejects_an_unknown_request():
    with pytest.raises(ValueError, match="'nope'"):
        draw_request_journey(SWAP_TRACE, "nope", 2)


def test_system_map_draws_every_part_and_the_notes():
    ax = draw_system_map({"Scheduler": "12 steps", "CacheEngine": "1 copy"})
    text = "\n".join(t.get_text() for t in ax.texts)
    for part in (
        "LLM",
        "LLMEngine",
        "Scheduler",
        "KVCacheManager",
        "CacheEngine",
        "ModelRunner",
        "sampler",
        "model",
        "ops",
    ):
        assert f"{{{part}}}" in text
    assert "12 steps" in text and "1 copy" in text
    boxes = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert len(boxes) == 9
    highlighted = [p for p in boxes if to_rgb(p.get_facecolor()) != to_rgb("#f7f7f7")]
    assert len(highlighted) == 2  # the parts with a note
    with pytest.raises(ValueError, match="Schedular"):
        draw_system_map({"Schedular": "typo"})


def test_system_map_text_stays_in_its_box():
    notes = {
        "CacheEngine": "1 copy-on-write copy, 12 blocks swapped out, 12 swapped back in",
        "KVCacheManager": "3 allocations, 1 fork, 4 frees",
    }
    ax = draw_system_map(notes)
    renderer = ax.figure.canvas.get_renderer()
    boxes = [p.get_window_extent(renderer) for p in ax.patches]
    texts = [t for t in ax.texts if t.get_text()]
    assert len(texts) == len(boxes) == 9
    for text in texts:
        extent = text.get_window_extent(renderer)
        assert any(
            box.x0 <= extent.x0
            and extent.x1 <= box.x1
            and box.y0 <= extent.y0
            and extent.y1 <= box.y1
            for box in boxes
        ), text.get_text()
