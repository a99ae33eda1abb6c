"""``bench throughput --model smollm2``: the workload is built for the named model.

The oracle is SmolLM2's own files: its config (vocabulary, context) and tokenizer
(which ids are special), read by transformers, not by the code under test.
"""

from transformers import AutoConfig, AutoTokenizer

from minipaged.bench.presets import make_workload


def test_a_model_name_resolves_to_its_checkpoint(smollm2):
    work = make_workload("smollm2", num_requests=4, length_scale=0.05)
    config = AutoConfig.from_pretrained(smollm2, local_files_only=True)
    special = set(AutoTokenizer.from_pretrained(smollm2, local_files_only=True).all_special_ids)
    assert work.config.vocab_size == config.vocab_size
    assert work.max_model_len == config.max_position_embeddings
    assert [len(p) for p in work.prompts] == [r.prompt_len for r in work.requests]
    assert all(0 <= t < config.vocab_size and t not in special for p in work.prompts for t in p)
