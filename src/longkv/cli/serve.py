"""`longkv serve`: an OpenAI-compatible server over kept reads (`longkv.serve`), the model
loaded once and each request's document read by the method of `ask` (auto by default)."""

from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import dataclass
from typing import ClassVar

from longkv.checks import require, require_at_least, setting
from longkv.cli.args import command, given
from longkv.cli.ask import GROUPS, DocumentOptions
from longkv.cli.common import LoadOptions
from longkv.document.read import ReadSettings


@dataclass(frozen=True)
class ServeOptions(DocumentOptions):
    """`longkv serve`: where it listens, what it allows, and how each request's document is
    read (the options of `ask`)."""

    omitted: ClassVar[tuple[str, ...]] = ("only", "file")
    host: str = setting(
        "127.0.0.1", "the address it listens on (127.0.0.1: this machine alone; 0.0.0.0: every "
        "interface, then set --api-key)",
    )  # fmt: skip
    port: int = setting(8000, "the port it listens on")
    api_key: str | None = setting(
        None, "a key every request must send (Authorization: Bearer KEY; default: none asked)"
    )
    name: str | None = setting(None, "the model's name in requests (default: --model)")
    max_tokens: int = setting(
        1024, "answer tokens at most; a request asking more (or none) gets this many"
    )
    queue: int = setting(16, "requests that may wait; past them a request gets 503 and Retry-After")
    kept_mib: int = setting(
        2048, "memory the kept reads may hold (MiB); the least recently used go first"
    )
    body_mib: int = setting(64, "the largest request body (MiB); a larger one gets 413")
    store: str | None = setting(
        None, "a folder where the kept reads are saved (as held) and loaded again at start "
        "(default: kept in memory alone)",
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 < self.port < 65536, self, "port", f"must be 1-65535, got {self.port}")
        for name in ("max_tokens", "queue", "kept_mib", "body_mib"):
            require_at_least(1, self, name)


SERVE_GROUPS = (("the server", ("host", "port", "api_key", "name", "max_tokens", "queue",
                                "kept_mib", "body_mib", "store")), *GROUPS)  # fmt: skip


def configure(name: str, parser: argparse.ArgumentParser) -> None:
    """The options of `longkv serve`."""
    command(parser, run, LoadOptions, ServeOptions, groups=SERVE_GROUPS)


def run(args: argparse.Namespace, argv: list[str]) -> int:
    m, o = args.settings[LoadOptions], args.settings[ServeOptions]
    try:
        import uvicorn

        from longkv.serve.app import Limits, make_app
        from longkv.serve.kept import KeptReads
        from longkv.serve.store import Store
        from longkv.serve.worker import Reader, Worker
    except ImportError as err:
        print(f"longkv serve needs its extra: pip install 'longkv[serve]' ({err})", file=sys.stderr)
        return 2
    path, config, tokenizer = m.entrance()
    model = m.load_weights(path, o.dtype)
    named = given(args)

    def settings_for(positions: int) -> ReadSettings:
        """How a request of `positions` positions is read; a SettingError where it cannot be."""
        chosen = o.chosen(config, positions, named, say=False)
        chosen.check_positions(config, positions, m.allow_extrapolation)
        return chosen.read_settings(model, m.allow_extrapolation)

    settings_for(1)  # the options refused now, not at each request
    store = None if o.store is None else Store(o.store, model, tokenizer)
    reader = Reader(model, tokenizer, settings_for, KeptReads(o.kept_mib << 20), store)
    worker = Worker(reader, o.queue, reader.save_kept)
    limits = Limits(o.name or m.model, o.max_tokens, o.body_mib << 20, o.api_key)
    app = make_app(reader, worker, limits)
    print(f"serving {limits.model} at http://{o.host}:{o.port}/v1", file=sys.stderr, flush=True)
    stopped: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn raises the signal it stopped on again
        signal.signal(sig, lambda number, frame: stopped.append(number))
    uvicorn.run(app, host=o.host, port=o.port, log_level="warning")
    worker.stop()
    why = f" on {signal.Signals(stopped[0]).name}" if stopped else ""
    print(f"stopped{why}: the request in flight answered", file=sys.stderr)
    return 0
