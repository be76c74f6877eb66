"""`bench/goodput.py --json` against a running deployment (issue 46 item 1): the session's
default colocated app, a few trace requests replayed open-loop over HTTP; every request
succeeds, replicas are read from /metrics (`kvmesh_pool_replicas`), and goodput is the good
requests per replica-second."""
from __future__ import annotations

import json

import pytest

from bench import goodput

pytestmark = pytest.mark.slow     # a Serve app


@pytest.fixture(scope="module")
def url(local_serve):
    return local_serve.deploy_many({}, shared=("colocated",))["colocated"]


def test_goodput_json_line_and_plot(url, capsys, tmp_path):
    plot = tmp_path / "goodput.png"
    assert goodput.main(["--url", url, "--slo-ttft-ms", "600000", "--slo-itl-ms", "600000", "--requests", "6",
                         "--time-scale", "50", "--max-tokens", "4", "--json", "--plot", str(plot)]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (row["requests"], row["failed"], row["good"], row["attainment"]) == (6, 0, 6, 1.0), row["errors"]
    assert row["replicas_max"] == {"colocated": 1} and row["replica_s"] > 0
    assert row["goodput_per_replica_s"] == pytest.approx(6 / row["replica_s"])
    assert plot.stat().st_size > 10_000
