"""Which CUDA device a launched process takes (``parallel.local_device_index``), decided before any CUDA call."""

from __future__ import annotations

import pytest

from megatron_logra.parallel import check_backend_layout, local_device_index


def test_each_local_rank_takes_its_own_gpu():
    assert [local_device_index(r, 8, "nccl") for r in range(8)] == list(range(8))


def test_a_process_bound_to_one_gpu_takes_it_whatever_its_local_rank():
    """``srun --gpus-per-task=1``: every process sees one device (its own, through CUDA_VISIBLE_DEVICES), 0."""
    assert [local_device_index(r, 1, "nccl", bound=True) for r in range(8)] == [0] * 8


def test_two_processes_on_a_one_gpu_node_are_refused_under_nccl():
    """Without a binding the one visible GPU would be shared: NCCL refuses that later, less clearly."""
    assert local_device_index(0, 1, "nccl") == 0
    with pytest.raises(RuntimeError, match="LOCAL_RANK=1 but this node has 1 visible CUDA devices"):
        local_device_index(1, 1, "nccl")


def test_more_processes_than_visible_gpus_is_refused_under_nccl_and_shared_under_gloo():
    with pytest.raises(RuntimeError, match="LOCAL_RANK=5 but this node has 4 visible CUDA devices"):
        local_device_index(5, 4, "nccl")
    assert [local_device_index(r, 4, "gloo") for r in range(6)] == [0, 1, 2, 3, 0, 1]


def test_pipeline_parallelism_over_gloo_is_refused_only_with_cuda_models():
    with pytest.raises(ValueError, match="parallel.backend=gloo with parallel.pp=2 on a CUDA machine"):
        check_backend_layout("gloo", True, 2)
    check_backend_layout("gloo", False, 4)  # CPU tensors: what every distributed test here runs
    check_backend_layout("gloo", True, 1)
    check_backend_layout("nccl", True, 8)


def test_nccl_is_refused_where_it_cannot_run():
    """``parallel.backend=nccl`` on a machine without a CUDA device (a login node, a CPU test) was a RuntimeError
    traceback from inside ``init_process_group`` on every rank."""
    from megatron_logra.parallel import check_backend_available

    with pytest.raises(ValueError, match="parallel.backend=nccl: this machine has no visible CUDA device; use "
                                         "parallel.backend=auto"):
        check_backend_available("nccl", False, True)
    with pytest.raises(ValueError, match="parallel.backend=nccl: this torch build has no NCCL"):
        check_backend_available("nccl", True, False)
    check_backend_available("nccl", True, True)
    check_backend_available("auto", False, False)
    check_backend_available("gloo", False, False)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="NCCL can run on this machine")
def test_train_with_nccl_on_a_cpu_machine_is_one_error_line(tmp_path, capsys, monkeypatch):
    from support.cli import exit_2

    for name in ("WORLD_SIZE", "RANK", "MEGATRON_LOGRA_TRACEBACK"):
        monkeypatch.delenv(name, raising=False)
    err = exit_2(["train", "lm-tiny", "train.steps=1", "parallel.backend=nccl", f"train.run_dir={tmp_path / 'run'}"],
                 capsys)
    assert "parallel.backend=nccl: this machine has no visible CUDA device" in err
    assert not (tmp_path / "run").exists()
