from isbflow.spec import load_specs
from tests.conftest import ROOT


def test_demo_spec_loads():
    specs = load_specs(ROOT / "pipelines" / "logs.yaml")
    assert specs.pipelines["logs"].topological_order()[0] == "in"
