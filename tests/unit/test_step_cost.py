"""A decode step's work is a fixed number of torch ops, whatever the number of sequences:
no layer loops over the batch (the index tensors are built once per step)."""
from __future__ import annotations

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import random_prompt, tiny_engine, write_tiny_checkpoint
from kvmesh.workers.sampling.params import SamplingParams


class OpCounter(TorchDispatchMode):
    """Records every dispatched op that computes (views are metadata: torch's decompositions
    add or drop some for size-1 dimensions)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def decode_step_ops(path, name: str, n_seqs: int, prompt_len: int, steps: int) -> list[list[str]]:
    """The ops the runner (step input + forward) dispatches in each of `steps` decode steps of
    n_seqs requests with prompts of equal length."""
    engine = tiny_engine(path, name, prefix_reuse=False)
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(n_seqs):
        engine.add_request(f"r{i}", random_prompt(prompt_len, seed=i), params)
    while any(not s.output for s in engine.seqs.values()):
        engine.step()
    counts = []
    for _ in range(steps):
        batch = engine.scheduler.schedule().batch
        assert [n for _, n in batch] == [1] * n_seqs
        with OpCounter() as counter:
            engine.runner.run(batch)
        counts.append(counter.ops)
        for seq, n in batch:      # finish the step as Engine.step does (greedy, no stop)
            seq.num_computed += n
            seq.output.append(0)
    return counts


@pytest.mark.parametrize("name", ["swa_csa_hca", "csa_hca_odd_window"])
def test_decode_step_op_count_does_not_grow_with_the_batch(tmp_path, name):
    path = write_tiny_checkpoint(tmp_path, name)
    # prompt of 15: the first decode step closes a window of every ratio (4, 8, 16), the next none
    one = decode_step_ops(path, name, 1, 15, steps=2)
    eight = decode_step_ops(path, name, 8, 15, steps=2)
    for a, b in zip(one, eight):
        assert len(a) == len(b), f"{len(a)} ops for 1 sequence, {len(b)} for 8"
        assert sorted(a) == sorted(b)


def test_indexer_picks_of_a_mixed_batch_equal_each_sequence_alone():
    """Decoding sequences are scored in one call beside prefill chunks; picks (ties included)
    are what each sequence gets on its own."""
    import torch

    from kvmesh.kernels import torch_ops
    from tests.kernel_cases import indexer_case
    seq_lens, n_q = [9, 40, 23, 61, 17], [1, 6, 1, 1, 4]
    args = indexer_case(seq_lens, n_q, 4, 16, ratio=4, epb=4, topk=5, integer=True)
    out = torch_ops.indexer_topk(**args)
    for b in range(len(seq_lens)):
        rows = args["q_seq"] == b
        alone = dict(args, q=args["q"][rows], weights=args["weights"][rows], q_pos=args["q_pos"][rows],
                     q_seq=torch.zeros(int(rows.sum()), dtype=torch.long),
                     block_table=args["block_table"][b:b + 1], key_len=args["key_len"][b:b + 1])
        assert torch.equal(out[rows], torch_ops.indexer_topk(**alone))
