"""`longkv models`: the converted models and GGUF files in the cache directory, with their
sizes; `--remove NAME` removes one (it is converted again when next used)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from longkv.checks import refused_as, setting
from longkv.cli.args import command
from longkv.models.cache import cached_models, remove_cached
from longkv.models.pretrained import cache_dir


@dataclass(frozen=True)
class ModelsOptions:
    """`longkv models`: list the cache, or remove one entry of it."""

    remove: str | None = setting(
        None, "remove the cached model or GGUF file of this name (as listed); it is converted "
        "or put together again when next used",
    )  # fmt: skip


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """The options of `longkv models`."""
    command(parser, run, ModelsOptions)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    o = args.settings[ModelsOptions]
    if o.remove is not None:
        with refused_as(o, "remove"):
            gone = remove_cached(o.remove)
        print(f"removed {gone.name} ({gone.size / 2**20:.0f} MiB): {gone.path}")
        return 0
    entries = cached_models()
    print(f"{cache_dir()} ($LONGKV_CACHE): {len(entries)} entries")
    for c in entries:
        print(f"{c.name:40} {c.size / 2**20:8.0f} MiB  {c.kind}: {c.path}")
    return 0
