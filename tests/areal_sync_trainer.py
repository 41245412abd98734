"""The trainer side of AReaL's xccl weight sync, for tests/test_areal_integration.py (run as a subprocess).

What AReaL 1.0.4's FSDP engine does on its rank 0 (`FSDPEngine._update_weights_from_distributed`): join the
weight-update group with AReaL's own `init_custom_process_group`, then broadcast every tensor from rank 0, in
order, while the rollout worker (`VLLMWorkerExtension.areal_update_weight_xccl`) receives each one and calls
`model.load_weights([(name, tensor)])` on it. Here the group is gloo (a CPU machine) and the tensors come from
a safetensors file.

    python tests/areal_sync_trainer.py ADDR PORT GROUP_NAME WORLD_SIZE CHECKPOINT.safetensors
"""
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors.torch import load_file


def main():
    addr, port, group_name, world_size, path = sys.argv[1:6]
    from areal.engine.core.distributed import init_custom_process_group

    group = init_custom_process_group(backend="gloo", init_method=f"tcp://{addr}:{port}", world_size=int(world_size),
                                      rank=0, group_name=group_name, timeout=timedelta(seconds=300))
    tensors = load_file(path)
    for name in sorted(tensors):  # the order the rollout side was told (areal_set_weight_meta)
        dist.broadcast(tensors[name].contiguous(), src=0, group=group, async_op=False)
    print(f"broadcast {len(tensors)} tensors", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
