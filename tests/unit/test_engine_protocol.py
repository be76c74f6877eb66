"""Engine and DataParallelEngine (not a subclass) offer one API, EngineProtocol: every method it
names takes the same parameters on both classes, and a live Engine is an instance of it (the
data-parallel front's instance check is in test_data_parallel.py, where one is running)."""
import inspect

import pytest

from tests.helpers import tiny_engine, write_tiny_checkpoint
from kvmesh.workers.engine import DataParallelEngine, Engine, EngineProtocol
from kvmesh.workers.sampling.params import SamplingParams

METHODS = sorted(n for n, v in vars(EngineProtocol).items() if inspect.isfunction(v) and not n.startswith("_"))


@pytest.mark.parametrize("cls", [Engine, DataParallelEngine])
@pytest.mark.parametrize("name", METHODS)
def test_both_engines_take_every_protocol_method_s_parameters(cls, name):
    wanted = inspect.signature(getattr(EngineProtocol, name)).parameters
    given = inspect.signature(getattr(cls, name)).parameters
    assert [(p, wanted[p].kind) for p in wanted] == [(p, given[p].kind) for p in wanted if p in given]


def test_an_engine_is_an_engine_protocol_and_generates_through_it(tmp_path):
    engine = tiny_engine(write_tiny_checkpoint(tmp_path, "swa_csa_hca"), "swa_csa_hca")
    assert isinstance(engine, EngineProtocol)
    out = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, n=2))
    assert [(o.index, len(o.token_ids)) for o in out] == [(0, 3), (1, 3)] * 2
    assert engine.rank_stats[0].counters.generated_tokens == 12
