"""Which answers in an earlier niah result file (`NiahRun.save`) a run may take instead of
answering: all of them from a file of the same settings (an interrupted grid), or those of its
own method runs and cells from a file whose other settings these runs do not read (a grid split
over processes, or grown by more samples, lengths or runs).
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from longkv.caches.methods import BOUNDED, BoundedOptions, reader_of
from longkv.checks import require
from longkv.evals.niah_records import NiahRecord, NiahSettings

# what a file written before a setting existed did, where that is not the setting's default:
# two-level KVM-Fold routed every query head and query on its own
BEFORE = {"routing": "token", "leaf_budget": 0}


def saved_settings(data: dict[str, Any]) -> dict[str, Any]:
    """The settings of a niah result file (`NiahRun.save`), with any setting added after the
    file was written as the file's runs had it (`BEFORE`, else its default)."""
    defaults = {f.name: BEFORE.get(f.name, f.default) for f in fields(NiahSettings)}
    return {**json.loads(json.dumps(defaults)), **data.get("settings", {})}


def saved_records(path: Path, settings: NiahSettings) -> list[NiahRecord]:
    """Records of an earlier run with the same settings at path (none if it differs)."""
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    if saved_settings(data) != json.loads(json.dumps(asdict(settings))):
        return []
    return [NiahRecord(**r) for r in data["records"]]


# the settings that choose which runs (by label) and cells (task, length, depth, seed) a file
# answered, and where file leaves go; the others must agree for answers to be reused
RUN_FIELDS = (
    "methods", "budgets", "kvm_states", "kvm_open", "kvm_leaves", "kvm_slot_key",
    "kvm_slot_score", "kvm_leaf_dir", "positions", "only",
)  # fmt: skip
GRID_FIELDS = ("tasks", "lengths", "depths", "samples", "seed", "exact_up_to")
RETRIEVAL = ("two-level", "quest")  # the runs that open units (`reader_of`)
KVM = ("kvm-fold", "two-level")
# settings that only some runs read (by `reader_of`): a difference in one keeps the others'
# answers
ONLY_FOR = {
    "chunk_size": ("fold",),
    "variant": ("fold",),
    "sinks": (*BOUNDED, "two-level"),
    "stream_chunk": (*BOUNDED, "two-level"),
    "window": ("snapkv", *KVM, "quest", "infllm"),
    **{f.name: KVM for f in fields(BoundedOptions) if f.name.startswith("kvm_")},
    "routing": RETRIEVAL,
    "leaf_budget": RETRIEVAL,
    **{f.name: ("quest",) for f in fields(BoundedOptions) if f.name.startswith("quest_")},
    **{f.name: ("infllm",) for f in fields(BoundedOptions) if f.name.startswith("infllm_")},
}


def reusable_records(path: Path, s: NiahSettings) -> tuple[list[NiahRecord], dict[str, Any]]:
    """The answers in a niah result file (`NiahRun.save`) to runs and cells of this grid whose
    runs read no option that differs from these (`ONLY_FOR`: the fold's answers at another
    chunk size are left, full attention's taken), and the file's provenance; a SettingError if
    an option that every answer reads differs."""
    data = json.loads(path.read_text())
    ours = json.loads(json.dumps(asdict(s)))
    theirs = saved_settings(data)
    differ = [k for k in ours if k not in RUN_FIELDS + GRID_FIELDS and theirs[k] != ours[k]]
    everyone = [k for k in differ if k not in ONLY_FOR]
    require(
        not everyone,
        NiahSettings,
        "methods",
        f"{path} answered another grid ({everyone} differ); its answers cannot be reused",
    )
    keys = set(s.keys)
    records = [
        record
        for record in (NiahRecord(**r) for r in data["records"])
        if record.key in keys and not any(reader_of(record.method) in ONLY_FOR[k] for k in differ)
    ]
    return records, data.get("provenance", {})


def reused_answers(paths: tuple[str, ...], s: NiahSettings) -> tuple[list[NiahRecord], list[str]]:
    """The answers of every file in paths that this grid may take (`reusable_records`), one per
    run and cell (the first file's, where several files answered it), and a page line per file
    naming how many it gave and the command that gave them."""
    records: list[NiahRecord] = []
    lines: list[str] = []
    for path in paths:
        found, source = reusable_records(Path(path), s)
        known = {r.key for r in records}
        taken = [r for r in found if r.key not in known]
        records += taken
        lines.append(
            f"- {len(taken)} needle answers from `{source.get('command')}` "
            f"(commit `{source.get('commit')}`)"
        )
    return records, lines
