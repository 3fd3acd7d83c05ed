"""The device rule, proven on a CPU: under the device audit every tensor that enters a
collective and every parameter the optimizer steps was placed on the run's device (what NCCL
and megatron's optimizer require on a GPU), across TP, PP and MoE/EP layouts with the
controller, probes and both monitors on."""

import json
import subprocess
import sys
import textwrap

from tests.helpers import LAUNCH_TIMEOUT_S, REPO, TINY, run_batch

RUN = [*TINY, "--train-iters", "4", "--lr-warmup-iters", "1", "--eval-interval", "2",
       "--gnmr", "--gnmr-agreement-interval", "2", "--monitors", "attention",
       "--monitor-interval", "2", "--monitor-delta", "1"]
LAYOUTS = {
    "tp2_fp8_probes": ["--tensor-model-parallel-size", "2", "--precision-recipe",
                       "fp8-torchao", "--ffn-hidden-size", "192",
                       "--gnmr-signals", "gnmr,qerr"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "moe_ep2_router": ["--num-experts", "4", "--moe-aux-loss-coeff", "0.01",
                       "--expert-model-parallel-size", "2",
                       "--monitors", "attention,router"],
}


def audit_reports(prefix, ranks=2) -> list[dict]:
    return [json.loads(open(f"{prefix}.rank{rank}.json").read()) for rank in range(ranks)]


def test_every_collective_and_optimizer_tensor_is_on_the_run_device(tmp_path, monkeypatch):
    """The three layouts in one torchrun launch, audited throughout."""
    prefix = tmp_path / "audit"
    monkeypatch.setenv("MEGATRON_GNMR_DEVICE_AUDIT", str(prefix))
    # and a TP=2 run stopped at step 2 and resumed: every restored tensor (the attention
    # monitor's weight snapshots among them) must leave the host. Emulated FP8, not torchao's:
    # torchao keeps no state to restore, and its float8 GEMM is a slow reference kernel on
    # some CPUs (the torchao layout above trains it once)
    resumed = [*RUN, "--tensor-model-parallel-size", "2", "--precision-recipe", "fp8-emulated",
               "--gnmr-signals", "gnmr,qerr", "--save", str(tmp_path / "resumed")]
    run_batch([*([*RUN, *flags, "--save", str(tmp_path / name)] for name, flags in
                 LAYOUTS.items()),
               [*resumed, "--exit-interval", "2"], [*resumed, "--resume", "auto"]], nproc=2)
    for report in audit_reports(prefix):
        assert report["violations"] == []
        # The audit saw the traffic it vouches for.
        assert report["checked"]["collective_tensors"] > 100
        assert report["checked"]["optimizer_parameters"] > 0
        assert report["checked"]["restored_tensors"] > 10


AUDIT_CATCHES = textwrap.dedent("""
    import json, os, sys
    os.environ["MEGATRON_GNMR_DEVICE_AUDIT"] = sys.argv[1]
    import torch
    from megatron_gnmr.platform import apply_cpu_patches, device
    apply_cpu_patches()
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(),
                                         rank=0, world_size=1)
    placed = torch.zeros(2, device=device.run_device())
    derived = placed * 2 + 1
    torch.distributed.all_reduce(derived)                           # fine
    torch.distributed.all_reduce(torch.zeros(3, dtype=torch.float64))  # forgot the rule
    torch.distributed.all_reduce(placed.cpu())                      # moved off the device
    host = torch.nn.Linear(4, 4)                                    # never moved
    moved = torch.nn.Linear(4, 4).to(device.run_device())
    for module in (host, moved):
        torch.optim.SGD(module.parameters(), lr=0.1).step()
    from megatron_gnmr.platform import device_audit
    shard = {"w": torch.ones(3, 3), "step": torch.tensor(1.0)}     # as read from a checkpoint
    device_audit.mark_restored(shard)
    device_audit.check_restored("a state", {"kept": shard["w"].clone(),  # left on the host
                                            "moved": shard["w"].to(device.run_device()),
                                            "step": shard["step"]})  # 0-dim: may stay
    placed + torch.ones(2)                                          # host into a device op
    placed + torch.tensor(1.0)                                      # 0-dim: fine
    placed[torch.tensor([0])]                                       # a host index: fine
    placed.copy_(torch.ones(2))                                     # a copy across: fine
    gathered = [None]
    torch.distributed.all_gather_object(gathered, {"a": placed})    # pickled with its device
    torch.distributed.all_gather_object(gathered, {"a": placed.cpu()})  # fine
    import io
    torch.save({"w": placed}, io.BytesIO())                         # a device tensor saved
    buffer = io.BytesIO()
    torch.save({"w": placed.cpu()}, buffer)                         # fine
    buffer.seek(0)
    torch.load(buffer, weights_only=True)                           # where would it land?
    buffer.seek(0)
    torch.load(buffer, map_location="cpu", weights_only=True)       # fine
""")


def test_the_audit_flags_host_tensors_and_host_parameters(tmp_path):
    """The audit itself can fail: host tensors in a collective, an optimizer over a module
    that was never moved, restored state left on the host, a host tensor in a device op,
    device tensors pickled (an object collective, torch.save) and a load that does not say
    where to are each recorded; what a GPU accepts is not."""
    prefix = tmp_path / "audit"
    result = subprocess.run([sys.executable, "-c", AUDIT_CATCHES, str(prefix)], cwd=REPO,
                            capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    report = audit_reports(prefix, ranks=1)[0]
    what = [v["what"] for v in report["violations"]]
    assert what == ["host tensor (3,) torch.float64 in torch.distributed.all_reduce",
                    "host tensor (2,) torch.float32 in torch.distributed.all_reduce",
                    "host parameter (4, 4) in SGD.step", "host parameter (4,) in SGD.step",
                    "host tensor (3, 3) torch.float32 restored into a state",
                    "host tensor mixed with device tensors in add",
                    "device tensor (2,) torch.float32 in torch.distributed.all_gather_object",
                    "device tensor (2,) torch.float32 in torch.save",
                    "torch.load without map_location"]
    assert report["checked"] == {"collective_tensors": 3, "optimizer_parameters": 4,
                                 "restored_tensors": 3, "objects": 4}
