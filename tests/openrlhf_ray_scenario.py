"""Real local Ray workers see the OpenRLHF patch (run by tests/test_openrlhf_integration.py).

    cd tests && python -m flashrl_kernels.integrations.openrlhf openrlhf_ray_scenario

The launcher patches this driver and adds flashrl's `worker_process_setup_hook` to the runtime_env of the
`ray.init` below, which is the call OpenRLHF's train_ppo_ray makes (its env_vars, nothing else). Two actor
processes (standing in for OpenRLHF's actor and critic / trainer workers, which never import flashrl_kernels)
then report whether OpenRLHF is patched in them, and compute OpenRLHF's PolicyLoss (and, in one, its GAE) against
OpenRLHF's own classes. A third worker, whose environment has the setup hook emptied, reports: unpatched. Prints one line `RESULT {json}`.
"""
import json
import os
import sys

import openrlhf_scenario as sc

sc.install_flash_attn_stub()  # PYTHONPATH too: the Ray workers inherit this process's environment


class Probe:
    def report(self, gae: bool):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        hook_imported = "flashrl_kernels.integrations.openrlhf" in sys.modules  # before this method imports it
        import openrlhf.models as orl_models

        from flashrl_kernels.integrations import openrlhf as adapter

        class Ops(TorchDispatchMode):
            n = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                Ops.n += func.name().startswith("flashrl::")
                return func(*args, **(kwargs or {}))

        original = adapter._originals.get(("openrlhf.models.loss", "PolicyLoss"), orl_models.PolicyLoss)
        g = torch.Generator().manual_seed(os.getpid() % 1000)
        old = -torch.rand(4, 9, generator=g) * 3 - 0.05
        new = old + 0.5 * torch.randn(4, 9, generator=g)
        roll = old + 0.2 * torch.randn(4, 9, generator=g)
        adv = torch.randn(4, 9, generator=g)
        mask = torch.rand(4, 9, generator=g) > 0.2
        kw = {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "dual_clip": 3.0, "is_correction_level": "token"}
        outs = []
        for cls in (orl_models.PolicyLoss, original):
            lp = new.clone().requires_grad_(True)
            with Ops():
                loss = cls(**kw)(lp, old, adv, mask, roll)[0]
                loss.backward()
            outs.append((loss.detach(), lp.grad))
        flashrl_ops, Ops.n = Ops.n, 0
        res = {
            "pid": os.getpid(), "hook_imported": hook_imported, "patched": adapter.is_patched(),
            "policy_module": orl_models.PolicyLoss.__module__, "flashrl_ops": flashrl_ops,
            "max_diff": max(float((outs[0][0] - outs[1][0]).abs()), float((outs[0][1] - outs[1][1]).abs().max())),
        }
        if gae:
            from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker as M

            res["gae_patched"] = M.get_advantages_and_returns is adapter.get_advantages_and_returns
            key = (adapter._GAE_MODULE, "RemoteExperienceMaker.get_advantages_and_returns")
            gae_original = adapter._originals.get(key, M.get_advantages_and_returns)
            v, r = torch.randn(3, 11, generator=g), torch.randn(3, 11, generator=g)
            m = torch.arange(11)[None, :] < torch.tensor([[11], [6], [0]])
            a1, r1 = M.get_advantages_and_returns(None, v, r, m, 1.0, 0.95)
            a0, r0 = gae_original(None, v, r, m, 1.0, 0.95)
            res["gae_diff"] = max(float((a1 - a0).abs().max()), float((r1 - r0).abs().max()))
        return res


def main():
    import ray
    from ray._private import ray_constants

    openrlhf_env = {"env_vars": {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN",
                                 "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}}
    ray.init(num_cpus=1, include_dashboard=False, runtime_env=openrlhf_env)  # OpenRLHF's call; the launcher adds the hook
    probe = ray.remote(num_cpus=0)(Probe)
    workers = [probe.remote(), probe.remote()]
    # the negative control: a worker whose environment has no setup hook (Ray's own variable for it, emptied)
    plain = probe.options(runtime_env={"env_vars": {ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR: ""}}).remote()
    hooked = ray.get([workers[0].report.remote(True), workers[1].report.remote(False)])
    plain = ray.get(plain.report.remote(False))
    ray.shutdown()
    print("RESULT " + json.dumps({"driver_pid": os.getpid(), "hooked": hooked, "plain": plain}), flush=True)


if __name__ == "__main__":
    main()
