"""The GPU-only choices of data-parallel training, decided on the CPU: which FSDP2 mixed-precision policy and
whether AdamW runs fused, for each device type and --dtype (the real runs are tests/gpu/test_distributed_gpu.py);
--dist-timeout's check and the rerun rule that ignores it; the all-gather of a forward pass's rows
in a one-process gloo group (two processes: tests/e2e/test_distributed.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from rlkit import training
from rlkit.errors import RlkitError
from rlkit.training import Precision, TrainOptions


@pytest.mark.parametrize("dtype,device_type,want", [("bf16", "cuda", "bf16"), ("fp32", "cuda", None),
                                                    ("bf16", "cpu", None), ("fp32", "cpu", None)])
def test_fsdp_policy_is_bf16_gathers_on_gpus_only(dtype, device_type, want):
    assert training.fsdp_param_dtype(dtype, device_type) == want
    policy = training.fsdp_mp_policy(dtype, device_type)
    if want is None:  # fp32 and the CPU: no policy, so gloo runs compute what they always computed
        assert policy is None
    else:  # bf16 weights gathered, gradients reduced in fp32 onto the fp32 shards
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    # under FSDP with the policy, autocast is not entered; one process (or the CPU) keeps it
    assert Precision(dtype, device_type, sharded=True).autocasts == (dtype != "fp32" and want is None)
    assert Precision(dtype, device_type).autocasts == (dtype != "fp32")


def test_adamw_is_fused_when_every_parameter_is_on_a_gpu():
    assert training.fused_adamw(["cuda", "cuda"])
    assert not training.fused_adamw(["cuda", "cpu"]) and not training.fused_adamw(["cpu"])
    assert not training.fused_adamw([])  # nothing trained: torch's default
    opt = training.make_adamw(torch.nn.Linear(3, 2), 1e-3, 0.0)
    assert not opt.defaults.get("fused")  # the CPU: torch's default, as before


def test_dist_timeout_checked_and_not_compared_on_rerun():
    for bad, shown in ((0.0, "0"), (-5.0, "-5"), (float("nan"), "nan"), (float("inf"), "inf")):
        with pytest.raises(RlkitError, match=f"--dist-timeout {shown}: expected a number of minutes > 0"):
            TrainOptions(dist_timeout=bad).check()
    TrainOptions(dist_timeout=0.5).check()
    from rlkit.io import manifests
    from rlkit.stages.update import UpdateConfig

    a = UpdateConfig(policy="p", out="o")
    b = UpdateConfig(policy="p", out="o", train=TrainOptions(dist_timeout=120.0))
    assert manifests._comparable(a) == manifests._comparable(b)
    assert manifests._comparable(a) != manifests._comparable(UpdateConfig(policy="p", out="o",
                                                                          train=TrainOptions(dtype="bf16")))


def test_gather_rows_in_a_one_process_group():
    import torch.distributed as dist

    from rlkit.training import distributed

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(minutes=1))
    try:
        dp = distributed.DataParallel(0, 1, torch.device("cpu"))
        local = torch.arange(10.0).reshape(5, 2)
        assert torch.equal(distributed.gather_rows(local, 5, dp), local)
        t = [torch.tensor(1.5), torch.tensor(2.0, dtype=torch.float64)]
        assert distributed.host64([*distributed.mean_over_ranks(t, dp), 3]) == [1.5, 2.0, 3.0]
        distributed.wait_for_main(dp, "test")  # rank 0 only says it got there
    finally:
        dist.destroy_process_group()


def test_drift_of_a_model_on_a_device_is_one_host_read():
    """The drift figure of a policy on a (simulated) GPU against a reference on the host: the same value as on
    the CPU, bit for bit, read back in one sync (not one per tensor)."""
    from devsim import SecondDevice

    from rlkit.training.drift import relative_drift

    gen = torch.Generator().manual_seed(0)
    ref = {f"w{i}": torch.randn(4, 3, generator=gen).to(torch.bfloat16) for i in range(5)}
    cpu = {k: v.float() + 0.05 * torch.randn(4, 3, generator=gen) for k, v in ref.items()}
    want = relative_drift(cpu, ref)
    mode = SecondDevice()
    with mode as dev:
        got = relative_drift({k: v.to(dev) for k, v in cpu.items()}, ref)
    assert got == want > 0 and mode.syncs["rlkit"] == 1
