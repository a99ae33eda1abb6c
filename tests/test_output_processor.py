"""The update phase: `Scheduler.update_from_output` applies what the samplers chose, and
the `OutputProcessor` turns the step's requests into outputs.

No model: a real scheduler over a small KV cache manager schedules the requests, the
tokens "sampled" are written by hand (`Sample`), and a tokenizer that spells token ``i``
as the ``i``-th letter makes every expected text plain to read.  The oracle is the rule
each check states (vLLM's stop conditions, beam search's ranking), worked out by hand.
"""

import pytest
import torch

from minipaged import BeamSearchParams, SamplingParams
from minipaged.core.memory import KVCacheManager
from minipaged.core.sched.output import Sample, StepSamples
from minipaged.core.sched.scheduler import Scheduler
from minipaged.engine.input_processor import InputProcessor
from minipaged.engine.output_processor import OutputProcessor
from minipaged.sample.beam_search import BeamSearch
from minipaged.sampling_params import RequestOutputKind

EOS, MAX_MODEL_LEN = 26, 64


class Letters:
    """Token ``i`` < 26 is the ``i``-th lowercase letter; EOS is special (no text)."""

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t) for t in token_ids if t != EOS)


class Step:
    """A scheduler, the input processor that feeds it and the output processor under test."""

    def __init__(self):
        self.kv = KVCacheManager(32, 4)
        self.scheduler = Scheduler(self.kv, 8, 64, max_model_len=MAX_MODEL_LEN)
        self.inputs = InputProcessor(
            Letters(), EOS + 1, MAX_MODEL_LEN, self.scheduler, torch.device("cpu")
        )
        self.outputs = OutputProcessor(BeamSearch({EOS}, Letters()))
        self.scheduler.eos_token_ids = {EOS}
        self.scheduler.check_stop_strings = self.outputs.check_stop_strings

    def add(self, request_id, params, prompt=(0, 1, 2)):
        group = self.inputs.process(request_id, list(prompt), params)
        self.scheduler.add(group)
        return group

    def run(self, samples):
        """Schedule a step (its tokens get their blocks), then update it with ``samples``,
        the tokens "sampled" for the sequences it ran."""
        return self.update(self.scheduler.schedule(), samples)

    def update(self, batch, samples):
        """The update phase: the scheduler applies ``samples``, the outputs follow."""
        return self.outputs.outputs(self.scheduler.update_from_output(batch, samples))


def test_a_prompt_with_n_forks_its_completions_each_with_its_token():
    step = Step()
    group = step.add("r", SamplingParams(n=3, logprobs=0))
    (prompt,) = group.seqs
    stream = torch.Generator().manual_seed(1)
    chosen = StepSamples(
        [
            Sample(group, prompt, 5, -0.5, {5: -0.5}),
            Sample(group, prompt, 6, -1.0, {6: -1.0}, fork=True, generator=stream),
            Sample(group, prompt, 7, -1.5, {7: -1.5}, fork=True),
        ]
    )
    assert step.run(chosen) == []  # nothing finished, nothing streams
    assert [s.index for s in group.seqs] == [0, 1, 2]
    assert [s.output_token_ids for s in group.seqs] == [[5], [6], [7]]
    assert [s.cumulative_logprob for s in group.seqs] == [-0.5, -1.0, -1.5]
    assert [s.logprobs for s in group.seqs] == [[{5: -0.5}], [{6: -1.0}], [{7: -1.5}]]
    assert group.seqs[1].generator is stream and group.seqs[2].generator is None
    # The forks share every block of the prompt, copy-on-write (§4.4).
    tables = {step.kv.block_table(s.seq_id)[0] for s in group.seqs}
    assert len(tables) == 1 and step.kv.gpu.ref_count(tables.pop()) == 3


@pytest.mark.parametrize(
    "params, tokens, finish_reason, stop_reason, text",
    [
        (SamplingParams(), [3, EOS], "stop", None, "d"),  # EOS ends it, not in the text
        (SamplingParams(stop_token_ids=[4]), [3, 4], "stop", 4, "d"),
        (SamplingParams(stop=["de"]), [2, 3, 4], "stop", "de", "c"),  # cut where it begins
        (SamplingParams(max_tokens=2), [3, 4], "length", None, "de"),
        (SamplingParams(ignore_eos=True, max_tokens=2), [EOS, 4], "length", None, "e"),
    ],
)
def test_stop_conditions_finish_free_and_retire(params, tokens, finish_reason, stop_reason, text):
    step = Step()
    group = step.add("r", params)
    outputs = []
    for token in tokens:
        assert not outputs, "finished early"
        seq = group.seqs[0]
        outputs = step.run(StepSamples([Sample(group, seq, token, -1.0)]))
    (output,) = outputs
    assert output.finished and output.request_id == "r"
    (completion,) = output.outputs
    assert completion.token_ids == tokens
    assert (completion.finish_reason, completion.stop_reason) == (finish_reason, stop_reason)
    assert completion.text == text
    assert not step.kv.has_block_table("r.0")  # its blocks are back
    assert "r" not in step.scheduler.requests and not step.scheduler.running


def test_a_stream_reports_only_what_is_new():
    step = Step()
    group = step.add("r", SamplingParams(output_kind=RequestOutputKind.DELTA, max_tokens=3))
    texts = []
    for token in (7, 4, 11):
        (output,) = step.run(StepSamples([Sample(group, group.seqs[0], token, -1.0)]))
        texts.append((output.outputs[0].text, output.outputs[0].token_ids, output.finished))
    assert texts == [("h", [7], False), ("e", [4], False), ("l", [11], True)]


def test_beams_fork_drop_finish_and_rank():
    """Width 2, two steps.  Step 1: the prompt's beam keeps 5 and 6 (forking for 6) and
    sets aside its EOS extension.  Step 2: beam 6 is dropped, beam 5 keeps 7 and 8; at
    max_tokens the live beams join the finished one, and the best two by cumulative
    logprob over length (a final EOS not counted) are the output."""
    step = Step()
    group = step.add("b", BeamSearchParams(beam_width=2, max_tokens=2))
    (root,) = group.seqs
    step.run(
        StepSamples(
            tokens=[Sample(group, root, 5, -0.2), Sample(group, root, 6, -0.3, fork=True)],
            finished_beams=[Sample(group, root, EOS, -0.1)],
        )
    )
    five, six = group.seqs
    assert (five.output_token_ids, six.output_token_ids) == ([5], [6])
    assert group.completed_beams == [([0, 1, 2, EOS], -0.1)]
    (output,) = step.run(
        StepSamples(
            tokens=[Sample(group, five, 7, -0.1), Sample(group, five, 8, -0.6, fork=True)],
            dropped_beams=[(group, six)],
        )
    )
    assert six not in group.seqs and not step.kv.tables  # every beam's blocks are back
    # Scores: EOS beam -0.1 / 3 tokens; [5, 7] -0.3 / 5; [5, 8] -0.8 / 5.
    assert [s.tokens for s in output.sequences] == [[0, 1, 2, EOS], [0, 1, 2, 5, 7]]
    assert [s.text for s in output.sequences] == ["", "fh"]
    assert [s.cum_logprob for s in output.sequences] == pytest.approx([-0.1, -0.3])
    assert "b" not in step.scheduler.requests


def test_a_request_aborted_since_the_schedule_is_left_out():
    """What a request that failed alone looks like to the update: aborted, no samples."""
    step = Step()
    stream = SamplingParams(output_kind=RequestOutputKind.CUMULATIVE)
    kept, failed = step.add("kept", stream), step.add("failed", stream)
    batch = step.scheduler.schedule()
    step.scheduler.abort("failed")
    chosen = StepSamples([Sample(kept, kept.seqs[0], 3, -1.0)])
    outputs = step.update(batch, chosen)
    assert [o.request_id for o in outputs] == ["kept"]
    assert not step.kv.has_block_table(failed.seqs[0].seq_id)
