"""``workbench.device.graph_op``: an operator that runs its function eagerly, stays one opaque node in a compiled
graph, and traces with its fake function."""

import pytest
import torch

from workbench.device import graph_op


def _scaled_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x[:rows] * 2.0 + 1.0


scaled_rows = graph_op(
    "wbtest_graph_op::scaled_rows",
    "(Tensor x, int rows) -> Tensor",
    _scaled_rows,
    lambda x, rows: x.new_empty(rows, x.shape[1]),
)


def test_eager_call_runs_the_function():
    x = torch.tensor([[1.0, -2.0], [0.5, 3.0], [4.0, 0.0]])
    got = scaled_rows(x, 2)
    assert torch.equal(got, torch.tensor([[3.0, -3.0], [2.0, 7.0]]))  # 2x + 1 of the first two rows, by hand
    assert scaled_rows is torch.ops.wbtest_graph_op.scaled_rows.default


def test_compiled_graph_keeps_one_opaque_node_and_traces_with_the_fake():
    graphs = []

    def backend(gm, example_inputs):  # noqa: ANN001, ANN202
        graphs.append(gm)
        return gm.forward

    def f(x: torch.Tensor) -> torch.Tensor:
        return scaled_rows(x + 1.0, 3).sum(dim=1)

    x = torch.arange(8.0).reshape(4, 2)
    got = torch.compile(f, backend=backend, fullgraph=True)(x)
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.wbtest_graph_op.scaled_rows.default) == 1
    # rows 0-2 of x + 1 are [1, 2], [3, 4], [5, 6]; 2v + 1 summed per row: 3 + 5, 7 + 9, 11 + 13
    assert torch.equal(got, torch.tensor([8.0, 16.0, 24.0]))
    # through AOT autograd (functionalization and fake tensors), as inductor sees it
    again = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(again, got)


def test_a_second_definition_of_the_same_name_is_refused():
    with pytest.raises(RuntimeError, match="scaled_rows"):
        graph_op("wbtest_graph_op::scaled_rows", "(Tensor x, int rows) -> Tensor", _scaled_rows, _scaled_rows)
