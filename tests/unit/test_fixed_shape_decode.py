"""The fixed-shape decode path (what CUDA graphs capture), run eagerly on the CPU: the same
greedy tokens as the ordinary path, and a forward that reads nothing back from the device."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers import random_prompt, tiny_engine, write_tiny_checkpoint
from kvmesh.workers.engine.cuda_graphs import buckets_up_to
from kvmesh.workers.sampling.params import SamplingParams

MAX_LEN = 256       # the fixed-shape path gathers entries up to max_model_len: keep it small on CPU


class ReadBack(AssertionError):
    """The forward needed a value from the device (a host sync: what a CUDA graph cannot hold)."""


class NoReadBack(TorchDispatchMode):
    """Fails on every op whose result (or output shape) depends on tensor data: .item()/int()/
    bool() of a tensor, nonzero, unique, bincount, repeat_interleave by counts, boolean-mask
    indexing."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
            indices = args[1]                          # tagged dynamic for the boolean-mask case only
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
                raise ReadBack(f"{func} with a boolean mask")
        elif func is torch.ops.aten._local_scalar_dense.default or set(func.tags) & {
                torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output}:
            raise ReadBack(f"{func} reads data back")
        return func(*args, **kwargs)


def run(engine, prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return engine.generate(prompts, params)


@pytest.mark.parametrize("name", ["swa_csa_hca", "csa_hca_odd_window", "hca_yarn_wide_window"])
def test_fixed_shape_decode_gives_the_ordinary_tokens(tmp_path, name):
    """Prompts of several lengths decode past compressor windows (ratios 4/8/16), blocks and
    the SWA window, the batch shrinking as requests end (buckets padded); then a repeated prompt
    decodes after a prefix restore (keep_tokens > 0)."""
    path = write_tiny_checkpoint(tmp_path, name)
    prompts = [random_prompt(n, seed=n) for n in (1, 5, 16, 37, 50)]
    lengths = [40, 33, 24, 29, 19]
    outs = {}
    for graphs in (False, True):
        engine = tiny_engine(path, name, max_model_len=MAX_LEN, max_num_seqs=8)
        if graphs:
            engine.enable_decode_graphs(capture=False)
        outs[graphs] = [o for p, n in zip(prompts, lengths) for o in run(engine, [p], n)]
        outs[graphs] += run(engine, prompts[2:], 30)        # together: batch 3 -> bucket 4
        outs[graphs] += run(engine, [prompts[3]], 30)       # restored prefix, then decode
        if graphs:
            assert engine.runner.graphs.replays > 100
            assert engine.counters.cached_tokens > 0
    for a, b in zip(outs[False], outs[True], strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_fixed_shape_decode_forward_reads_nothing_back(tmp_path):
    name = "swa_csa_hca"
    path = write_tiny_checkpoint(tmp_path, name)
    engine = tiny_engine(path, name, max_model_len=MAX_LEN, max_num_seqs=8)
    engine.enable_decode_graphs(capture=False)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((3, 14, 22)):
        engine.add_request(f"r{i}", random_prompt(n, seed=i), params)
    while any(len(s.output) < 5 for s in engine.seqs.values()):
        engine.step()
    graphs = engine.runner.graphs
    for _ in range(6):          # positions cross windows of every ratio and a block boundary
        batch = engine.scheduler.schedule().batch
        assert graphs.accepts(batch)
        step, _, _ = engine.runner.build(batch)
        for read in (lambda: int(step.lengths.max()), lambda: step.positions[step.positions > 9],
                     lambda: torch.nonzero(step.positions)):
            with pytest.raises(ReadBack), NoReadBack():      # the mode catches what it must
                read()
        bucket = graphs.prepare(batch)
        with NoReadBack():
            logits = graphs.forward(bucket)
        assert logits.shape[0] == 4
        for b, (seq, _) in enumerate(batch):     # finish the step as Engine.step does (greedy)
            seq.num_computed += 1
            seq.output.append(int(logits[b].argmax()))


def test_buckets_cover_every_batch_size_up_to_the_limit():
    assert buckets_up_to(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert buckets_up_to(5) == (1, 2, 4, 5)
    assert buckets_up_to(1) == (1,)


def test_a_graph_that_cannot_be_captured_leaves_eager_decoding_with_the_same_tokens(tmp_path, caplog):
    """Capture fails here (no CUDA): the runner says so once and decodes eagerly from then on."""
    name = "swa_csa_hca"
    path = write_tiny_checkpoint(tmp_path, name)
    prompts = [random_prompt(n, seed=n) for n in (3, 20)]
    plain = run(tiny_engine(path, name, max_model_len=MAX_LEN), prompts, 12)
    engine = tiny_engine(path, name, max_model_len=MAX_LEN)
    engine.enable_decode_graphs(capture=True)
    assert engine.runner.graphs is not None
    with caplog.at_level("WARNING", logger="kvmesh.workers.engine.runner"):
        got = run(engine, prompts, 12)
    assert engine.runner.graphs is None
    assert sum("CUDA graphs off" in r.getMessage() for r in caplog.records) == 1
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
