"""A multi-node launch whose tensor-parallel groups cross nodes is warned about (megatron-core makes each TP group of
consecutive ranks; torchrun numbers them node by node), naming the TP sizes that stay within a node."""

from __future__ import annotations

import pytest

from megatron_logra.launch_checks import tp_spans_nodes


def _groups_cross_nodes(tp: int, world: int, local_world: int) -> bool:
    """Reference: build the TP groups as megatron-core does (consecutive ranks) and look at each rank's node."""
    groups = [range(start, start + tp) for start in range(0, world, tp)]
    return any(len({rank // local_world for rank in group}) > 1 for group in groups)


@pytest.mark.parametrize("tp, world, local_world", [
    (tp, world, local) for local in (1, 2, 4, 8) for world in (local, 2 * local, 4 * local) for tp in (1, 2, 4, 8, 16)
    if world % tp == 0
])
def test_the_warning_is_given_exactly_when_a_tp_group_crosses_nodes(tp, world, local_world):
    warning = tp_spans_nodes(tp, world, local_world)
    assert (warning is not None) == _groups_cross_nodes(tp, world, local_world)
    if warning:
        assert f"parallel.tp={tp} spans nodes" in warning and f"{local_world} processes per node" in warning
        fits = int(warning.split("--tensor-model-parallel-size ")[1].split(")")[0])
        assert local_world % fits == 0 and tp % fits == 0 and not _groups_cross_nodes(fits, world, local_world)


def test_one_node_or_no_torchrun_is_never_warned():
    assert tp_spans_nodes(16, 8, 8) is None  # one node (the layout check refuses TP 16 on 8 ranks elsewhere)
    assert tp_spans_nodes(2, 2, None) is None and tp_spans_nodes(2, 2, 0) is None
    assert tp_spans_nodes(16, 16, 8) == tp_spans_nodes(16, 16, 8) is not None
