"""Run by torchrun from tests/test_train.py: a tiny training run whose losses it compares.

argv: out dir, "ddp" or "fsdp", the rows' seq_len, and optionally a step to stop after. Prints
the training losses and the eval losses as JSON: [whole run], or with a step to stop after,
[whole run, the same run stopped there and resumed (in <out dir>-resumed)].
"""

import json
import sys

import torch

from longkv.models import LongKVConfig
from longkv.train.config import TrainConfig
from longkv.train.loop import train

out, parallel, seq_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
config = LongKVConfig(
    vocab_size=64, d_model=32, n_layers=2, n_heads=4, mixer="kvm",
    kvm=dict(chunk_len=4, window_chunks=2, state_min_len=4, rope_dim=4),
)  # fmt: skip
rows = torch.randint(0, 64, (64, seq_len + 1), generator=torch.Generator().manual_seed(0))
cfg = TrainConfig(  # fp32: 2 ranks equal 1 process to float32 rounding (bf16's is 1e-4)
    steps=4, batch_size=8, warmup=1, eval_every=2, checkpoint_every=2, parallel=parallel,
    precision="fp32",
)  # fmt: skip
runs = [train(config, cfg, rows, rows[:16], out)]
if len(sys.argv) > 4:
    train(config, cfg, rows, rows[:16], out + "-resumed", stop_after=int(sys.argv[4]))
    runs.append(train(config, cfg, rows, rows[:16], out + "-resumed"))
rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
if rank == 0:
    print(
        json.dumps(
            [
                [m["loss"] for m in metrics] + [m["eval_loss"] for m in metrics if "eval_loss" in m]
                for metrics in runs
            ]
        )
    )
