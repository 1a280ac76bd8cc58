"""Run by torchrun from tests/test_train.py: a tiny training run whose losses it compares."""

import json
import sys

import torch

from longkv.models import LongKVConfig
from longkv.train.loop import TrainConfig, train

out = sys.argv[1]
config = LongKVConfig(
    vocab_size=64, d_model=32, n_layers=2, n_heads=4, mixer="kvm",
    kvm=dict(chunk_len=4, window_chunks=2, state_min_len=4, rope_dim=4),
)  # fmt: skip
rows = torch.randint(0, 64, (64, 17), generator=torch.Generator().manual_seed(0))
cfg = TrainConfig(steps=4, batch_size=8, warmup=1, eval_every=2, checkpoint_every=2)
metrics = train(config, cfg, rows, rows[:16], out)
rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
if rank == 0:
    print(json.dumps([m["loss"] for m in metrics]))
