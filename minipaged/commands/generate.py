"""``minipaged generate PROMPT...``: complete prompts with ``LLM.generate`` (the
`SamplingParams` fields as flags) or ``LLM.beam_search`` (``--beam-width``), then print
the completions and a memory report."""

from __future__ import annotations

from minipaged.arg_utils import (
    DEFAULT_MODEL,
    add_engine_flags,
    add_fields,
    add_model_flag,
    engine_kwargs,
    field_kwargs,
)
from minipaged.sampling_params import BeamSearchParams, SamplingParams

NAME = "generate"
HELP = "complete prompts (SmolLM2-135M-Instruct unless --model)"
DESCRIPTION = (
    "Complete each PROMPT with the engine (LLM.generate, or LLM.beam_search "
    "with --beam-width), print the completions and a memory report."
)
SAMPLING_FIELDS = (
    "max_tokens",
    "min_tokens",
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "ignore_eos",
    "logprobs",
)


def add_arguments(parser) -> None:
    parser.add_argument("prompt", nargs="+", metavar="PROMPT")
    add_model_flag(parser, "%(default)s", default=DEFAULT_MODEL)
    add_engine_flags(parser)
    group = parser.add_argument_group("sampling flags", "SamplingParams(...) fields")
    # The request's seed gets its own name: --seed is the engine's, as in vLLM.
    parser.set_defaults(
        sampling_dests=add_fields(
            group, SamplingParams, SAMPLING_FIELDS, flags={"seed": "sampling-seed"}
        )
    )
    group.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="a string that ends a completion (repeatable)",
    )
    group.add_argument(
        "--stop-token-ids",
        nargs="+",
        type=int,
        metavar="ID",
        help="token ids that end a completion",
    )
    beam = parser.add_argument_group(
        "beam search", "BeamSearchParams(...): with --beam-width, LLM.beam_search replaces sampling"
    )
    beam.add_argument(
        "--beam-width", type=int, metavar="N", help="keep the N best partial sequences (paper §4.4)"
    )
    beam.add_argument(
        "--length-penalty",
        type=float,
        default=1.0,
        metavar="X",
        help="score = cum_logprob / len ** X (default: %(default)s)",
    )


def _sampling_params(args) -> SamplingParams:
    return SamplingParams(
        **field_kwargs(args, args.sampling_dests),
        stop=args.stop,
        stop_token_ids=args.stop_token_ids,
    )


def _beam_search_params(args) -> BeamSearchParams:
    """Beam search ranks candidates instead of sampling them: a sampling flag beside
    --beam-width would be silently ignored, so it is an error."""
    defaults = SamplingParams()
    ignored = [
        f"--{args.sampling_dests[name].replace('_', '-')}"
        for name in SAMPLING_FIELDS
        if name not in ("max_tokens", "ignore_eos")
        and getattr(args, args.sampling_dests[name]) != getattr(defaults, name)
    ]
    ignored += [
        flag
        for flag, value in (("--stop", args.stop), ("--stop-token-ids", args.stop_token_ids))
        if value
    ]
    if ignored:
        raise ValueError(
            f"beam_width={args.beam_width} cannot be combined with "
            f"{', '.join(ignored)}: beam search does not sample"
        )
    return BeamSearchParams(
        beam_width=args.beam_width,
        max_tokens=args.max_tokens,
        length_penalty=args.length_penalty,
        ignore_eos=args.ignore_eos,
    )


def main(args) -> None:
    from minipaged.demo import PeakUsage, memory_report
    from minipaged.llm import LLM

    # Every flag is checked before the model loads.
    beam = args.beam_width is not None
    params = _beam_search_params(args) if beam else _sampling_params(args)
    llm = LLM(args.model, **engine_kwargs(args))
    with PeakUsage.watch(llm.engine) as peak:
        if beam:
            outputs = llm.beam_search(args.prompt, params)
        else:
            outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for i, (prompt, output) in enumerate(zip(args.prompt, outputs)):
        print(f"prompt {i}: {prompt!r}")
        lines = _beam_lines(output) if beam else _completion_lines(output)
        print("\n".join(f"  {line}" for line in lines))
    print()
    print(memory_report(llm.engine, peak))
    print(
        f"Swap: a CPU pool of {llm.stats()['num_cpu_blocks']} blocks (--swap-space, at most "
        "what --max-num-seqs full-length sequences use and half the memory available)."
    )


def _completion_lines(output) -> list[str]:
    lines = []
    for c in output.outputs:
        # Reported with logprobs only (vLLM V1's `CompletionOutput`).
        cumulative = c.cumulative_logprob
        cumulative = "" if cumulative is None else f", cumulative_logprob={cumulative:.4f}"
        # repr(): one line per completion, whatever bytes the model produced.
        lines.append(
            f"completion {c.index}: {c.text!r}  [{len(c.token_ids)} tokens, "
            f"finish_reason={c.finish_reason}{cumulative}]"
        )
        for step, top in enumerate(c.logprobs or []):
            lines.append(
                f"  logprobs[{step}]: " + " ".join(f"{t}:{lp:.3f}" for t, lp in top.items())
            )
    return lines


def _beam_lines(output) -> list[str]:
    return [
        f"beam {i}: {s.text!r}  [cum_logprob={s.cum_logprob:.4f}]"
        for i, s in enumerate(output.sequences)
    ]
