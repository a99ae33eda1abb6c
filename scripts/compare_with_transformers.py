"""Load a checkpoint that ``minipaged quantize`` wrote in transformers, and compare its
prompt logprobs with minipaged's on the same tokens (float32, one CPU thread):

    python scripts/compare_with_transformers.py OUT [--backend gptq_torch]

transformers (5.x) loads GPTQ checkpoints through optimum and gptqmodel, and AWQ ones
through gptqmodel; neither is a dependency of this project (gptqmodel pins an older
numpy and builds from source), so install them beside it, for instance
``pip install --target DIR --no-deps --no-build-isolation -c constraints-cpu.txt
gptqmodel optimum`` and their small pure-Python dependencies, then run this script with
``PYTHONPATH=DIR``.  ``--backend`` picks gptqmodel's kernel: its default CPU kernel
(``gptq_torch_aten``, torch's int4 op) refuses SmolLM2's 576 input columns in groups of
128, so the default here is its plain torch kernel (``gptq_torch``; ``torch_awq`` for
AWQ).  It prints the largest |Δ logprob| over each position's top 5 and how many
positions' argmax agree (docs/performance.md, "Quantized weights", has SmolLM2's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AwqConfig, GPTQConfig

from minipaged.llm import LLM
from minipaged.sampling_params import SamplingParams

PROMPT = list(range(100, 164))  # 64 token ids: any fixed ids will do
TOP = 5


def transformers_logprobs(path: Path, backend: str | None) -> torch.Tensor:
    method = json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"]
    if method == "awq":
        config = AwqConfig(bits=4, backend=backend or "torch_awq")
    else:
        config = GPTQConfig(bits=4, backend=backend or "gptq_torch")
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, device_map="cpu", quantization_config=config
    ).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), -1)


def minipaged_logprobs(path: Path) -> list[dict[int, float]]:
    llm = LLM(str(path), device="cpu", dtype="float32", swap_space=0)
    params = SamplingParams(max_tokens=1, prompt_logprobs=TOP)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    return out.prompt_logprobs[1:]  # entry i scores position i + 1 given the ones before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--backend", default=None, help="gptqmodel's kernel")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hf = transformers_logprobs(args.path, args.backend)
    ours = minipaged_logprobs(args.path)
    diffs = [abs(lp - float(hf[i, t])) for i, entry in enumerate(ours) for t, lp in entry.items()]
    agree = sum(int(hf[i].argmax()) == max(e, key=e.get) for i, e in enumerate(ours))
    print(
        f"{args.path.name}: max |dlogprob| {max(diffs):.4f}, mean {sum(diffs) / len(diffs):.5f} "
        f"over {len(diffs)} top-{TOP} entries; argmax agrees at {agree}/{len(ours)} positions"
    )


if __name__ == "__main__":
    main()
