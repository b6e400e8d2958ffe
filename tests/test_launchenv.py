"""The launcher environment is read in one place (piper_plan.launchenv) by training and both benchmarks."""

import pytest

from piper_plan.errors import PiperError
from piper_plan.launchenv import LaunchEnv, device_index, read_launch_env


def test_srun_torchrun_emulation_and_a_lone_process():
    srun = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_NUM_NODES": "2"}
    assert read_launch_env(srun) == LaunchEnv(9, 16, 1, 8, "srun")
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert read_launch_env(torchrun) == LaunchEnv(3, 4, 1, 2, "torchrun")
    assert read_launch_env({"RANK": "3", "WORLD_SIZE": "8", "PIPER_EMULATE_TOPOLOGY": "2x4"}) == \
        LaunchEnv(3, 8, 3, 4, "torchrun")
    assert read_launch_env({}) == LaunchEnv(0, 1, 0, 1, "none")
    assert read_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).launched is False   # srun of one task


@pytest.mark.parametrize("environ", [{"RANK": "x", "WORLD_SIZE": "2"}, {"RANK": "5", "WORLD_SIZE": "2"},
                                     {"RANK": "0", "WORLD_SIZE": "8", "PIPER_EMULATE_TOPOLOGY": "3x3"},
                                     {"RANK": "0", "WORLD_SIZE": "8", "PIPER_EMULATE_TOPOLOGY": "two"},
                                     # str.isdigit's superscript two: int() raised a traceback
                                     {"RANK": "0", "WORLD_SIZE": "8", "PIPER_EMULATE_TOPOLOGY": "\u00b2x4"},
                                     {"RANK": "0", "WORLD_SIZE": "8", "PIPER_EMULATE_TOPOLOGY": "9" * 5000 + "x1"}])
def test_bad_launcher_variables_are_one_line(environ):
    with pytest.raises(PiperError):
        read_launch_env(environ)


def test_device_index_with_one_visible_device_per_task_and_all_visible():
    # --gpus-per-task=1 --gpu-bind=closest: each task sees one device, SLURM_LOCALID runs 0..7
    assert [device_index(local, 1) for local in range(8)] == [0] * 8
    assert [device_index(local, 8) for local in range(8)] == list(range(8))
    with pytest.raises(PiperError):
        device_index(0, 0)


def test_ranks_of_a_node_never_share_a_device():
    # 8 ranks on a node torch shows 4 devices (or 1, under torchrun / piper run) put two ranks on one device:
    # NCCL refuses after the ranks started; one line before instead
    from piper_plan.launchenv import check_visible_devices

    check_visible_devices(8, 8, "torchrun")
    check_visible_devices(1, 8, "srun")                  # --gpus-per-task=1: each task its own device
    for visible, launcher in ((4, "torchrun"), (1, "torchrun"), (4, "srun"), (0, "srun")):
        with pytest.raises(PiperError, match=f"8 ranks on this node, one device each, but torch sees {visible}"):
            check_visible_devices(visible, 8, launcher)
